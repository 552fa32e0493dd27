//! Model manifests (`config/models/*.toml`, `docs/config.md#the-model-manifest`): the model's
//! say, as a file.
//!
//! [`Manifest::from_toml`] parses and validates a manifest whole: every problem is reported at
//! once, each naming the manifest, so a bad model file never reaches `set_policies`. Reading a
//! manifest file (bounded, regular files only) and joining it with the serving config is the
//! config module's (`config::load_manifest`, `Manifest::budget_settings`); this module imports
//! nothing from it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use indexmap::IndexMap;
use serde::Deserialize;

use crate::policy::Name;
use crate::policy::{ChunkingPolicy, SubmoduleCaps};

/// A model manifest.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The model's name.
    pub name: String,
    /// The walks the model runs, which the deployment serves.
    pub walks: Vec<String>,
    /// `combined walk -> member walks`.
    #[serde(default)]
    pub combined_walks: BTreeMap<String, Vec<String>>,
    /// Nodes, in the manifest file's order (replay drives the first one by default).
    pub nodes: IndexMap<String, NodeManifest>,
}

/// One node of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeManifest {
    /// The walks whose rows the node's submodule can run in chunks.
    #[serde(default)]
    pub chunkable_walks: Vec<String>,
    /// Whether the submodule can cap member walks inside a combined step.
    #[serde(default)]
    pub can_override_mixed_max_tokens: bool,
    /// `walk -> policy`; a walk without an entry is `NO_CHUNKING` on this node.
    #[serde(default)]
    pub policies: BTreeMap<String, PolicyManifest>,
}

/// One declared policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyManifest {
    /// The model's budget for the walk; `None`: no budget (no chunking).
    pub max_batch_tokens: Option<u32>,
    /// Chunks are cut at multiples of this many tokens. Default 1.
    #[serde(default = "one")]
    pub align: u32,
}

fn one() -> u32 {
    1
}

impl Manifest {
    /// Parses and validates a manifest; `origin` names it in errors (a file path).
    ///
    /// # Errors
    /// Malformed TOML or unknown keys, or every problem [`Manifest::validate`] finds.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ManifestErrors> {
        let manifest: Manifest = toml::from_str(text).map_err(|e| {
            ManifestErrors::new(
                origin,
                vec![ManifestError::Parse {
                    reason: e.message().to_string(),
                    line: e.span().map(|s| line_of(text, s.start)),
                }],
            )
        })?;
        let errors = manifest.validate();
        if errors.is_empty() {
            Ok(manifest)
        } else {
            Err(ManifestErrors::new(origin, errors))
        }
    }

    /// Every problem with the manifest: names that are not lowercase (environment variables
    /// arrive lowercased, so `Thinker` could never be overridden), combined walks and policies
    /// on walks the model does not list, a walk in two combined walks, zero budgets and aligns.
    pub fn validate(&self) -> Vec<ManifestError> {
        let mut errors = Vec::new();
        if self.walks.is_empty() {
            errors.push(ManifestError::NoWalks);
        }
        if self.nodes.is_empty() {
            errors.push(ManifestError::NoNodes);
        }
        let mut seen = BTreeSet::new();
        for walk in &self.walks {
            check_name("walk", walk, &mut errors);
            if !seen.insert(walk.as_str()) {
                errors.push(ManifestError::DuplicateWalk { walk: walk.clone() });
            }
        }
        let listed = |w: &str| self.walks.iter().any(|x| x == w);
        // member walk -> the first combined walk that lists it
        let mut member_of: BTreeMap<&str, &str> = BTreeMap::new();
        for (combined, members) in &self.combined_walks {
            if !listed(combined) {
                errors.push(ManifestError::CombinedNotInWalks {
                    combined: combined.clone(),
                });
            }
            if members.is_empty() {
                errors.push(ManifestError::EmptyCombined {
                    combined: combined.clone(),
                });
            }
            for member in members {
                if !listed(member) {
                    errors.push(ManifestError::MemberNotInWalks {
                        combined: combined.clone(),
                        member: member.clone(),
                    });
                }
                if member == combined || self.combined_walks.contains_key(member) {
                    errors.push(ManifestError::NestedCombined {
                        combined: combined.clone(),
                        member: member.clone(),
                    });
                }
                match member_of.get(member.as_str()) {
                    Some(first) if *first != combined.as_str() => {
                        errors.push(ManifestError::WalkInTwoCombined {
                            walk: member.clone(),
                            first: (*first).to_string(),
                            second: combined.clone(),
                        })
                    }
                    Some(_) => errors.push(ManifestError::DuplicateMember {
                        combined: combined.clone(),
                        member: member.clone(),
                    }),
                    None => {
                        member_of.insert(member, combined);
                    }
                }
            }
        }
        for (node, m) in &self.nodes {
            check_name("node", node, &mut errors);
            for walk in m.chunkable_walks.iter().filter(|w| !listed(w)) {
                errors.push(ManifestError::ChunkableWalkUnknown {
                    node: node.clone(),
                    walk: walk.clone(),
                });
            }
            for (walk, p) in &m.policies {
                let at = || (node.clone(), walk.clone());
                if !listed(walk) {
                    let (node, walk) = at();
                    errors.push(ManifestError::PolicyUnknownWalk { node, walk });
                }
                if p.max_batch_tokens == Some(0) {
                    let (node, walk) = at();
                    errors.push(ManifestError::ZeroBudget { node, walk });
                }
                if p.align == 0 {
                    let (node, walk) = at();
                    errors.push(ManifestError::ZeroAlign { node, walk });
                }
            }
        }
        errors
    }

    /// The first node in the manifest file, which replay drives unless told otherwise.
    pub fn first_node(&self) -> Option<&str> {
        self.nodes.keys().next().map(String::as_str)
    }

    /// Each node's submodule capabilities.
    pub fn submodules(&self) -> BTreeMap<Name, SubmoduleCaps> {
        self.nodes
            .iter()
            .map(|(n, m)| {
                (
                    Name::from(n.as_str()),
                    SubmoduleCaps::new(&m.chunkable_walks, m.can_override_mixed_max_tokens),
                )
            })
            .collect()
    }

    /// The declared policies, `(node, walk) -> policy`.
    pub fn policies(&self) -> BTreeMap<(Name, Name), ChunkingPolicy> {
        self.nodes
            .iter()
            .flat_map(|(n, m)| {
                m.policies.iter().map(move |(w, p)| {
                    (
                        (Name::from(n.as_str()), Name::from(w.as_str())),
                        ChunkingPolicy {
                            max_batch_tokens: p.max_batch_tokens,
                            align: p.align,
                        },
                    )
                })
            })
            .collect()
    }

    /// The combined walk replay steps on: the first by name, if the model has any.
    pub fn combined_walk(&self) -> Option<&str> {
        self.combined_walks.keys().next().map(String::as_str)
    }
}

