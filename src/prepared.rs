//! Prepared inputs: each mid-prefill row's whole input, keyed by `(rid, node)`, measured once;
//! every chunk is a zero-copy view cut from it.

use std::ops::Range;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::error::ChunkingError;
use crate::policy::Name;

/// Per-token extras of a node's input (positions, multimodal features…): `width` values per token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenExtras {
    /// Values per token.
    pub width: usize,
    /// `width` values per token, token after token.
    pub values: Arc<[f32]>,
}

/// A row's whole input at a node.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedInput {
    /// The token ids.
    pub token_ids: Arc<[u32]>,
    /// Per-token extras, if the node has them.
    pub extras: Option<TokenExtras>,
}

impl PreparedInput {
    /// An input of token ids only.
    pub fn tokens(token_ids: impl Into<Arc<[u32]>>) -> Self {
        Self {
            token_ids: token_ids.into(),
            extras: None,
        }
    }

    /// The number of tokens (the `total` every chunk is measured against).
    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    /// Whether the input has no tokens.
    pub fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
    }

    /// Measures the input for `(rid, node)`.
    ///
    /// # Errors
    /// Empty, longer than `u32::MAX` tokens, or extras that do not cover exactly every token.
    pub fn measure(&self, rid: u64, node: &Name) -> Result<u32, ChunkingError> {
        let tokens = self.len();
        if tokens == 0 {
            return Err(ChunkingError::EmptyInput {
                rid,
                node: node.clone(),
            });
        }
        let total = u32::try_from(tokens).map_err(|_| ChunkingError::InputTooLong {
            rid,
            node: node.clone(),
            tokens,
            max: u32::MAX,
        })?;
        if let Some(x) = &self.extras {
            let covered = x.values.len().checked_div(x.width).unwrap_or(0);
            if x.width == 0 || x.values.len() % x.width != 0 || covered != tokens {
                return Err(ChunkingError::ExtrasMismatch {
                    rid,
                    node: node.clone(),
                    tokens,
                    extras: covered,
                });
            }
        }
        Ok(total)
    }

    /// A view of tokens `range` (no copy).
    ///
    /// ```
    /// use mstar_chunking::PreparedInput;
    ///
    /// let whole = PreparedInput::tokens(vec![10, 11, 12, 13, 14]);
    /// let chunk = whole.cut(1..4);
    /// assert_eq!(chunk.token_ids(), &[11, 12, 13]);
    /// ```
    pub fn cut(&self, range: Range<usize>) -> ChunkInput {
        ChunkInput {
            input: self.clone(),
            range,
        }
    }
}

/// The input of one chunk: a view into the whole prepared input. Cloning it clones two `Arc`s.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkInput {
    input: PreparedInput,
    range: Range<usize>,
}

impl ChunkInput {
    /// The chunk's token ids.
    pub fn token_ids(&self) -> &[u32] {
        &self.input.token_ids[self.range.clone()]
    }

    /// The chunk's per-token extras, `width` values per token.
    pub fn extras(&self) -> Option<&[f32]> {
        let x = self.input.extras.as_ref()?;
        Some(&x.values[self.range.start * x.width..self.range.end * x.width])
    }

    /// The token range of the whole input this chunk covers.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Whether the view shares the whole input's allocation with `whole` (it never copies).
    pub fn shares(&self, whole: &PreparedInput) -> bool {
        Arc::ptr_eq(&self.input.token_ids, &whole.token_ids)
    }
}

/// The whole prepared inputs held, `node -> rid -> input`, with running totals for the gauges.
#[derive(Debug, Default)]
pub struct PreparedStore {
    by_node: FxHashMap<Name, NodeInputs>,
    rows: usize,
    tokens: u64,
}

/// The inputs held on one node, and their token total.
#[derive(Debug, Default)]
pub struct NodeInputs {
    inputs: FxHashMap<u64, PreparedInput>,
    tokens: u64,
}

impl NodeInputs {
    /// The input of `rid`.
    pub fn get(&self, rid: u64) -> Option<&PreparedInput> {
        self.inputs.get(&rid)
    }

    /// Rows and tokens held.
    pub fn totals(&self) -> (usize, u64) {
        (self.inputs.len(), self.tokens)
    }
}

impl PreparedStore {
    /// Holds `input` for `(rid, node)`; returns its measured length.
    ///
    /// # Errors
    /// A bad input (see [`PreparedInput::measure`]) or one already held for `(rid, node)`.
    pub fn insert(
        &mut self,
        rid: u64,
        node: &Name,
        input: PreparedInput,
    ) -> Result<u32, ChunkingError> {
        let total = input.measure(rid, node)?;
        let per_node = self.by_node.entry(node.clone()).or_default();
        if per_node.inputs.contains_key(&rid) {
            return Err(ChunkingError::AlreadyQueued {
                rid,
                node: node.clone(),
            });
        }
        per_node.inputs.insert(rid, input);
        per_node.tokens += u64::from(total);
        self.rows += 1;
        self.tokens += u64::from(total);
        Ok(total)
    }

