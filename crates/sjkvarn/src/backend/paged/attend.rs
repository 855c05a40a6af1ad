//! Reading a layer over a step plan: the core's kernels over records in place, or the dense
//! K and V a query block sees (lossless pages, sliding windows) for a caller's own matmuls.

use super::journal::{PagedJournal, Pages, Rows};
use super::step::{QueryBlock, StepPlan};
use super::{invalid, PagedResult, BLOCK};
use crate::attention::{attend_paged, PagedBlock};
use rayon::prelude::*;

/// The keys and values one query block sees, `[kv_heads][tokens][head_dim]` float32 each,
/// holding positions `first_position..first_position + tokens` (rows past the queries are
/// there but must be masked).
#[derive(Clone, Debug, PartialEq)]
pub struct Dense {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub tokens: usize,
    pub first_position: usize,
}

/// Exact rows as the kernels take them: `[BLOCK][kv_heads][head_dim]` float32, K and V.
fn widened(rows: &Rows) -> (Vec<f32>, Vec<f32>) {
    let half = rows.len() / 2;
    let wide = |r: &[half::f16]| r.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    (wide(&rows[..half]), wide(&rows[half..]))
}

impl PagedJournal {
    /// Whether [`attend`](Self::attend) serves this layer (records read in place); otherwise
    /// callers read [`dense`](Self::dense) per query block.
    pub fn reads_in_place(&self) -> bool {
        !self.settings.lossless && self.window.is_none()
    }

    fn check_plan(&self, pages: &Pages<'_>, plan: &StepPlan) -> PagedResult<()> {
        if plan.block_size() != BLOCK {
            return invalid(format!(
                "the step plan is for pages of {} tokens; this layer's hold {BLOCK}",
                plan.block_size()
            ));
        }
        self.check_pages(pages.bytes.len(), pages.count)?;
        for span in plan.spans() {
            if let Some(&b) = plan.table(span).iter().find(|&&b| b >= pages.count) {
                return invalid(format!("block {b} is past the {} pages", pages.count));
            }
        }
        Ok(())
    }

    /// The exact rows of a query block's own block, which must have been written.
    fn own_rows(&self, block: usize, qb: usize) -> PagedResult<&Rows> {
        match self.exact(block) {
            Some(rows) => Ok(rows),
            None => invalid(format!(
                "block {block} (position {}) has no rows: it was never written",
                qb * BLOCK
            )),
        }
    }

