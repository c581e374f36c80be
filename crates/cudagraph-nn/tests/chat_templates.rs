//! Chat templates (`io::chat`): templates written for these tests in the forms model folders
//! use (turn markers around each message, special tokens, Python string methods, a
//! `raise_exception` on a bad conversation, `strftime_now`), rendered to exact text; folders
//! read with `chat_template.jinja`, a string or a named list in `tokenizer_config.json`, or no
//! template; every failure a typed error, and runaway templates stopped by the fuel limit.

use std::collections::BTreeMap;
use std::path::PathBuf;

use cudagraph_nn::io::chat::{ChatMessage, ChatTemplate};
use cudagraph_nn::io::{HfError, IoError};
use serde_json::json;

#[path = "common/temp.rs"]
mod temp;
use temp::temp_dir;

/// Turn markers in the style of Llama 3's template: the special token first, each message's
/// role in a header, its text stripped, then an end-of-turn marker (`-}}` removes the line
/// break after the token; a block tag's own line break goes by itself).
const TURNS: &str = "{{ bos_token -}}
{% for message in messages %}
    {% if loop.first and message['role'] == 'system' %}
<|system|>{{ message['content'].strip() }}<|end|>
    {% else %}
<|{{ message['role'] }}|>{{ message['content'] | trim }}<|end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}";

/// Alternating user / assistant turns, or an error, in the style of Mistral's template.
const ALTERNATING: &str = "{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}
{% endfor %}";

/// Special tokens by name.
fn tokens(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn chat(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

fn chat_err(r: Result<impl std::fmt::Debug, IoError>) -> String {
    match r {
        Err(IoError::Hf(HfError::Chat(problem))) => problem,
        other => panic!("expected a chat template error, got {other:?}"),
    }
}

#[test]
fn templates_render_turns_special_tokens_and_the_generation_prompt() {
    let special = tokens(&[("bos_token", "<s>"), ("eos_token", "</s>")]);
    let t = ChatTemplate::new(TURNS.into(), special).unwrap();
    let pair = (t.special_token("bos_token"), t.special_token("eos_token"));
    assert_eq!(pair, (Some("<s>"), Some("</s>")));
    let conversation = [
        chat("system", "  Be brief.\n"),
        chat("user", "Hi there "),
        chat("assistant", "Hello."),
        chat("user", "Why is the sky blue?"),
    ];
    // Block tags on their own lines leave no line breaks or indentation behind (trim_blocks,
    // lstrip_blocks); text lines keep theirs.
    assert_eq!(
        t.render(&conversation, true).unwrap(),
        "<s><|system|>Be brief.<|end|>\n<|user|>Hi there<|end|>\n<|assistant|>Hello.<|end|>\n\
         <|user|>Why is the sky blue?<|end|>\n<|assistant|>\n"
    );
    assert_eq!(
        t.render(&conversation[1..2], false).unwrap(),
        "<s><|user|>Hi there<|end|>\n"
    );
    // No bos token: the variable is undefined, which prints as nothing (not "None").
    let plain = ChatTemplate::new(TURNS.into(), tokens(&[])).unwrap();
    assert_eq!(
        plain.render(&[chat("user", "x")], false).unwrap(),
        "<|user|>x<|end|>\n"
    );
}

#[test]
fn raise_exception_tools_and_strftime_now_behave_as_in_transformers() {
    let t = ChatTemplate::new(ALTERNATING.into(), tokens(&[("eos_token", "</s>")])).unwrap();
    let ok = [chat("user", "a"), chat("assistant", "b"), chat("user", "c")];
    assert_eq!(
        t.render(&ok, true).unwrap(),
        "[INST] a [/INST]b</s>[INST] c [/INST]"
    );
    let e = chat_err(t.render(&[chat("assistant", "b")], true));
    assert!(e.contains("roles must alternate"), "{e}");
    // `tools` is none (transformers passes None), so `is not none` is false; undefined
    // variables stay undefined.
    let t = ChatTemplate::new(
        "{% if tools is not none %}tools{% endif %}{% if custom is defined %}custom{% endif %}|"
            .into(),
        tokens(&[]),
    )
    .unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "|");
    // strftime_now: the local date in a strftime format; a bad format is a typed error.
    let t = ChatTemplate::new("{{ strftime_now('%Y') }}".into(), tokens(&[])).unwrap();
    let year: i32 = t.render(&[], false).unwrap().parse().unwrap();
    assert!((2024..3000).contains(&year), "{year}");
    let t = ChatTemplate::new("{{ strftime_now('%Q') }}".into(), tokens(&[])).unwrap();
    let e = chat_err(t.render(&[], false));
    assert!(e.contains("strftime"), "{e}");
}

#[test]
fn bad_templates_are_typed_errors_and_runaway_ones_run_out_of_fuel() {
    let e = chat_err(ChatTemplate::new(
        "{% for m in messages %}{{ m }}".into(),
        tokens(&[]),
    ));
    assert!(
        e.contains("syntax error") && e.contains("chat_template:1"),
        "{e}"
    );
    let t = ChatTemplate::new("{{ messages[0].missing_method() }}".into(), tokens(&[])).unwrap();
    chat_err(t.render(&[chat("user", "x")], false));
    // About 10^10 loop iterations: stopped by the fuel limit, not left to run.
    let t = ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}".into(),
        tokens(&[]),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let e = chat_err(t.render(&[], false));
    assert!(e.to_lowercase().contains("fuel"), "{e}");
    assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
}

