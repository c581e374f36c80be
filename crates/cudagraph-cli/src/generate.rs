//! `cudagraph generate`: text (or token ids) from a Hugging Face decoder folder, the prompt
//! prefilled eagerly and every decode step replayed from a captured graph.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use cudagraph::Device;
use cudagraph_nn::io::hf::GenerationDefaults;
use cudagraph_nn::Dtype;
use cudagraph_nn::SamplingParams;
use cudagraph_nn::{Decoder, Generation, GenerationOptions, Request};
use indicatif::{ProgressBar, ProgressStyle};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// A Hugging Face model folder: config.json, model.safetensors (or shards), and
    /// tokenizer.json for `--prompt` (with the `tokenizers` feature).
    #[arg(long)]
    pub model: PathBuf,
    /// The prompt as token ids (comma-separated).
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt")]
    pub prompt_ids: Vec<i32>,
    /// The prompt as text (needs tokenizer.json and a build with `--features tokenizers`).
    #[arg(long)]
    pub prompt: Option<String>,
    /// A user message, put into the model's chat template (chat_template.jinja or
    /// tokenizer_config.json's `chat_template`) with the assistant's turn opened; prints the
    /// reply. Needs tokenizer.json and a build with `--features tokenizers`.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_ids"])]
    pub chat: Option<String>,
    /// A system message before the --chat message.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Element type of the weights and activations.
    #[arg(long, default_value = "bf16")]
    pub dtype: Dtype,
    /// Sampling temperature (0: greedy). Default: the folder's generation_config.json where it
    /// sets `do_sample` (as transformers' `generate` does), else greedy.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep only the k most likely tokens (0: all). Default: as --temperature says.
    #[arg(long)]
    pub top_k: Option<u32>,
    /// Keep the smallest set of tokens whose probability reaches p (1: all). Default: as
    /// --temperature says.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Greedy decoding whatever the folder's generation_config.json says.
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p"])]
    pub greedy: bool,
    /// Token ids that end the sequence (comma-separated). Default: the folder's
    /// `eos_token_id`, from generation_config.json where it sets one, else from config.json.
    #[arg(long, value_delimiter = ',')]
    pub eos: Vec<i32>,
    /// Stop at no token: generate --max-new-tokens tokens.
    #[arg(long, conflicts_with = "eos")]
    pub ignore_eos: bool,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run the decode steps eagerly instead of from a captured graph.
    #[arg(long)]
    pub no_graph: bool,
    /// Decode steps per launch: a WHILE node around the captured step that stops once the
    /// sequence has ended (at least 1).
    #[arg(long, default_value_t = 1)]
    pub steps_per_launch: u32,
    /// Print the prompt on stderr before generating: with --chat the conversation as the
    /// template renders it, then the prompt's token ids (to check a template or tokenizer).
    #[arg(long)]
    pub show_prompt: bool,
}

/// The folder's tokenizer: it encodes a text prompt and decodes the output.
#[cfg(feature = "tokenizers")]
type Tokenizer = cudagraph_nn::io::hf::HfTokenizer;

/// Without the `tokenizers` feature there is no tokenizer (no value of this type exists).
#[cfg(not(feature = "tokenizers"))]
enum Tokenizer {}

/// The folder's tokenizer.json, read once; `None` where the folder has none.
#[cfg(feature = "tokenizers")]
fn tokenizer(dir: &std::path::Path) -> AnyResult<Option<Tokenizer>> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(None);
    }
    Ok(Some(Tokenizer::read(&path)?))
}

#[cfg(not(feature = "tokenizers"))]
fn tokenizer(_: &std::path::Path) -> AnyResult<Option<Tokenizer>> {
    Ok(None)
}