/// The 1-based line of byte offset `at` in `text`.
fn line_of(text: &str, at: usize) -> usize {
    text.get(..at).map_or(0, |t| t.matches('\n').count()) + 1
}

/// Node and walk names are lowercase letters, digits, `_` and `-`: environment variables
/// arrive lowercased, and a `.` would split a config key.
fn check_name(what: &'static str, name: &str, errors: &mut Vec<ManifestError>) {
    let ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
    if !ok {
        errors.push(ManifestError::BadName {
            what,
            name: name.to_string(),
        });
    }
}

/// One problem with a model manifest. The manifest it is in is named by [`ManifestErrors`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// The file cannot be read (or is not a regular file, or is too large).
    #[error("cannot be read: {reason}")]
    Read {
        /// Why.
        reason: String,
    },
    /// Not TOML, or not a manifest (an unknown key, a wrong type).
    #[error("malformed manifest{}: {reason}", line.map(|l| format!(" at line {l}")).unwrap_or_default())]
    Parse {
        /// What the parser said.
        reason: String,
        /// The 1-based line, when known.
        line: Option<usize>,
    },
    /// No walks.
    #[error("`walks` is empty; a model runs at least one walk")]
    NoWalks,
    /// No nodes.
    #[error("`nodes` is empty; a model has at least one node")]
    NoNodes,
    /// A node or walk name that is not lowercase letters, digits, `_` or `-`.
    #[error("{what} name {name:?} must be lowercase letters, digits, `_` or `-` (environment variables arrive lowercased)")]
    BadName {
        /// `node` or `walk`.
        what: &'static str,
        /// The name as written.
        name: String,
    },
    /// A walk listed twice.
    #[error("walk `{walk}` is listed twice in `walks`")]
    DuplicateWalk {
        /// The walk.
        walk: String,
    },
    /// A combined walk missing from `walks`.
    #[error("combined walk `{combined}` is not in `walks`")]
    CombinedNotInWalks {
        /// The combined walk.
        combined: String,
    },
    /// A member walk missing from `walks`.
    #[error("`combined_walks.{combined}` names walk `{member}`, which is not in `walks`")]
    MemberNotInWalks {
        /// The combined walk.
        combined: String,
        /// The member walk.
        member: String,
    },
    /// A combined walk without members.
    #[error("`combined_walks.{combined}` has no member walks")]
    EmptyCombined {
        /// The combined walk.
        combined: String,
    },
    /// A combined walk among the members of another.
    #[error("`combined_walks.{combined}` names `{member}`, which is itself a combined walk; combined walks do not nest")]
    NestedCombined {
        /// The combined walk.
        combined: String,
        /// The member that is itself combined.
        member: String,
    },
    /// A walk in two combined walks.
    #[error("walk `{walk}` is in two combined walks, `{first}` and `{second}`; a walk belongs to at most one")]
    WalkInTwoCombined {
        /// The walk.
        walk: String,
        /// The first combined walk listing it.
        first: String,
        /// The second.
        second: String,
    },
    /// A member listed twice.
    #[error("`combined_walks.{combined}` lists `{member}` twice")]
    DuplicateMember {
        /// The combined walk.
        combined: String,
        /// The member listed twice.
        member: String,
    },
    /// A chunkable walk missing from `walks`.
    #[error("`nodes.{node}.chunkable_walks` names walk `{walk}`, which is not in `walks`")]
    ChunkableWalkUnknown {
        /// The node.
        node: String,
        /// The walk.
        walk: String,
    },
    /// A policy on a walk missing from `walks`.
    #[error(
        "`nodes.{node}.policies.{walk}` is a policy on walk `{walk}`, which is not in `walks`"
    )]
    PolicyUnknownWalk {
        /// The node.
        node: String,
        /// The walk.
        walk: String,
    },
    /// A policy budget of 0.
    #[error("`nodes.{node}.policies.{walk}.max_batch_tokens` is 0; a budget is at least 1 token (leave the policy out for no chunking)")]
    ZeroBudget {
        /// The node.
        node: String,
        /// The walk.
        walk: String,
    },
    /// A policy align of 0.
    #[error("`nodes.{node}.policies.{walk}.align` is 0; align is at least 1 token")]
    ZeroAlign {
        /// The node.
        node: String,
        /// The walk.
        walk: String,
    },
}

