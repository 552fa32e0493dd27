//! Model manifests (`config/models/*.toml`, SPEC §7): the model's say, as a file.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::budget::{BudgetSettings, NodeBudget};
use crate::policy::{ChunkingPolicy, SubmoduleCaps};
use crate::settings::{ChunkingSection, NodeBudgetSetting};
use crate::Name;

/// A model manifest.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub name: String,
    /// The walks the model runs, which the deployment serves.
    pub walks: Vec<String>,
    /// `combined walk -> member walks`.
    #[serde(default)]
    pub combined_walks: BTreeMap<String, Vec<String>>,
    /// Nodes, in the manifest's order of names.
    pub nodes: BTreeMap<String, NodeManifest>,
}

/// One node of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeManifest {
    #[serde(default)]
    pub chunkable_walks: Vec<String>,
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
    pub max_batch_tokens: Option<u32>,
    #[serde(default = "one")]
    pub align: u32,
}

fn one() -> u32 {
    1
}

impl Manifest {
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

    /// The arguments of `set_budgets` for this model under the `[chunking]` section: walks and
    /// combined walks from the manifest, `override_mixed` from the nodes that can cap member
    /// walks, budgets and lists from the config. Validation happens in `set_budgets`.
    pub fn budget_settings(&self, chunking: &ChunkingSection) -> BudgetSettings {
        let name = |s: &String| Name::from(s.as_str());
        BudgetSettings {
            overrides: chunking
                .max_batch_tokens
                .iter()
                .map(|(node, b)| {
                    let b = match b {
                        NodeBudgetSetting::All(v) => NodeBudget::All(v.0),
                        NodeBudgetSetting::PerWalk(m) => {
                            NodeBudget::PerWalk(m.iter().map(|(w, v)| (name(w), v.0)).collect())
                        }
                    };
                    (name(node), b)
                })
                .collect(),
            walks: self.walks.iter().map(name).collect(),
            combined_walk_of: self
                .combined_walks
                .iter()
                .flat_map(|(c, members)| members.iter().map(move |m| (name(m), name(c))))
                .collect(),
            override_mixed: self
                .nodes
                .iter()
                .filter(|(_, m)| m.can_override_mixed_max_tokens)
                .map(|(n, _)| name(n))
                .collect(),
            no_chunking: chunking.no_chunking.iter().map(name).collect(),
            min_chunk_tokens: chunking.min_chunk_tokens,
            max_row_tokens: chunking.max_row_tokens,
            max_partial_prefills: chunking.max_partial_prefills,
        }
    }
}
