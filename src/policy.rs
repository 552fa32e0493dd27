//! The model's say (docs/budgets.md#policies): per `(node, walk)` chunking policies and each node's submodule
//! capabilities. Fixed at load; the deployment's budgets are layered on top in [`crate::budget`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// A node or walk name, as the model names them. Cloning is a reference-count increment.
pub type Name = Arc<str>;

/// What the model declares for one `(node, walk)`: its token budget, or none ([`NO_CHUNKING`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkingPolicy {
    /// The most tokens one step may run; `None` means the walk is never chunked.
    pub max_batch_tokens: Option<u32>,
    /// Every non-final chunk ends on a multiple of `align` tokens (paged KV caches). At least 1.
    pub align: u32,
}

/// The policy of a walk the model does not chunk.
pub const NO_CHUNKING: ChunkingPolicy = ChunkingPolicy {
    max_batch_tokens: None,
    align: 1,
};

impl ChunkingPolicy {
    /// A policy with a budget and no alignment.
    ///
    /// ```
    /// use mstar_chunking::{ChunkingPolicy, NO_CHUNKING};
    ///
    /// // 4,096 tokens a step; non-final chunks end on a multiple of 16 (a paged KV cache).
    /// let p = ChunkingPolicy::budget(4096).aligned(16);
    /// assert_eq!((p.max_batch_tokens, p.align), (Some(4096), 16));
    /// assert_eq!(NO_CHUNKING.max_batch_tokens, None);
    /// ```
    pub fn budget(max_batch_tokens: u32) -> Self {
        Self {
            max_batch_tokens: Some(max_batch_tokens),
            align: 1,
        }
    }

    /// The same policy with chunks aligned to `align` tokens.
    pub fn aligned(self, align: u32) -> Self {
        Self { align, ..self }
    }
}

impl Default for ChunkingPolicy {
    fn default() -> Self {
        NO_CHUNKING
    }
}

/// What a node's submodule can do with chunks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubmoduleCaps {
    /// The walks whose rows this submodule can cut. A vision encoder, whose image cannot be cut,
    /// names none.
    pub chunkable_walks: BTreeSet<Name>,
    /// Whether a member walk's own budget can cap its rows inside a combined step on this node.
    pub can_override_mixed_max_tokens: bool,
}

impl SubmoduleCaps {
    /// Capabilities from walk names.
    pub fn new<I, S>(chunkable_walks: I, can_override_mixed_max_tokens: bool) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self {
            chunkable_walks: chunkable_walks
                .into_iter()
                .map(|w| Name::from(w.as_ref()))
                .collect(),
            can_override_mixed_max_tokens,
        }
    }
}

/// A policy the model declared that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// A policy on a node without a submodule.
    #[error("policy for `{node}`/`{walk}` names node `{node}`, which has no submodule")]
    UnknownNode {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
    },
    /// A budget of 0 tokens.
    #[error(
        "policy for `{node}`/`{walk}` has `max_batch_tokens` 0; a budget must be at least 1 token"
    )]
    ZeroBudget {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
    },
    /// An `align` of 0.
    #[error("policy for `{node}`/`{walk}` has `align` 0; align must be at least 1 token")]
    ZeroAlign {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
    },
    /// A budget below the `align`: no aligned chunk fits.
    #[error("policy for `{node}`/`{walk}` has `max_batch_tokens` {budget} below its `align` {align}: no aligned chunk fits")]
    BudgetBelowAlign {
        /// The node.
        node: Name,
        /// The walk.
        walk: Name,
        /// The policy's budget.
        budget: u32,
        /// The policy's `align`.
        align: u32,
    },
    /// `set_policies` with policies other than those already bound.
    #[error("the model's policies are fixed at load and differ from the ones already bound; restart to load a new model")]
    AlreadyBound,
    /// A call that needs the policies before `set_policies`.
    #[error("no model policies are bound yet: call `set_policies` first")]
    NotBound,
}

/// The model's policies and submodules, validated. Immutable once built; shared as an `Arc`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ModelPolicies {
    submodules: BTreeMap<Name, SubmoduleCaps>,
    policies: BTreeMap<(Name, Name), ChunkingPolicy>,
}

