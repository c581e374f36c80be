//! Chat templates: a model folder's Jinja template that turns a conversation into the prompt
//! text the model was tuned on, rendered as Hugging Face's `apply_chat_template` renders it —
//! Jinja with trimmed blocks and stripped block indentation, Python's string methods
//! (`.strip()`, `.startswith()`, ...), `raise_exception(message)` and `strftime_now(format)`,
//! with `messages`, `add_generation_prompt`, `tools` (none) and the folder's special tokens
//! (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`,
//! `mask_token`, `additional_special_tokens`, those it sets) in scope.
//!
//! The template comes from `chat_template.jinja` where the folder has it, else from the
//! `chat_template` field of `tokenizer_config.json` (a string, or a list of named templates of
//! which `default` is used); the special tokens from `tokenizer_config.json` (each a string or
//! an object with `content`). Rendering works without a GPU and without the `tokenizers`
//! feature; the text is then tokenized without adding special tokens (the template writes
//! them), as `apply_chat_template` does.
//!
//! Templates are data from model repositories: rendering is sandboxed (no file or network
//! access) and bounded (a fuel limit on the work one rendering may do), and every failure —
//! a syntax error, `raise_exception`, running out of fuel — is an [`HfError::Chat`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::{context, Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::Value as Json;

use super::{read_file, IoError};
use crate::error::HfError;

type IoResult<T> = std::result::Result<T, IoError>;

/// The template's name in its environment.
const NAME: &str = "chat_template";
/// The most work one rendering may do (minijinja's fuel: about one unit an instruction). A
/// conversation of a few thousand turns takes a few hundred thousand.
const FUEL: u64 = 10_000_000;

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (templates decide what they accept).
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl ChatMessage {
    /// A turn of `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// The special tokens transformers puts in a chat template's scope (its
/// `SPECIAL_TOKENS_ATTRIBUTES` but the list `additional_special_tokens`).
pub const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A compiled chat template with the folder's special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    special: BTreeMap<String, String>,
    additional: Vec<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("special", &self.special)
            .field("additional", &self.additional)
            .finish_non_exhaustive()
    }
}

fn chat_err(problem: impl Into<String>) -> IoError {
    HfError::Chat(problem.into()).into()
}

/// A minijinja error with its cause chain and, where known, the template line.
fn jinja_err(e: JinjaError) -> IoError {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        let _ = write!(text, ": {c}");
        cause = c.source();
    }
    chat_err(text)
}

/// A special token of `tokenizer_config.json` (`name`, for errors): a string, or an object
/// with a string `content` (an added token).
fn token_text(name: &str, v: &Json) -> IoResult<String> {
    match v {
        Json::String(s) => Ok(s.clone()),
        Json::Object(o) => match o.get("content") {
            Some(Json::String(s)) => Ok(s.clone()),
            _ => Err(chat_err(format!(
                "tokenizer_config.json: `{name}` is an object without a string `content`"
            ))),
        },
        v => Err(chat_err(format!(
            "tokenizer_config.json: `{name}` is {v}, not a token's text"
        ))),
    }
}

/// The template of `tokenizer_config.json`'s `chat_template`: a string, or a list of
/// `{name, template}` of which `default` is taken.
fn config_template(config: &Json) -> IoResult<Option<String>> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            let default = list
                .iter()
                .filter(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .find_map(|t| t.get("template")?.as_str());
            match default {
                Some(t) => Ok(Some(t.to_string())),
                None => Err(chat_err(
                    "tokenizer_config.json: `chat_template` lists no template named `default`",
                )),
            }
        }
        Some(v) => Err(chat_err(format!(
            "tokenizer_config.json: `chat_template` is {}, not a template or a list of them",
            json_kind(v)
        ))),
    }
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

impl ChatTemplate {
    /// The chat template of the model folder `dir`: `chat_template.jinja` where present, else
    /// `tokenizer_config.json`'s `chat_template`; `Ok(None)` where the folder has neither (a
    /// base model). The special tokens come from `tokenizer_config.json` where it exists.
    pub fn read(dir: &Path) -> IoResult<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            serde_json::from_slice(&read_file(&config_path)?)
                .map_err(|e| chat_err(format!("tokenizer_config.json: {e}")))?
        } else {
            Json::Null
        };
        if !matches!(config, Json::Object(_) | Json::Null) {
            return Err(chat_err("tokenizer_config.json is not a JSON object"));
        }
        let file = dir.join("chat_template.jinja");
        let source = if file.exists() {
            let bytes = read_file(&file)?;
            Some(
                String::from_utf8(bytes)
                    .map_err(|_| chat_err("chat_template.jinja is not UTF-8 text"))?,
            )
        } else {
            config_template(&config)?
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let mut special = BTreeMap::new();
        for name in SPECIAL_TOKENS {
            if let Some(v) = config.get(name).filter(|v| !v.is_null()) {
                special.insert(name.to_string(), token_text(name, v)?);
            }
        }
        let name = "additional_special_tokens";
        let additional = match config.get(name) {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Array(list)) => list
                .iter()
                .map(|v| token_text(name, v))
                .collect::<IoResult<_>>()?,
            Some(v) => {
                return Err(chat_err(format!(
                    "tokenizer_config.json: `{name}` is {}, not a list of tokens",
                    json_kind(v)
                )))
            }
        };
        let mut t = Self::new(source, special)?;
        t.additional = additional;
        Ok(Some(t))
    }

    /// Compiles `source` with the special tokens `special` (by name: `bos_token`, ...; those
    /// absent are undefined in the template, which prints them as nothing). A syntax error
    /// is an [`HfError::Chat`] naming the line.
    pub fn new(source: String, special: BTreeMap<String, String>) -> IoResult<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(jinja_err)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(FUEL));
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, JinjaError> {
                Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("the template raised: {message}"),
                ))
            },
        );
        env.add_function(
            "strftime_now",
            |format: String| -> Result<String, JinjaError> {
                let mut out = String::new();
                write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
                    JinjaError::new(
                        ErrorKind::InvalidOperation,
                        format!("strftime_now: `{format}` is not a strftime format"),
                    )
                })?;
                Ok(out)
            },
        );
        env.add_template_owned(NAME, source).map_err(jinja_err)?;
        Ok(ChatTemplate {
            env,
            special,
            additional: Vec::new(),
        })
    }

    /// The text of special token `name` (`bos_token`, `eos_token`, ...), where it is set.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special.get(name).map(String::as_str)
    }

    /// The prompt text of `messages`; with `add_generation_prompt`, followed by the opening of
    /// the assistant's turn (what to generate from).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> IoResult<String> {
        let turns: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_pairs([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        let mut special: Vec<(&str, Value)> = self
            .special
            .iter()
            .map(|(k, v)| (k.as_str(), Value::from(v.as_str())))
            .collect();
        if !self.additional.is_empty() {
            let list: Vec<Value> = self
                .additional
                .iter()
                .map(|t| Value::from(t.as_str()))
                .collect();
            special.push(("additional_special_tokens", Value::from(list)));
        }
        let template = self.env.get_template(NAME).map_err(jinja_err)?;
        template
            .render(context! {
                messages => turns,
                add_generation_prompt => add_generation_prompt,
                tools => (),
                documents => (),
                ..Value::from_pairs(special)
            })
            .map_err(jinja_err)
    }
}