/// The prompt text of a --chat conversation: the template's rendering of the optional
/// --system message and the --chat message, with the assistant's turn opened.
fn chat_text(a: &GenerateArgs, message: &str) -> AnyResult<String> {
    use cudagraph_nn::io::chat::{ChatMessage, ChatTemplate};
    let template = ChatTemplate::read(&a.model)?.ok_or_else(|| {
        format!(
            "{} has no chat template (no chat_template.jinja, no `chat_template` in \
             tokenizer_config.json): a base model; pass --prompt instead",
            a.model.display()
        )
    })?;
    let mut conversation = Vec::new();
    if let Some(system) = &a.system {
        conversation.push(ChatMessage::new("system", system.as_str()));
    }
    conversation.push(ChatMessage::new("user", message));
    Ok(template.render(&conversation, true)?)
}

/// `text` as token ids through the folder's tokenizer `tok` (`special`: with the special
/// tokens the tokenizer adds); `flag` names the option that needs it.
#[cfg(feature = "tokenizers")]
fn encode(
    a: &GenerateArgs,
    tok: Option<&Tokenizer>,
    (flag, text): (&str, &str),
    special: bool,
) -> AnyResult<Vec<i32>> {
    let tok = tok.ok_or_else(|| {
        format!(
            "{flag} needs {}; pass --prompt-ids instead",
            a.model.join("tokenizer.json").display()
        )
    })?;
    Ok(tok
        .encode(text, special)?
        .into_iter()
        .map(|t| t as i32)
        .collect())
}

/// Without the `tokenizers` feature: what to build, or to pass instead.
#[cfg(not(feature = "tokenizers"))]
fn encode(
    _: &GenerateArgs,
    _: Option<&Tokenizer>,
    (flag, _): (&str, &str),
    _: bool,
) -> AnyResult<Vec<i32>> {
    Err(
        format!("{flag} needs a build with `--features tokenizers`; pass --prompt-ids instead")
            .into(),
    )
}

/// The prompt: its token ids and, with --chat, the conversation as the template rendered it.
struct Prompt {
    ids: Vec<i32>,
    rendered: Option<String>,
}

/// The prompt: --prompt-ids, or --prompt or --chat through `tok`.
fn prompt_of(a: &GenerateArgs, tok: Option<&Tokenizer>) -> AnyResult<Prompt> {
    if let Some(message) = &a.chat {
        // The template first (a base model or a malformed template is reported before a
        // missing tokenizer); it writes the special tokens itself, so none are added, as
        // transformers' apply_chat_template tokenizes.
        let text = chat_text(a, message)?;
        let ids = encode(a, tok, ("--chat", &text), false)?;
        return Ok(Prompt {
            ids,
            rendered: Some(text),
        });
    }
    // clap's `requires` is not checked where --chat would conflict with the prompt given.
    if a.system.is_some() {
        return Err(
            "--system is the system message of a --chat conversation: give --chat too".into(),
        );
    }
    let ids = match &a.prompt {
        None if a.prompt_ids.is_empty() => {
            return Err("give --prompt-ids, --prompt or --chat".into())
        }
        None => a.prompt_ids.clone(),
        Some(text) => encode(a, tok, ("--prompt", text), true)?,
    };
    Ok(Prompt {
        ids,
        rendered: None,
    })
}

/// Token ids as the command prints them: comma-separated.
fn id_list(ids: &[i32]) -> String {
    let ids: Vec<String> = ids.iter().map(i32::to_string).collect();
    ids.join(",")
}

/// A spinner on stderr naming what runs and for how long (drawn only where stderr is a
/// terminal); cleared by the caller when the phase ends.
fn phase(what: &str) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("valid template"),
    );
    pb.set_message(what.to_string());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// What `--show-prompt` prints: the rendered conversation (with --chat), then the prompt's ids.
fn shown_prompt(p: &Prompt) -> String {
    let mut text = String::new();
    if let Some(rendered) = &p.rendered {
        text += &format!("conversation as the chat template renders it:\n{rendered}\n");
    }
    text += &format!("prompt ids ({}): {}", p.ids.len(), id_list(&p.ids));
    text
}