/// Every problem with one manifest, which it names (its file path).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestErrors {
    /// The manifest: its file path, or the built-in demo.
    pub origin: String,
    /// Every problem, in the order found.
    pub errors: Vec<ManifestError>,
}

impl ManifestErrors {
    fn new(origin: &str, errors: Vec<ManifestError>) -> Self {
        Self {
            origin: origin.to_string(),
            errors,
        }
    }
}

impl fmt::Display for ManifestErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "model manifest {}: {e}", self.origin)?;
        }
        Ok(())
    }
}

impl std::error::Error for ManifestErrors {}

#[cfg(test)]
mod tests {
    use super::*;

    const OMNI: &str = r#"
name = "omni"
walks = ["prefill", "decode", "mixed"]
[combined_walks]
mixed = ["prefill", "decode"]
[nodes.vision]
policies = { prefill = { max_batch_tokens = 8192 } }
[nodes.thinker]
chunkable_walks = ["prefill", "mixed"]
can_override_mixed_max_tokens = true
policies = { prefill = { max_batch_tokens = 4096, align = 16 } }
[nodes.audio]
"#;

    fn problems(text: &str) -> Vec<String> {
        Manifest::from_toml(text, "m.toml")
            .unwrap_err()
            .to_string()
            .lines()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn nodes_keep_the_file_order() {
        let m = Manifest::from_toml(OMNI, "m.toml").unwrap();
        assert_eq!(m.first_node(), Some("vision"));
        assert_eq!(
            m.nodes.keys().map(String::as_str).collect::<Vec<_>>(),
            ["vision", "thinker", "audio"]
        );
        assert_eq!(m.combined_walk(), Some("mixed"));
        assert_eq!(m.policies().len(), 2);
        assert_eq!(
            m.policies()[&(Name::from("thinker"), Name::from("prefill"))].align,
            16
        );
    }

    #[test]
    fn every_problem_is_reported_naming_the_manifest() {
        let text = r#"
name = "bad"
walks = ["prefill", "decode", "mixed", "super", "Verify"]
[combined_walks]
mixed = ["prefill", "decode"]
super = ["decode", "ghost"]
[nodes.llm]
chunkable_walks = ["prefill", "spec"]
policies = { prefill = { max_batch_tokens = 0 }, mixed = { max_batch_tokens = 64, align = 0 }, verify = { max_batch_tokens = 8 } }
"#;
        let p = problems(text);
        for want in [
            "model manifest m.toml: walk name \"Verify\" must be lowercase",
            "walk `decode` is in two combined walks, `mixed` and `super`",
            "`combined_walks.super` names walk `ghost`, which is not in `walks`",
            "`nodes.llm.chunkable_walks` names walk `spec`",
            "`nodes.llm.policies.prefill.max_batch_tokens` is 0",
            "`nodes.llm.policies.mixed.align` is 0",
            "`nodes.llm.policies.verify` is a policy on walk `verify`, which is not in `walks`",
        ] {
            assert!(p.iter().any(|l| l.contains(want)), "{want} not in {p:#?}");
        }
        assert_eq!(p.len(), 7, "{p:#?}");
    }

    #[test]
    fn unknown_keys_and_malformed_toml_are_refused_with_a_line() {
        let p = problems("name = \"x\"\nwalks = [\"prefill\"]\n[nodes.llm]\nchunkable = []\n");
        assert!(p[0].contains("unknown field `chunkable`"), "{p:?}");
        assert!(p[0].contains("line 4"), "{p:?}");
        let p = problems("name = \"x\"\nwalks = [\"prefill\"\n");
        assert!(
            p[0].starts_with("model manifest m.toml: malformed manifest at line"),
            "{p:?}"
        );
    }

    #[test]
    fn combined_walks_do_not_nest() {
        let text = "name = \"x\"\nwalks = [\"a\", \"b\", \"c\"]\n[combined_walks]\nb = [\"a\"]\nc = [\"b\"]\n[nodes.n]\n";
        let p = problems(text);
        assert!(
            p.iter().any(
                |l| l.contains("`combined_walks.c` names `b`, which is itself a combined walk")
            ),
            "{p:?}"
        );
    }
}
