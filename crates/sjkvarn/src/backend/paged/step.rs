//! The per-step plan: which blocks each query block reads, worked out once per engine step
//! from the step's metadata and then shared by every layer (as an engine's attention metadata
//! is), so that no layer re-slices block tables.

use super::{invalid, PagedResult};
use std::ops::Range;

/// One request with queries this step: rows `queries` of the step's query tensor, the last
/// ones of a sequence of `len` positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpan {
    /// The request's row in the block table.
    pub request: usize,
    pub queries: Range<usize>,
    pub len: usize,
}

impl RequestSpan {
    /// Position of the first query row.
    pub fn first_position(&self) -> usize {
        self.len - self.queries.len()
    }
}

/// The queries of one request that fall in one block: they read the same blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueryBlock {
    /// Index into [`StepPlan::spans`].
    pub span: usize,
    /// Rows of the step's query tensor.
    pub queries: Range<usize>,
    /// Position of the first of those rows.
    pub position: usize,
    /// The block index (in the request's table) the rows fall in: they read table entries
    /// `0..=block`.
    pub block: usize,
}

/// What one engine step reads, for pages of `block_size` tokens.
#[derive(Clone, Debug)]
pub struct StepPlan {
    block_size: usize,
    width: usize,
    table: Vec<usize>,
    spans: Vec<RequestSpan>,
    query_blocks: Vec<QueryBlock>,
    live_sinks: Vec<usize>,
    tokens: usize,
}

impl StepPlan {
    /// The plan for requests `r` whose queries are rows `query_start[r]..query_start[r + 1]`,
    /// the last of a sequence of `seq_lens[r]` positions held in blocks `block_table[r]`
    /// (`width` entries per request, row after row). Entries a request never reads may hold
    /// anything; the ones it reads must be block ids.
    pub fn new(
        query_start: &[i64],
        seq_lens: &[i64],
        block_table: &[i64],
        width: usize,
        block_size: usize,
    ) -> PagedResult<Self> {
        if block_size == 0 {
            return invalid("block size must be positive");
        }
        let reqs = seq_lens.len();
        if query_start.len() != reqs + 1 {
            return invalid(format!(
                "query_start holds {} entries; {reqs} requests need {}",
                query_start.len(),
                reqs + 1
            ));
        }
        if block_table.len() != reqs * width {
            return invalid(format!(
                "block table of {} entries; expected {reqs} requests x {width}",
                block_table.len()
            ));
        }
        let count = |x: i64, what: &str| -> PagedResult<usize> {
            usize::try_from(x).or_else(|_| invalid(format!("{what} must not be negative, got {x}")))
        };
        let mut table = vec![0usize; block_table.len()];
        let mut spans = Vec::new();
        let mut query_blocks = Vec::new();
        let mut live_sinks = Vec::new();
        let mut tokens = 0;
        for r in 0..reqs {
            let (start, end) = (
                count(query_start[r], "query_start")?,
                count(query_start[r + 1], "query_start")?,
            );
            if end < start || start < tokens {
                return invalid(format!(
                    "query_start must not decrease, got {start}..{end} after {tokens}"
                ));
            }
            tokens = end;
            let len = count(seq_lens[r], "seq_lens")?;
            let n = end - start;
            if n > len {
                return invalid(format!(
                    "request {r} has {n} queries but a sequence of only {len} positions"
                ));
            }
            if len == 0 {
                continue;
            }
            let blocks = (len - 1) / block_size + 1;
            if blocks > width {
                return invalid(format!(
                    "request {r}: {len} positions need {blocks} blocks; the table holds {width}"
                ));
            }
            let row = &block_table[r * width..r * width + blocks];
            for (j, &b) in row.iter().enumerate() {
                table[r * width + j] = count(b, "block ids")?;
            }
            live_sinks.push(table[r * width]);
            if n == 0 {
                continue;
            }
            let span = RequestSpan {
                request: r,
                queries: start..end,
                len,
            };
            let first = span.first_position();
            for qb in first / block_size..=(len - 1) / block_size {
                let lo = (qb * block_size).max(first);
                let hi = ((qb + 1) * block_size).min(len);
                query_blocks.push(QueryBlock {
                    span: spans.len(),
                    queries: start + lo - first..start + hi - first,
                    position: lo,
                    block: qb,
                });
            }
            spans.push(span);
        }
        live_sinks.sort_unstable();
        live_sinks.dedup();
        Ok(Self {
            block_size,
            width,
            table,
            spans,
            query_blocks,
            live_sinks,
            tokens,
        })
    }

    /// Tokens per page this plan was built for.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Query rows the step covers (`query_start`'s last entry).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Requests with queries this step.
    pub fn spans(&self) -> &[RequestSpan] {
        &self.spans
    }

    /// Every request's queries, split by the block they fall in.
    pub fn query_blocks(&self) -> &[QueryBlock] {
        &self.query_blocks
    }

    /// The first blocks of the step's sequences (ascending): the sinks a layer keeps exact.
    pub fn live_sinks(&self) -> &[usize] {
        &self.live_sinks
    }

    /// Block ids of the request `span` belongs to, entry `j` holding positions
    /// `j * block_size..`; only entries up to its last position are meaningful.
    pub fn table(&self, span: &RequestSpan) -> &[usize] {
        let blocks = (span.len - 1) / self.block_size + 1;
        &self.table[span.request * self.width..span.request * self.width + blocks]
    }

    /// First block index a query at `position` reads under a sliding `window` (0 without one).
    pub fn window_first_block(&self, position: usize, window: Option<usize>) -> usize {
        match window {
            Some(w) => (position + 1).saturating_sub(w) / self.block_size,
            None => 0,
        }
    }
}