/// The ids that end the sequence: `--eos`, none with `--ignore-eos`, else the folder's.
fn stop_ids(a: &GenerateArgs) -> AnyResult<Vec<i32>> {
    if a.ignore_eos {
        return Ok(Vec::new());
    }
    if !a.eos.is_empty() {
        return Ok(a.eos.clone());
    }
    let ids = cudagraph_nn::io::hf::eos_token_ids(&a.model)?;
    if !ids.is_empty() {
        eprintln!(
            "stopping at the model's eos token ids {} (--eos to change, --ignore-eos for none)",
            id_list(&ids)
        );
    }
    Ok(ids)
}

/// The sampling of the run: greedy with `--greedy`; else the folder's sampling defaults
/// (greedy where it has none) with `--temperature`, `--top-k` and `--top-p` replacing theirs.
/// Says on stderr where the folder's settings are used, and which of them `generate` does not
/// apply.
fn sampling_of(a: &GenerateArgs, d: &GenerationDefaults) -> SamplingParams {
    if a.greedy {
        return SamplingParams::greedy();
    }
    for (field, value) in &d.unsupported {
        eprintln!(
            "note: generation_config.json sets {field} {value}, which transformers' generate \
             applies and this one does not"
        );
    }
    let base = d.sampling.unwrap_or_else(SamplingParams::greedy);
    let p = SamplingParams {
        temperature: a.temperature.unwrap_or(base.temperature),
        top_k: a.top_k.unwrap_or(base.top_k),
        top_p: a.top_p.unwrap_or(base.top_p),
    };
    let from_file =
        d.sampling.is_some() && (a.temperature.is_none() || a.top_k.is_none() || a.top_p.is_none());
    if from_file {
        eprintln!(
            "sampling with temperature {}, top-k {}, top-p {} (the model's generation_config.json \
             samples; --greedy for greedy decoding, --temperature, --top-k, --top-p to change)",
            p.temperature, p.top_k, p.top_p
        );
    }
    p
}

