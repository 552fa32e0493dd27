//! Problems with a configuration, each with the layer that caused it attached, and how they are
//! shown: keys, paths and values escaped (no raw control characters reach a terminal or a log
//! line), long values cut, and a load's list capped with a count of the rest
//! (`docs/config.md#limits`).

use std::fmt;

/// Values and reasons longer than this many characters are cut (with `…`).
pub const MAX_SHOWN_CHARS: usize = 200;
/// A load lists at most this many problems, then counts the rest.
pub const MAX_PROBLEMS: usize = 64;

/// `s` with control characters escaped (`\n`, `\u{1b}`), cut to [`MAX_SHOWN_CHARS`].
pub fn escape(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == MAX_SHOWN_CHARS {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// `s` as a quoted, escaped string cut to [`MAX_SHOWN_CHARS`] (`"abc"`), for echoing a value.
pub fn quote(s: &str) -> String {
    let cut: String = s.chars().take(MAX_SHOWN_CHARS).collect();
    if cut.len() < s.len() {
        format!("{cut:?}…")
    } else {
        format!("{cut:?}")
    }
}

/// Each of `items` escaped ([`escape`]), joined with `sep`.
pub fn escape_join(items: &[String], sep: &str) -> String {
    items
        .iter()
        .map(|i| escape(i))
        .collect::<Vec<_>>()
        .join(sep)
}

/// One problem with the configuration, naming where it is and what was wrong. Its display is
/// escaped and cut: it is safe to print whatever the input was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigProblem {
    /// A config file that cannot be read or parsed.
    File {
        /// The file (or the layer's label).
        path: String,
        /// Why.
        reason: String,
    },
    /// A setting refused: its key, the layer that set it, its value and why.
    Setting {
        /// The dotted key (`chunking.max_batch_tokens.llm.mixed`).
        key: String,
        /// The layer that set it (a file, an environment variable, or the built-in default).
        layer: String,
        /// The value as written; `None` where it is not shown (unknown keys: it may be secret).
        value: Option<String>,
        /// Why.
        reason: String,
    },
    /// A problem with the model manifest.
    Manifest {
        /// The manifest file, or the built-in demo.
        path: String,
        /// Why.
        reason: String,
    },
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File { path, reason } => write!(f, "{}: {}", escape(path), escape(reason)),
            Self::Setting {
                key,
                layer,
                value,
                reason,
            } => {
                write!(f, "{}: `{}`", escape(layer), escape(key))?;
                if let Some(v) = value {
                    write!(f, " = {}", escape(v))?;
                }
                write!(f, ": {}", escape(reason))
            }
            Self::Manifest { path, reason } => {
                write!(f, "model manifest {}: {}", escape(path), escape(reason))
            }
        }
    }
}

impl std::error::Error for ConfigProblem {}

/// Every problem found in one load, in the order found, at most [`MAX_PROBLEMS`] of them and a
/// count of the rest. Displays one per line.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigErrors {
    /// The problems listed.
    pub problems: Vec<ConfigProblem>,
    /// How many more were found and not listed.
    pub more: usize,
}

impl ConfigErrors {
    /// Adds a problem, or counts it once [`MAX_PROBLEMS`] are listed.
    pub fn push(&mut self, p: ConfigProblem) {
        if self.problems.len() < MAX_PROBLEMS {
            self.problems.push(p);
        } else {
            self.more = self.more.saturating_add(1);
        }
    }

    /// Adds each problem as [`ConfigErrors::push`] does.
    pub fn extend(&mut self, ps: impl IntoIterator<Item = ConfigProblem>) {
        for p in ps {
            self.push(p);
        }
    }

    /// Whether no problem was found.
    pub fn is_empty(&self) -> bool {
        self.problems.is_empty() && self.more == 0
    }

    /// Whether the list is full, so further problems are only counted.
    pub fn is_full(&self) -> bool {
        self.problems.len() >= MAX_PROBLEMS
    }

    /// How many problems were found, listed or not.
    pub fn total(&self) -> usize {
        self.problems.len().saturating_add(self.more)
    }

    /// Every line of the display, each problem and then the count of the rest.
    pub fn lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = self.problems.iter().map(ToString::to_string).collect();
        if self.more > 0 {
            lines.push(format!("… and {} more problems not listed", self.more));
        }
        lines
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.lines().join("\n"))
    }
}

impl std::error::Error for ConfigErrors {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_long_text_is_cut() {
        assert_eq!(escape("a\nb\u{1b}[31m"), "a\\nb\\u{1b}[31m");
        let long = "x".repeat(10_000);
        assert_eq!(escape(&long).chars().count(), MAX_SHOWN_CHARS + 1);
        assert_eq!(quote("a\"\n"), "\"a\\\"\\n\"");
        assert!(quote(&long).ends_with("\"…"));
        let p = ConfigProblem::Setting {
            key: "chunking.x\ny".into(),
            layer: "f.toml".into(),
            value: None,
            reason: "unknown".into(),
        };
        assert_eq!(p.to_string(), "f.toml: `chunking.x\\ny`: unknown");
    }

    #[test]
    fn a_list_is_capped_and_counts_the_rest() {
        let mut e = ConfigErrors::default();
        assert!(e.is_empty());
        for i in 0..MAX_PROBLEMS + 5 {
            e.push(ConfigProblem::File {
                path: format!("f{i}"),
                reason: "bad".into(),
            });
        }
        assert_eq!(e.problems.len(), MAX_PROBLEMS);
        assert_eq!((e.more, e.total()), (5, MAX_PROBLEMS + 5));
        assert!(e.is_full());
        let lines = e.lines();
        assert_eq!(lines.len(), MAX_PROBLEMS + 1);
        assert_eq!(lines[MAX_PROBLEMS], "… and 5 more problems not listed");
    }
}
