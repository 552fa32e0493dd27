//! Chat messages rendered into a prompt with the model's own chat template: the Jinja template
//! its GGUF file ships (`tokenizer.chat_template`), run by `minijinja` as llama.cpp and vLLM run
//! it (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, and
//! Python's string methods through `minijinja-contrib`'s pycompat). A model without a template
//! (the random models) gets [`CHATML`], as llama.cpp falls back to it.
//!
//! Rendering is bounded: a template runs on a fixed fuel of instructions, so a template that
//! loops on its input cannot hold a worker. A template that does not compile, or raises, or
//! runs out of fuel is an error for the request (400), never a crash.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// ChatML, the template used when the model ships none (SmolLM2's is ChatML with a default
/// system prompt).
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Instructions a render may run (`minijinja`'s fuel): far above what a chat template needs
/// for a conversation filling the context, far below what would hold a worker for long.
pub const FUEL: u64 = 50_000_000;

/// The roles a message may have. `developer` (OpenAI's newer name for system text) is given
/// to a template that never names it as `system`.
pub const ROLES: &[&str] = &["system", "developer", "user", "assistant"];

/// One message of a conversation, as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    /// One of [`ROLES`].
    pub role: String,
    /// The text.
    pub content: String,
    /// The participant's name, when the client gives one (absent from the template's view
    /// otherwise, as in vLLM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A compiled chat template with the special tokens it is given.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template names the `developer` role: its messages are given as they are.
    knows_developer: bool,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `bos_token` and `eos_token` are the texts the template may write.
    ///
    /// # Errors
    /// The template does not compile (the error says where).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_fuel(Some(FUEL));
        env.set_recursion_limit(64);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| format!("the chat template does not compile: {}", describe(&e)))?;
        Ok(ChatTemplate {
            env,
            knows_developer: source.contains("developer"),
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// Renders `messages`, with the assistant's turn opened when `add_generation_prompt`.
    ///
    /// # Errors
    /// The template raised, failed, or ran out of fuel (the error says which).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let t = self
            .env
            .get_template(NAME)
            .map_err(|e| format!("the chat template: {}", describe(&e)))?;
        let renamed: Vec<Message>;
        let messages = if !self.knows_developer && messages.iter().any(|m| m.role == "developer") {
            renamed = messages
                .iter()
                .map(|m| Message {
                    role: if m.role == "developer" {
                        "system".to_owned()
                    } else {
                        m.role.clone()
                    },
                    ..m.clone()
                })
                .collect();
            &renamed
        } else {
            messages
        };
        t.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| format!("the chat template failed to render: {}", describe(&e)))
    }
}

/// A template error with its cause and line, for a message.
fn describe(e: &Error) -> String {
    let mut s = match e.detail() {
        Some(d) => d.to_string(),
        None => e.kind().to_string(),
    };
    if e.kind() == ErrorKind::OutOfFuel {
        s = format!("it ran more than {FUEL} instructions");
    }
    if let Some(line) = e.line() {
        s.push_str(&format!(" (line {line})"));
    }
    s
}