pub fn run(device: usize, a: &GenerateArgs) -> AnyResult<()> {
    let tok = tokenizer(&a.model)?;
    let p = prompt_of(a, tok.as_ref())?;
    if a.show_prompt {
        eprintln!("{}", shown_prompt(&p));
    }
    let prompt = p.ids;
    let eos = stop_ids(a)?;
    let sampling = sampling_of(a, &cudagraph_nn::io::hf::generation_defaults(&a.model)?);
    let dev = Device::open(device)?;
    let mut s = dev.new_stream()?;
    let t = Instant::now();
    let pb = phase(&format!("loading {}", a.model.display()));
    let decoder = Arc::new(Decoder::load(&s, &a.model, a.dtype)?);
    s.synchronize()?;
    pb.finish_and_clear();
    let load_s = t.elapsed().as_secs_f64();
    let mut opts = GenerationOptions::new(1, prompt.len() + a.max_new_tokens);
    opts.graphs = !a.no_graph;
    opts.eos = eos;
    opts.seed = a.seed;
    opts.steps_per_launch = a.steps_per_launch;
    let t = Instant::now();
    let pb = phase(if opts.graphs {
        "compiling kernels (cached after the first run), choosing engines, capturing the decode step"
    } else {
        "compiling kernels (cached after the first run)"
    });
    let mut gen = Generation::new(&mut s, decoder, opts)?;
    pb.finish_and_clear();
    let setup_s = t.elapsed().as_secs_f64();
    let pb = phase(&format!("generating up to {} tokens", a.max_new_tokens));
    let t = Instant::now();
    let tokens = gen
        .generate(
            &s,
            &[Request {
                prompt: prompt.clone(),
                max_new: a.max_new_tokens,
                sampling,
            }],
            8,
        )?
        .pop()
        .unwrap_or_default();
    let gen_s = t.elapsed().as_secs_f64();
    pb.finish_and_clear();
    outln!("{}", id_list(&tokens));
    #[cfg(feature = "tokenizers")]
    if let Some(tok) = &tok {
        // A chat prints the reply; a prompt, the prompt and its continuation.
        let shown = if a.chat.is_some() {
            &[][..]
        } else {
            &prompt[..]
        };
        let all: Vec<u32> = shown.iter().chain(&tokens).map(|&t| t as u32).collect();
        outln!("{}", tok.decode(&all, true)?);
    }
    eprintln!(
        "{} prompt tokens, {} generated in {:.1} ms ({:.0} tokens/s, prefill included); load {:.1} s, capture {:.1} s",
        prompt.len(),
        tokens.len(),
        gen_s * 1e3,
        tokens.len() as f64 / gen_s.max(1e-9),
        load_s,
        setup_s
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: GenerateArgs,
    }

    fn parse(dir: &std::path::Path, args: &[&str]) -> Result<GenerateArgs, String> {
        let model = dir.to_str().expect("a UTF-8 temporary path");
        let all = ["generate", "--model", model];
        let cli =
            Cli::try_parse_from(all.iter().chain(args).copied()).map_err(|e| e.to_string())?;
        Ok(cli.args)
    }

    fn stops(dir: &std::path::Path, args: &[&str]) -> Result<Vec<i32>, String> {
        let args: Vec<&str> = ["--prompt-ids", "1,2"]
            .iter()
            .chain(args)
            .copied()
            .collect();
        stop_ids(&parse(dir, &args)?).map_err(|e| e.to_string())
    }

    fn ids(dir: &std::path::Path, args: &[&str]) -> Result<Vec<i32>, String> {
        let tok = tokenizer(dir).map_err(|e| e.to_string())?;
        prompt_of(&parse(dir, args)?, tok.as_ref())
            .map(|p| p.ids)
            .map_err(|e| e.to_string())
    }

    /// A folder with a chat template whose turns are `<u>text</t>`, after `<b>`.
    fn chat_folder(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("cg-generate-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let template = "{{ bos_token }}{% for m in messages %}<{{ m.role[0] }}>{{ m.content }}</t>{% endfor %}\
                        {% if add_generation_prompt %}<a>{% endif %}";
        let config = serde_json::json!({ "chat_template": template, "bos_token": "<b>" });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        dir
    }

    #[test]
    fn chat_arguments_are_checked_before_any_device_work() {
        let dir = chat_folder("args");
        let e = ids(&dir, &["--system", "s", "--prompt-ids", "1"]).unwrap_err();
        assert!(e.contains("--chat"), "{e}");
        let e = ids(&dir, &["--chat", "hi", "--prompt-ids", "1"]).unwrap_err();
        assert!(e.contains("--prompt-ids"), "{e}");
        let e = ids(&dir, &[]).unwrap_err();
        assert!(e.contains("--chat"), "{e}");
        // The conversation the template makes: the system turn first, the assistant's opened.
        let args = parse(&dir, &["--chat", "hi", "--system", "be kind"]).unwrap();
        assert_eq!(
            chat_text(&args, "hi").unwrap(),
            "<b><s>be kind</t><u>hi</t><a>"
        );
        // --show-prompt: the rendering, then the ids.
        let chat = Prompt {
            ids: vec![0, 2, 6],
            rendered: Some(chat_text(&args, "hi").unwrap()),
        };
        assert_eq!(
            shown_prompt(&chat),
            "conversation as the chat template renders it:\n<b><s>be kind</t><u>hi</t><a>\n\
             prompt ids (3): 0,2,6"
        );
        let plain = parse(&dir, &["--prompt-ids", "4,5", "--show-prompt"]).unwrap();
        assert!(plain.show_prompt);
        assert_eq!(
            shown_prompt(&prompt_of(&plain, None).unwrap()),
            "prompt ids (2): 4,5"
        );
        // A base model (no template) is named as such.
        std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
        let e = ids(&dir, &["--chat", "hi"]).unwrap_err();
        assert!(
            e.contains("no chat template") && e.contains("--prompt"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(not(feature = "tokenizers"))]
    #[test]
    fn chat_without_the_tokenizers_feature_says_what_to_build() {
        let dir = chat_folder("nofeature");
        let e = ids(&dir, &["--chat", "hi"]).unwrap_err();
        assert!(e.contains("--features tokenizers"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The rendered conversation is tokenized with the template's special tokens recognised
    /// and none added.
    #[cfg(feature = "tokenizers")]
    #[test]
    fn chat_ids_are_the_rendered_conversation_tokenized() {
        let dir = chat_folder("tok");
        let special = |id: u32, text: &str| {
            serde_json::json!({"id": id, "content": text, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        };
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(0, "<b>"), special(1, "<u>"), special(2, "<s>"),
                             special(3, "</t>"), special(4, "<a>")],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel",
                      "vocab": {"<b>": 0, "<u>": 1, "<s>": 2, "</t>": 3, "<a>": 4, "hi": 5,
                                "be": 6, "kind": 7, "[UNK]": 8},
                      "unk_token": "[UNK]"},
        });
        let e = ids(&dir, &["--chat", "hi"]).unwrap_err();
        assert!(e.contains("tokenizer.json"), "{e}");
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        assert_eq!(ids(&dir, &["--chat", "hi"]).unwrap(), vec![0, 1, 5, 3, 4]);
        assert_eq!(
            ids(&dir, &["--chat", "hi", "--system", "be kind"]).unwrap(),
            vec![0, 2, 6, 7, 3, 1, 5, 3, 4]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn eos_ids_default_to_the_folders_and_flags_override_them() {
        let dir = std::env::temp_dir().join(format!("cg-generate-eos-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"model_type": "gpt2", "eos_token_id": 7}"#,
        )
        .unwrap();
        assert_eq!(stops(&dir, &[]).unwrap(), vec![7]);
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": [4, 5]}"#,
        )
        .unwrap();
        assert_eq!(stops(&dir, &[]).unwrap(), vec![4, 5]);
        assert_eq!(stops(&dir, &["--eos", "3,9"]).unwrap(), vec![3, 9]);
        assert_eq!(stops(&dir, &["--ignore-eos"]).unwrap(), Vec::<i32>::new());
        let e = stops(&dir, &["--ignore-eos", "--eos", "3"]).unwrap_err();
        assert!(e.contains("--ignore-eos") && e.contains("--eos"), "{e}");
        // A malformed id is an error naming the file, before any device work.
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": "x"}"#,
        )
        .unwrap();
        let e = stops(&dir, &[]).unwrap_err();
        assert!(
            e.contains("generation_config.json") && e.contains("eos_token_id"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sampling_follows_the_folders_generation_config_unless_told_otherwise() {
        let dir = std::env::temp_dir();
        let run = |args: &[&str], d: &GenerationDefaults| {
            let mut all = vec!["--prompt-ids", "1"];
            all.extend_from_slice(args);
            sampling_of(&parse(&dir, &all).unwrap(), d)
        };
        let greedy = SamplingParams::greedy();
        let file = GenerationDefaults {
            sampling: Some(SamplingParams {
                temperature: 0.6,
                top_k: 50,
                top_p: 0.9,
            }),
            unsupported: vec![("repetition_penalty".into(), "1.1".into())],
        };
        let none = GenerationDefaults::default();
        // No sampling in the folder: greedy, as before; the flags alone set it.
        assert_eq!(run(&[], &none), greedy);
        let t = run(&["--temperature", "0.8", "--top-k", "40"], &none);
        assert_eq!((t.temperature, t.top_k, t.top_p), (0.8, 40, 1.0));
        // A top-k alone without sampling stays greedy (temperature 0), as before.
        assert_eq!(run(&["--top-k", "40"], &none).temperature, 0.0);
        // The folder samples: its values, each flag replacing its own.
        let f = run(&[], &file);
        assert_eq!((f.temperature, f.top_k, f.top_p), (0.6, 50, 0.9));
        let f = run(&["--top-p", "0.5"], &file);
        assert_eq!((f.temperature, f.top_k, f.top_p), (0.6, 50, 0.5));
        let f = run(&["--temperature", "0"], &file);
        assert_eq!(f.temperature, 0.0);
        // --greedy wins over the folder, and excludes the sampling flags.
        assert_eq!(run(&["--greedy"], &file), greedy);
        for flag in ["--temperature", "--top-k", "--top-p"] {
            let e = parse(&dir, &["--prompt-ids", "1", "--greedy", flag, "1"]);
            assert!(e.is_err(), "{flag}");
        }
    }
}