    /// Causal attention of the step's queries `q` (`[tokens][q_heads][head_dim]`, at least
    /// the plan's tokens) over the plan's blocks: the sink and each query block's own block
    /// from their exact rows, every other block from its record in place. Returns
    /// `[tokens][q_heads][head_dim]`; rows the plan does not cover are zero.
    pub fn attend(
        &self,
        pages: Pages<'_>,
        plan: &StepPlan,
        q: &[f32],
        q_heads: usize,
        scale: f32,
    ) -> PagedResult<Vec<f32>> {
        let Some(codec) = &self.codec else {
            return invalid("lossless pages are read through dense()");
        };
        if !self.reads_in_place() {
            return invalid("sliding-window layers are read through dense()");
        }
        self.check_plan(&pages, plan)?;
        let row = q_heads * self.head_dim;
        if q_heads == 0 || !q.len().is_multiple_of(row) || q.len() / row < plan.tokens() {
            return invalid(format!(
                "query: expected [at least {}, {q_heads}, {}], got {} values",
                plan.tokens(),
                self.head_dim,
                q.len()
            ));
        }
        let page = self.page_bytes();
        let record = |b: usize| -> PagedResult<PagedBlock<'_>> {
            if !self.recorded.contains(&b) {
                return invalid(format!(
                    "block {b} holds no record: it was never written in full"
                ));
            }
            Ok(PagedBlock::Record(&pages.bytes[b * page..(b + 1) * page]))
        };
        let one = |qb: &QueryBlock| -> PagedResult<Vec<f32>> {
            let table = plan.table(&plan.spans()[qb.span]);
            let sink = match (self.settings.sink && qb.block > 0, table.first()) {
                (true, Some(&b)) => self.exact(b).map(widened),
                _ => None,
            };
            let own = widened(self.own_rows(table[qb.block], qb.block)?);
            let mut blocks = Vec::with_capacity(qb.block + 1);
            for (j, &b) in table[..qb.block].iter().enumerate() {
                match (&sink, j) {
                    (Some((k, v)), 0) => blocks.push(PagedBlock::Rows { k, v }),
                    _ => blocks.push(record(b)?),
                }
            }
            blocks.push(PagedBlock::Rows {
                k: &own.0,
                v: &own.1,
            });
            let rows = &q[qb.queries.start * row..qb.queries.end * row];
            Ok(attend_paged(
                codec,
                q_heads,
                self.kv_heads,
                &blocks,
                0,
                rows,
                qb.position,
                scale,
            )?)
        };
        let results: Vec<PagedResult<Vec<f32>>> = plan.query_blocks().par_iter().map(one).collect();
        let mut out = vec![0.0f32; q.len()];
        for (qb, result) in plan.query_blocks().iter().zip(results) {
            out[qb.queries.start * row..qb.queries.end * row].copy_from_slice(&result?);
        }
        Ok(out)
    }

    /// The keys and values query block `index` of `plan` reads under this layer's window:
    /// lossless pages as stored, otherwise records decoded, the sink (no window) and the own
    /// block exact.
    pub fn dense(&self, pages: Pages<'_>, plan: &StepPlan, index: usize) -> PagedResult<Dense> {
        self.check_plan(&pages, plan)?;
        let Some(qb) = plan.query_blocks().get(index) else {
            return invalid(format!(
                "query block {index} is past the plan's {}",
                plan.query_blocks().len()
            ));
        };
        let table = plan.table(&plan.spans()[qb.span]);
        let lo = plan.window_first_block(qb.position, self.window);
        let (d, kvh) = (self.head_dim, self.kv_heads);
        let tokens = (qb.block - lo + 1) * BLOCK;
        let (mut k, mut v) = (
            vec![0.0f32; kvh * tokens * d],
            vec![0.0f32; kvh * tokens * d],
        );
        let sink = self.settings.sink && self.window.is_none();
        for (j, &b) in table.iter().enumerate().take(qb.block + 1).skip(lo) {
            // `[kv_heads][BLOCK][d]` float32 K and V of block j.
            let (bk, bv) = if self.settings.lossless {
                self.lossless_rows(&pages, b)
            } else if j == qb.block {
                head_major(&widened(self.own_rows(b, j)?), kvh, d)
            } else if let Some(rows) = self.exact(b).filter(|_| j == 0 && sink) {
                head_major(&widened(rows), kvh, d)
            } else {
                self.decoded(pages.bytes, b)?
            };
            let at = (j - lo) * BLOCK;
            for h in 0..kvh {
                let src = h * BLOCK * d..(h + 1) * BLOCK * d;
                let dst = (h * tokens + at) * d;
                k[dst..dst + BLOCK * d].copy_from_slice(&bk[src.clone()]);
                v[dst..dst + BLOCK * d].copy_from_slice(&bv[src]);
            }
        }
        Ok(Dense {
            k,
            v,
            tokens,
            first_position: lo * BLOCK,
        })
    }

    /// Lossless block `block` as `[kv_heads][BLOCK][d]` float32 K and V.
    fn lossless_rows(&self, pages: &Pages<'_>, block: usize) -> (Vec<f32>, Vec<f32>) {
        let (d, kvh, page) = (self.head_dim, self.kv_heads, self.page_bytes());
        let bytes = &pages.bytes[block * page..(block + 1) * page];
        let side = |s: usize| -> Vec<f32> {
            (0..kvh)
                .flat_map(|h| {
                    let at = (h * 2 + s) * BLOCK * d;
                    (at..at + BLOCK * d).map(|i| self.dtype.get(bytes, i))
                })
                .collect()
        };
        (side(0), side(1))
    }
}

/// `[BLOCK][kv_heads][d]` rows as `[kv_heads][BLOCK][d]`.
fn head_major((k, v): &(Vec<f32>, Vec<f32>), kvh: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let turn = |x: &[f32]| -> Vec<f32> {
        let mut out = vec![0.0f32; x.len()];
        for t in 0..BLOCK {
            for h in 0..kvh {
                out[(h * BLOCK + t) * d..(h * BLOCK + t + 1) * d]
                    .copy_from_slice(&x[(t * kvh + h) * d..(t * kvh + h + 1) * d]);
            }
        }
        out
    };
    (turn(k), turn(v))
}