#[test]
fn folders_give_their_template_from_either_file_or_none() {
    let write =
        |dir: &PathBuf, name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
    // No template (a base model): None, with or without a tokenizer_config.json.
    let dir = temp_dir("chat-none");
    assert!(ChatTemplate::read(&dir).unwrap().is_none());
    write(
        &dir,
        "tokenizer_config.json",
        &json!({"bos_token": "<s>"}).to_string(),
    );
    assert!(ChatTemplate::read(&dir).unwrap().is_none());
    // A string in tokenizer_config.json; special tokens as strings or added-token objects.
    let config = json!({
        "chat_template": TURNS,
        "bos_token": {"content": "<|begin|>", "lstrip": false},
        "eos_token": "<|eot|>",
    });
    write(&dir, "tokenizer_config.json", &config.to_string());
    let t = ChatTemplate::read(&dir).unwrap().expect("a template");
    assert_eq!(
        (t.special_token("bos_token"), t.special_token("eos_token")),
        (Some("<|begin|>"), Some("<|eot|>"))
    );
    assert_eq!(
        t.render(&[chat("user", "q")], true).unwrap(),
        "<|begin|><|user|>q<|end|>\n<|assistant|>\n"
    );
    // Every special token transformers passes, and only those set; other `*_token` fields
    // (`add_bos_token`) are not tokens.
    let every = json!({
        "chat_template": "{{ pad_token }}|{{ additional_special_tokens | join(',') }}|\
                          {{ cls_token is defined }}|{{ add_bos_token is defined }}",
        "pad_token": {"content": "<pad>"}, "cls_token": null, "add_bos_token": true,
        "additional_special_tokens": ["<x>", {"content": "<y>", "special": true}],
    });
    write(&dir, "tokenizer_config.json", &every.to_string());
    let t = ChatTemplate::read(&dir).unwrap().expect("a template");
    assert_eq!(t.special_token("pad_token"), Some("<pad>"));
    assert_eq!(t.render(&[], false).unwrap(), "<pad>|<x>,<y>|False|False");
    write(&dir, "tokenizer_config.json", &config.to_string());
    // chat_template.jinja takes precedence over the config's template.
    write(
        &dir,
        "chat_template.jinja",
        "{{ eos_token }}{{ messages | length }}",
    );
    let t = ChatTemplate::read(&dir).unwrap().expect("a template");
    assert_eq!(t.render(&[chat("user", "q")], true).unwrap(), "<|eot|>1");
    std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
    // A list of named templates: `default` is used; a list without it is an error.
    let named = |names: &[&str]| {
        let list: Vec<_> = names
            .iter()
            .map(|n| json!({"name": n, "template": format!("{n}:{{{{ messages | length }}}}")}))
            .collect();
        json!({ "chat_template": list }).to_string()
    };
    write(
        &dir,
        "tokenizer_config.json",
        &named(&["tool_use", "default"]),
    );
    let t = ChatTemplate::read(&dir).unwrap().expect("a template");
    assert_eq!(t.render(&[chat("user", "q")], false).unwrap(), "default:1");
    write(&dir, "tokenizer_config.json", &named(&["tool_use"]));
    let e = chat_err(ChatTemplate::read(&dir));
    assert!(e.contains("`default`"), "{e}");
    // Malformed files and fields name what is wrong.
    for (config, says) in [
        ("{not json".to_string(), "tokenizer_config.json"),
        ("[1, 2]".to_string(), "not a JSON object"),
        (json!({"chat_template": 3}).to_string(), "a number"),
        (
            json!({"chat_template": "x", "bos_token": 5}).to_string(),
            "`bos_token`",
        ),
        (
            json!({"chat_template": "x", "eos_token": {"lstrip": true}}).to_string(),
            "`eos_token`",
        ),
        (
            json!({"chat_template": "x", "additional_special_tokens": "<x>"}).to_string(),
            "not a list of tokens",
        ),
    ] {
        write(&dir, "tokenizer_config.json", &config);
        let e = chat_err(ChatTemplate::read(&dir));
        assert!(e.contains(says), "{config}: {e}");
    }
    std::fs::write(dir.join("chat_template.jinja"), [0xffu8, 0xfe]).unwrap();
    write(&dir, "tokenizer_config.json", "{}");
    let e = chat_err(ChatTemplate::read(&dir));
    assert!(e.contains("UTF-8"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A ChatML template with `namespace` state and `loop.last`, and one using Python's string
/// methods (`upper`, `split`, `startswith`, `replace`): the expected texts are what Jinja2 3.1
/// renders with transformers' settings (`trim_blocks`, `lstrip_blocks`), byte for byte.
const CHATML: &str = r#"{%- set ns = namespace(found_system=false, n=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% set ns.found_system = true %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
{%- endfor %}
{%- if not ns.found_system %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.last and message.role == 'assistant' %}
{{- '<|im_start|>' + message.role + '\n' + message.content.strip() }}
    {%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
{#- turns: {{ ns.n }} #}
"#;
const METHODS: &str = r#"{% for message in messages %}
    {% if message.role == 'user' %}
User: {{ message.content | trim }}
    {% elif message.role == 'system' %}
System: {{ message.content.upper() }} ({{ message.content.split() | length }} words, {{ message.content.startswith('  ') }})
    {% else %}
Assistant: {{ message.content.replace('.', '!') }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}Assistant:{% endif %}
"#;

#[test]
fn namespaces_loop_state_and_python_string_methods_render_as_jinja2_does() {
    let conversation = [
        chat("system", "  Be brief. "),
        chat("user", "Hi there\n"),
        chat("assistant", " Hello. "),
        chat("user", "Why is the sky blue?"),
    ];
    let t = ChatTemplate::new(CHATML.into(), tokens(&[])).unwrap();
    assert_eq!(
        t.render(&conversation, true).unwrap(),
        "<|im_start|>system\n  Be brief. <|im_end|>\n<|im_start|>user\nHi there\n<|im_end|>\n\
         <|im_start|>assistant\n Hello. <|im_end|>\n<|im_start|>user\nWhy is the sky blue?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // No system turn: the template adds one; a last assistant turn stays open (prefill).
    assert_eq!(
        t.render(&[chat("user", "q"), chat("assistant", "partial answer. ")], false)
            .unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n\
         <|im_start|>assistant\npartial answer."
    );
    let t = ChatTemplate::new(METHODS.into(), tokens(&[])).unwrap();
    assert_eq!(
        t.render(&conversation, true).unwrap(),
        "System:   BE BRIEF.  (2 words, True)\nUser: Hi there\nAssistant:  Hello! \n\
         User: Why is the sky blue?\nAssistant:"
    );
}