    /// The whole input of `(rid, node)`.
    pub fn get(&self, rid: u64, node: &str) -> Option<&PreparedInput> {
        self.by_node.get(node)?.get(rid)
    }

    /// Drops the input of `(rid, node)`; returns whether one was held. Unknown rows are a no-op.
    pub fn release(&mut self, rid: u64, node: &str) -> bool {
        let Some(per_node) = self.by_node.get_mut(node) else {
            return false;
        };
        let Some(input) = per_node.inputs.remove(&rid) else {
            return false;
        };
        per_node.tokens -= input.len() as u64;
        self.rows -= 1;
        self.tokens -= input.len() as u64;
        true
    }

    /// Drops every node's input of `rid`; returns the nodes that held one.
    pub fn forget(&mut self, rid: u64) -> Vec<Name> {
        let nodes: Vec<Name> = self
            .by_node
            .iter()
            .filter(|(_, m)| m.inputs.contains_key(&rid))
            .map(|(n, _)| n.clone())
            .collect();
        for n in &nodes {
            self.release(rid, n);
        }
        nodes
    }

    /// Drops every input on every node; answers the rows and tokens dropped.
    pub(crate) fn clear(&mut self) -> (usize, u64) {
        let dropped = (self.rows, self.tokens);
        for inputs in self.by_node.values_mut() {
            *inputs = NodeInputs::default();
        }
        self.rows = 0;
        self.tokens = 0;
        dropped
    }

    /// The inputs held on `node`, to cut a step's chunks from with one lookup of the node.
    pub fn node(&self, node: &str) -> Option<&NodeInputs> {
        self.by_node.get(node)
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tokens held, over all rows.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Rows and tokens held on `node`.
    pub fn node_totals(&self, node: &str) -> (usize, u64) {
        self.by_node.get(node).map_or((0, 0), NodeInputs::totals)
    }
}

/// One change to the inputs SchedulerState holds, as PreparedInputs' accounting reads it: the
/// changes a Scheduler message made, in order, sent as one `Apply`
/// (`docs/actors.md#prepared-inputs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum InputChange {
    /// A prompt's whole input of `tokens` tokens is held (admitted, its row queued).
    Hold { rid: u64, node: Name, tokens: u32 },
    /// The input of `(rid, node)` is dropped: its final chunk completed, or its row was dropped.
    Release { rid: u64, node: Name },
    /// Every node's input of a request is dropped (it ended).
    Forget(u64),
}

/// What the held inputs weigh, `node -> rid -> tokens`, with running totals: PreparedInputs'
/// accounting (its gauges, `prepared_totals`), kept apart from the inputs themselves, which
/// only [`PreparedStore`] (in SchedulerState) holds.
#[derive(Debug, Default)]
pub(crate) struct PreparedAccounts {
    by_node: FxHashMap<Name, (FxHashMap<u64, u32>, u64)>,
    rows: usize,
    tokens: u64,
}

impl PreparedAccounts {
    /// Counts `tokens` for `(rid, node)`; `false` (and nothing counted) when it is counted
    /// already.
    pub(crate) fn hold(&mut self, rid: u64, node: &Name, tokens: u32) -> bool {
        let (rows, node_tokens) = self.by_node.entry(node.clone()).or_default();
        if rows.contains_key(&rid) {
            return false;
        }
        rows.insert(rid, tokens);
        *node_tokens += u64::from(tokens);
        self.rows += 1;
        self.tokens += u64::from(tokens);
        true
    }

    /// Stops counting `(rid, node)`; returns whether it was counted.
    pub(crate) fn release(&mut self, rid: u64, node: &str) -> bool {
        let Some((rows, node_tokens)) = self.by_node.get_mut(node) else {
            return false;
        };
        let Some(tokens) = rows.remove(&rid) else {
            return false;
        };
        *node_tokens -= u64::from(tokens);
        self.rows -= 1;
        self.tokens -= u64::from(tokens);
        true
    }

    /// Stops counting every node's row of `rid`; returns the nodes that counted one.
    pub(crate) fn forget(&mut self, rid: u64) -> Vec<Name> {
        let nodes: Vec<Name> = self
            .by_node
            .iter()
            .filter(|(_, (rows, _))| rows.contains_key(&rid))
            .map(|(n, _)| n.clone())
            .collect();
        for n in &nodes {
            self.release(rid, n);
        }
        nodes
    }

    /// Stops counting everything.
    pub(crate) fn clear(&mut self) {
        for entry in self.by_node.values_mut() {
            *entry = Default::default();
        }
        self.rows = 0;
        self.tokens = 0;
    }

    /// The tokens counted for `(rid, node)`.
    #[cfg(test)]
    pub(crate) fn tokens_of(&self, rid: u64, node: &str) -> Option<u32> {
        self.by_node.get(node)?.0.get(&rid).copied()
    }

    /// Rows and tokens over all nodes.
    pub(crate) fn totals(&self) -> (usize, u64) {
        (self.rows, self.tokens)
    }

