//! Sliding-window layers: every row exact (fp16) in the pages themselves. A window holds a few
//! blocks per sequence, so coding it would save little memory and cost most of the quality.

use super::attend::Dense;
use super::step::StepPlan;
use super::{check_fp16_range, check_rows, invalid, window_row_bytes, PagedResult};
use half::f16;

/// Window pages, read only: page `b` starts at byte `b * page_stride` (engines pad window
/// pages to the record page) and holds `[kv_heads][tokens][2][head_dim]` fp16.
#[derive(Clone, Copy, Debug)]
pub struct WindowPages<'a> {
    pub bytes: &'a [u8],
    pub count: usize,
    pub page_stride: usize,
    pub tokens: usize,
}

/// Window pages, written by [`WindowJournal::write`].
#[derive(Debug)]
pub struct WindowPagesMut<'a> {
    pub bytes: &'a mut [u8],
    pub count: usize,
    pub page_stride: usize,
    pub tokens: usize,
}

/// One sliding-window layer: attention over the last `window` positions, rows in the pages.
#[derive(Clone, Debug)]
pub struct WindowJournal {
    kv_heads: usize,
    head_dim: usize,
    window: usize,
}

impl WindowJournal {
    pub fn new(kv_heads: usize, head_dim: usize, window: i64) -> PagedResult<Self> {
        let window = match usize::try_from(window) {
            Ok(w) if w > 0 => w,
            _ => return invalid(format!("sliding window must be positive, got {window}")),
        };
        if kv_heads == 0 || head_dim == 0 {
            return invalid(format!(
                "kv_heads and head_dim must be positive, got {kv_heads} and {head_dim}"
            ));
        }
        Ok(Self {
            kv_heads,
            head_dim,
            window,
        })
    }

    pub fn window(&self) -> usize {
        self.window
    }

    /// Refuses a page tensor whose shape in bytes (`[blocks, kv_heads, tokens, row]`) is not
    /// this layer's.
    pub fn check_shape(&self, shape_bytes: &[usize]) -> PagedResult<()> {
        let row = window_row_bytes(self.head_dim);
        match shape_bytes {
            [_, h, t, r] if *h == self.kv_heads && *r == row && *t > 0 => Ok(()),
            _ => invalid(format!(
                "sliding-window page of shape {shape_bytes:?} bytes; this layer needs \
                 [blocks, {}, tokens, {row}]",
                self.kv_heads
            )),
        }
    }

    fn check_span(
        &self,
        bytes: usize,
        count: usize,
        stride: usize,
        tokens: usize,
    ) -> PagedResult<()> {
        let page = self.kv_heads * tokens * window_row_bytes(self.head_dim);
        let need = count.checked_sub(1).map_or(0, |c| c * stride + page);
        if count == 0 || stride < page || bytes < need {
            return invalid(format!(
                "sliding-window pages: {count} pages of {page} bytes every {stride} bytes do \
                 not fit in {bytes} bytes"
            ));
        }
        Ok(())
    }

    /// Byte offset of row `offset` of KV head `h` in page `block`.
    fn at(&self, stride: usize, tokens: usize, block: usize, h: usize, offset: usize) -> usize {
        let row = window_row_bytes(self.head_dim);
        block * stride + (h * tokens + offset) * row
    }

    /// Stores rows `key`/`value` (`[tokens][kv_heads][head_dim]`) at engine slots
    /// `block * tokens_per_page + offset` (negative slots are padding), as fp16.
    pub fn write(
        &self,
        pages: WindowPagesMut<'_>,
        key: &[f32],
        value: &[f32],
        slots: &[i64],
    ) -> PagedResult<()> {
        let (kvh, d) = (self.kv_heads, self.head_dim);
        let width = kvh * d;
        if key.len() != slots.len() * width || value.len() != key.len() {
            return invalid(format!(
                "key/value: expected [{}, {kvh}, {d}] each (one row per slot), got {} and {} values",
                slots.len(),
                key.len(),
                value.len()
            ));
        }
        check_rows(key, value)?;
        let (size, stride) = (pages.tokens, pages.page_stride);
        self.check_span(pages.bytes.len(), pages.count, stride, size)?;
        let kept: Vec<(usize, usize)> = slots
            .iter()
            .enumerate()
            .filter_map(|(t, &s)| usize::try_from(s).ok().map(|s| (s, t)))
            .collect();
        if kept.is_empty() {
            return Ok(());
        }
        let gather = |x: &[f32]| -> Vec<f32> {
            kept.iter()
                .flat_map(|&(_, t)| x[t * width..(t + 1) * width].iter().copied())
                .collect()
        };
        check_fp16_range(&gather(key), &gather(value), "sliding-window layers")?;
        if let Some(&(slot, _)) = kept.iter().max().filter(|(s, _)| s / size >= pages.count) {
            return invalid(format!("slot {slot} is past the last page"));
        }
        for &(slot, t) in &kept {
            for h in 0..kvh {
                let at = self.at(stride, size, slot / size, h, slot % size);
                let src = (t * kvh + h) * d;
                for (side, x) in [key, value].into_iter().enumerate() {
                    for i in 0..d {
                        let o = at + 2 * (side * d + i);
                        pages.bytes[o..o + 2]
                            .copy_from_slice(&f16::from_f32(x[src + i]).to_le_bytes());
                    }
                }
            }
        }
        Ok(())
    }

    /// The keys and values request span `index` of `plan` reads: the blocks from its first
    /// query's window start to its last position, `[kv_heads][tokens][head_dim]` float32.
    pub fn dense(
        &self,
        pages: WindowPages<'_>,
        plan: &StepPlan,
        index: usize,
    ) -> PagedResult<Dense> {
        let (size, stride) = (pages.tokens, pages.page_stride);
        self.check_span(pages.bytes.len(), pages.count, stride, size)?;
        if plan.block_size() != size {
            return invalid(format!(
                "the step plan is for pages of {} tokens; this layer's hold {size}",
                plan.block_size()
            ));
        }
        let Some(span) = plan.spans().get(index) else {
            return invalid(format!(
                "request {index} is past the plan's {}",
                plan.spans().len()
            ));
        };
        let table = plan.table(span);
        let first = plan.window_first_block(span.first_position(), Some(self.window));
        let last = (span.len - 1) / size;
        if let Some(&b) = table[first..=last].iter().find(|&&b| b >= pages.count) {
            return invalid(format!("block {b} is past the {} pages", pages.count));
        }
        let (kvh, d) = (self.kv_heads, self.head_dim);
        let tokens = (last - first + 1) * size;
        let (mut k, mut v) = (
            vec![0.0f32; kvh * tokens * d],
            vec![0.0f32; kvh * tokens * d],
        );
        let read = |o: usize| f16::from_le_bytes([pages.bytes[o], pages.bytes[o + 1]]).to_f32();
        for (j, &b) in table[first..=last].iter().enumerate() {
            for h in 0..kvh {
                for off in 0..size {
                    let at = self.at(stride, size, b, h, off);
                    let dst = (h * tokens + j * size + off) * d;
                    for i in 0..d {
                        k[dst + i] = read(at + 2 * i);
                        v[dst + i] = read(at + 2 * (d + i));
                    }
                }
            }
        }
        Ok(Dense {
            k,
            v,
            tokens,
            first_position: first * size,
        })
    }
}