impl ModelPolicies {
    /// Validates the model's declarations.
    ///
    /// # Errors
    /// Every policy on a node without a submodule, with a zero budget or a zero align.
    pub fn new(
        submodules: BTreeMap<Name, SubmoduleCaps>,
        policies: BTreeMap<(Name, Name), ChunkingPolicy>,
    ) -> Result<Self, Vec<PolicyError>> {
        let mut errors = Vec::new();
        for ((node, walk), p) in &policies {
            let (node, walk) = (node.clone(), walk.clone());
            if !submodules.contains_key(&node) {
                errors.push(PolicyError::UnknownNode { node, walk });
            } else if p.max_batch_tokens == Some(0) {
                errors.push(PolicyError::ZeroBudget { node, walk });
            } else if p.align == 0 {
                errors.push(PolicyError::ZeroAlign { node, walk });
            } else if let Some(budget) = p.max_batch_tokens.filter(|b| *b < p.align) {
                errors.push(PolicyError::BudgetBelowAlign {
                    node,
                    walk,
                    budget,
                    align: p.align,
                });
            }
        }
        if errors.is_empty() {
            Ok(Self {
                submodules,
                policies,
            })
        } else {
            Err(errors)
        }
    }

    /// The declared policy, or [`NO_CHUNKING`] where none was declared.
    pub fn policy(&self, node: &str, walk: &str) -> ChunkingPolicy {
        self.policies
            .get(&(Name::from(node), Name::from(walk)))
            .copied()
            .unwrap_or(NO_CHUNKING)
    }

    /// Whether the model has a node of that name.
    pub fn has_node(&self, node: &str) -> bool {
        self.submodules.contains_key(node)
    }

    /// The node's submodule capabilities.
    pub fn submodule(&self, node: &str) -> Option<&SubmoduleCaps> {
        self.submodules.get(node)
    }

    /// The nodes, in name order.
    pub fn nodes(&self) -> impl Iterator<Item = &Name> {
        self.submodules.keys()
    }

    /// The walks the model budgets on `node` (a policy with a budget), in name order.
    pub fn budgeted_walks<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Name> + 'a {
        self.policies
            .iter()
            .filter(move |((n, _), p)| &**n == node && p.max_batch_tokens.is_some())
            .map(|((_, w), _)| w)
    }

    /// Every walk named by a policy or a submodule.
    pub fn walks(&self) -> BTreeSet<Name> {
        let mut walks: BTreeSet<Name> = self.policies.keys().map(|(_, w)| w.clone()).collect();
        for caps in self.submodules.values() {
            walks.extend(caps.chunkable_walks.iter().cloned());
        }
        walks
    }

    /// All declared policies.
    pub fn policies(&self) -> &BTreeMap<(Name, Name), ChunkingPolicy> {
        &self.policies
    }

    /// Wraps the policies for sharing.
    pub fn shared(self) -> Arc<Self> {
        Arc::new(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> Name {
        Name::from(s)
    }

    #[test]
    fn undeclared_walk_is_no_chunking() {
        let subs = BTreeMap::from([(n("llm"), SubmoduleCaps::new(["prefill"], false))]);
        let pols = BTreeMap::from([((n("llm"), n("prefill")), ChunkingPolicy::budget(512))]);
        let m = ModelPolicies::new(subs, pols).unwrap();
        assert_eq!(m.policy("llm", "prefill").max_batch_tokens, Some(512));
        assert_eq!(m.policy("llm", "decode"), NO_CHUNKING);
        assert_eq!(m.policy("vision", "prefill"), NO_CHUNKING);
    }

    #[test]
    fn bad_policies_are_all_reported() {
        let subs = BTreeMap::from([(n("llm"), SubmoduleCaps::default())]);
        let pols = BTreeMap::from([
            ((n("llm"), n("prefill")), ChunkingPolicy::budget(0)),
            ((n("llm"), n("mixed")), ChunkingPolicy::budget(8).aligned(0)),
            ((n("ghost"), n("prefill")), ChunkingPolicy::budget(8)),
        ]);
        let errs = ModelPolicies::new(subs, pols).unwrap_err();
        assert_eq!(errs.len(), 3);
        assert!(errs
            .iter()
            .any(|e| e.to_string().contains("`ghost`/`prefill`")));
    }
}