    /// Rows and tokens on `node`.
    pub(crate) fn node_totals(&self, node: &str) -> (usize, u64) {
        self.by_node
            .get(node)
            .map_or((0, 0), |(rows, tokens)| (rows.len(), *tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::PreparedAccounts;

    #[test]
    fn accounts_count_rows_and_tokens_per_node_and_refuse_a_second_hold() {
        let mut a = PreparedAccounts::default();
        let (x, y) = (Name::from("thinker"), Name::from("talker"));
        assert!(a.hold(1, &x, 4));
        assert!(a.hold(2, &x, 3));
        assert!(a.hold(1, &y, 5));
        assert!(!a.hold(1, &x, 9), "counted already");
        assert_eq!(a.tokens_of(1, "thinker"), Some(4));
        assert_eq!((a.totals(), a.node_totals("thinker")), ((3, 12), (2, 7)));
        assert_eq!(a.node_totals("ghost"), (0, 0));
        assert!(a.release(2, "thinker"));
        assert!(!a.release(2, "thinker") && !a.release(2, "ghost"));
        assert_eq!((a.totals(), a.node_totals("thinker")), ((2, 9), (1, 4)));
        let mut nodes = a.forget(1);
        nodes.sort();
        assert_eq!(nodes, [y.clone(), x.clone()]);
        assert_eq!(a.totals(), (0, 0));
        assert!(a.forget(1).is_empty());
        assert!(a.hold(3, &y, 2));
        a.clear();
        assert_eq!((a.totals(), a.node_totals("talker")), ((0, 0), (0, 0)));
        assert_eq!(a.tokens_of(3, "talker"), None);
        assert!(a.hold(3, &y, 2), "held again after a clear");
    }

    use super::*;

    #[test]
    fn chunks_are_views_of_the_whole_input() {
        let mut s = PreparedStore::default();
        let node = Name::from("llm");
        let whole = PreparedInput {
            token_ids: (0..10).collect::<Vec<u32>>().into(),
            extras: Some(TokenExtras {
                width: 2,
                values: (0..20).map(|v| v as f32).collect::<Vec<_>>().into(),
            }),
        };
        assert_eq!(s.insert(7, &node, whole.clone()).unwrap(), 10);
        let chunk = s.get(7, "llm").unwrap().cut(4..7);
        assert_eq!(chunk.token_ids(), &[4, 5, 6]);
        assert_eq!(chunk.extras().unwrap(), &[8.0, 9.0, 10.0, 11.0, 12.0, 13.0]);
        assert!(chunk.shares(s.get(7, "llm").unwrap()));
        assert_eq!((s.rows(), s.tokens()), (1, 10));
    }

    #[test]
    fn clear_drops_every_input_on_every_node() {
        let mut s = PreparedStore::default();
        let (a, b) = (Name::from("thinker"), Name::from("talker"));
        s.insert(1, &a, PreparedInput::tokens(vec![1, 2])).unwrap();
        s.insert(1, &b, PreparedInput::tokens(vec![1])).unwrap();
        s.insert(2, &a, PreparedInput::tokens(vec![3])).unwrap();
        assert_eq!(s.clear(), (3, 4));
        assert_eq!((s.rows(), s.tokens()), (0, 0));
        assert_eq!(
            (s.node_totals("thinker"), s.node_totals("talker")),
            ((0, 0), (0, 0))
        );
        assert!(s.get(1, "talker").is_none());
        assert_eq!(s.clear(), (0, 0));
        // Inputs are held again as before.
        assert_eq!(s.insert(1, &a, PreparedInput::tokens(vec![5])).unwrap(), 1);
        assert_eq!((s.rows(), s.tokens()), (1, 1));
    }

    #[test]
    fn release_and_forget_are_idempotent() {
        let mut s = PreparedStore::default();
        let (a, b) = (Name::from("thinker"), Name::from("talker"));
        s.insert(1, &a, PreparedInput::tokens(vec![1, 2])).unwrap();
        s.insert(1, &b, PreparedInput::tokens(vec![1])).unwrap();
        s.insert(2, &a, PreparedInput::tokens(vec![3])).unwrap();
        assert!(matches!(
            s.insert(2, &a, PreparedInput::tokens(vec![3])),
            Err(ChunkingError::AlreadyQueued { .. })
        ));
        assert_eq!(s.forget(1).len(), 2);
        assert!(s.forget(1).is_empty());
        assert!(!s.release(1, "thinker"));
        assert!(s.release(2, "thinker"));
        assert!(!s.release(2, "thinker"));
        assert_eq!((s.rows(), s.tokens()), (0, 0));
    }

    #[test]
    fn bad_inputs_are_refused() {
        let mut s = PreparedStore::default();
        let node = Name::from("llm");
        assert!(matches!(
            s.insert(1, &node, PreparedInput::tokens(Vec::new())),
            Err(ChunkingError::EmptyInput { .. })
        ));
        let bad = PreparedInput {
            token_ids: vec![1, 2, 3].into(),
            extras: Some(TokenExtras {
                width: 2,
                values: vec![0.0; 4].into(),
            }),
        };
        assert!(matches!(
            s.insert(1, &node, bad),
            Err(ChunkingError::ExtrasMismatch { .. })
        ));
        assert_eq!(s.rows(), 0);
    }
}
