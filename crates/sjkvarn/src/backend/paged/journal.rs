//! One full-attention layer's journal: the exact rows of open blocks and sinks beside the
//! engine's pages, and the seal that turns a full block into its records.

use super::sinks::Sinks;
use super::{check_fp16_range, check_rows, invalid, PageDtype, PagedResult, PagedSettings, BLOCK};
use crate::codec::extension::records::{decode_records, encode_records};
use crate::codec::BodyCodec;
use half::f16;
use std::collections::{BTreeMap, HashMap, HashSet};

/// A block's exact rows: K then V, each `[BLOCK][kv_heads][head_dim]` fp16.
pub(crate) type Rows = Box<[f16]>;

/// The engine's pages of one layer, read only: `count` pages of equal size, page after page.
#[derive(Clone, Copy, Debug)]
pub struct Pages<'a> {
    pub bytes: &'a [u8],
    pub count: usize,
}

/// The engine's pages of one layer, written by seals and lossless writes.
#[derive(Debug)]
pub struct PagesMut<'a> {
    pub bytes: &'a mut [u8],
    pub count: usize,
}

/// One layer's journal over block pages `[blocks][kv_heads][state_bytes]`.
///
/// Call [`write`](Self::write) with the step's new rows, then attend, then
/// [`forget`](Self::forget). A call that fails changes neither the pages nor the journal.
#[derive(Debug)]
pub struct PagedJournal {
    pub(crate) settings: PagedSettings,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) dtype: PageDtype,
    pub(crate) window: Option<usize>,
    pub(crate) state_bytes: usize,
    /// `None` for lossless pages, which hold rows instead of records.
    pub(crate) codec: Option<BodyCodec>,
    pub(crate) open: HashMap<usize, Rows>,
    /// Blocks of `open` whose page already holds their record.
    pub(crate) sealed: HashSet<usize>,
    /// Blocks whose page holds a record this journal sealed (reads of any other are refused).
    pub(crate) recorded: HashSet<usize>,
    pub(crate) sinks: Sinks<Rows>,
}

/// How a written block starts out before the step's rows land in it.
enum Start {
    Fresh,
    Open,
    Reopened(Rows),
}

impl PagedJournal {
    /// A journal for `kv_heads` heads of `head_dim` over pages of `dtype` (lossless pages hold
    /// rows of that type); `window`: the layer's sliding window, if any (no sink then).
    pub fn new(
        settings: PagedSettings,
        kv_heads: usize,
        head_dim: usize,
        dtype: PageDtype,
        window: Option<usize>,
    ) -> PagedResult<Self> {
        if kv_heads == 0 || head_dim == 0 {
            return invalid(format!(
                "kv_heads and head_dim must be positive, got {kv_heads} and {head_dim}"
            ));
        }
        let codec = if settings.lossless {
            None
        } else {
            Some(settings.codec(head_dim)?)
        };
        Ok(Self {
            state_bytes: settings.state_bytes(head_dim, dtype)?,
            settings,
            kv_heads,
            head_dim,
            dtype,
            window: window.filter(|&w| w > 0),
            codec,
            open: HashMap::new(),
            sealed: HashSet::new(),
            recorded: HashSet::new(),
            sinks: Sinks::default(),
        })
    }

    pub fn settings(&self) -> &PagedSettings {
        &self.settings
    }

    /// Bytes of one KV head's share of a page.
    pub fn state_bytes(&self) -> usize {
        self.state_bytes
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        self.kv_heads * self.state_bytes
    }

    /// Blocks whose exact rows are held as open blocks (being filled or reopened), ascending.
    pub fn open_blocks(&self) -> Vec<usize> {
        let mut blocks: Vec<usize> = self.open.keys().copied().collect();
        blocks.sort_unstable();
        blocks
    }

    /// Sink blocks held exact, least recently used first.
    pub fn sink_blocks(&self) -> Vec<usize> {
        self.sinks.blocks()
    }

    pub(crate) fn row_values(&self) -> usize {
        BLOCK * self.kv_heads * self.head_dim
    }

    /// Refuses pages whose size is not this layer's.
    pub(crate) fn check_pages(&self, bytes: usize, count: usize) -> PagedResult<()> {
        let page = bytes.checked_div(count).unwrap_or(0);
        if count == 0 || page * count != bytes || page != self.page_bytes() {
            return invalid(format!(
                "KV page of {page} bytes; this layer needs {} heads x {} bytes",
                self.kv_heads, self.state_bytes
            ));
        }
        Ok(())
    }

    /// The exact rows of `block`, open or kept as a sink.
    pub(crate) fn exact(&self, block: usize) -> Option<&Rows> {
        self.open.get(&block).or_else(|| self.sinks.get(block))
    }

    /// Stores rows `key`/`value` (`[tokens][kv_heads][head_dim]`) at engine slots
    /// `block * BLOCK + offset` (negative slots are padding). A block whose last row arrives
    /// is sealed into its page. A write at offset 0 starts the block afresh (the engine reused
    /// it); a write into a sealed block (the engine recomputing a cached block's last token)
    /// reads the block back and leaves its record as it is.
    pub fn write(
        &mut self,
        pages: PagesMut<'_>,
        key: &[f32],
        value: &[f32],
        slots: &[i64],
    ) -> PagedResult<()> {
        let width = self.kv_heads * self.head_dim;
        if key.len() != slots.len() * width || value.len() != key.len() {
            return invalid(format!(
                "key/value: expected [{}, {}, {}] each (one row per slot), got {} and {} values",
                slots.len(),
                self.kv_heads,
                self.head_dim,
                key.len(),
                value.len()
            ));
        }
        check_rows(key, value)?;
        self.check_pages(pages.bytes.len(), pages.count)?;
        // Block -> (offset, token) in token order, for the rows that are no padding.
        let mut by_block: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        for (t, &slot) in slots.iter().enumerate() {
            let Ok(slot) = usize::try_from(slot) else {
                continue;
            };
            if slot / BLOCK >= pages.count {
                return invalid(format!(
                    "slot {slot} is past the last page ({} pages of {BLOCK} tokens)",
                    pages.count
                ));
            }
            by_block
                .entry(slot / BLOCK)
                .or_default()
                .push((slot % BLOCK, t));
        }
        if by_block.is_empty() {
            return Ok(());
        }
        if self.settings.lossless {
            self.write_lossless(pages, key, value, &by_block);
            return Ok(());
        }
        let kept: Vec<usize> = by_block.values().flatten().map(|&(_, t)| t).collect();
        let gather = |x: &[f32]| -> Vec<f32> {
            kept.iter()
                .flat_map(|&t| x[t * width..(t + 1) * width].iter().copied())
                .collect()
        };
        check_fp16_range(&gather(key), &gather(value), "open and sink blocks")?;

        // Everything that can fail (reopening, sealing) runs before anything changes.
        let mut starts = Vec::with_capacity(by_block.len());
        let mut seals = Vec::new();
        for (&block, rows) in &by_block {
            let first = rows.iter().map(|r| r.0).min().unwrap_or(0);
            let last = rows.iter().map(|r| r.0).max().unwrap_or(0);
            let start = if first == 0 {
                Start::Fresh
            } else if self.open.contains_key(&block) {
                Start::Open
            } else {
                Start::Reopened(self.reopened(pages.bytes, block, first)?)
            };
            let sealed = match start {
                Start::Fresh => false,
                Start::Open => self.sealed.contains(&block),
                Start::Reopened(_) => true,
            };
            if last == BLOCK - 1 && !sealed {
                let mut full = match &start {
                    Start::Open => self.open[&block].clone(),
                    _ => self.fresh(),
                };
                self.place(&mut full, rows, key, value);
                seals.push((block, self.seal(&full)?));
            }
            starts.push((block, start));
        }

        for (block, start) in starts {
            let mut rows = match start {
                Start::Fresh => {
                    self.sinks.remove(block);
                    self.sealed.remove(&block);
                    self.recorded.remove(&block);
                    self.fresh()
                }
                // Chosen above only for blocks held open.
                Start::Open => self.open.remove(&block).unwrap_or_else(|| self.fresh()),
                Start::Reopened(rows) => {
                    self.sealed.insert(block);
                    rows
                }
            };
            self.place(&mut rows, &by_block[&block], key, value);
            self.open.insert(block, rows);
        }
        let page = self.page_bytes();
        for (block, record) in seals {
            pages.bytes[block * page..(block + 1) * page].copy_from_slice(&record);
            self.sealed.insert(block);
            self.recorded.insert(block);
        }
        Ok(())
    }

    /// Zeroed exact rows for one block.
    fn fresh(&self) -> Rows {
        vec![f16::ZERO; 2 * self.row_values()].into_boxed_slice()
    }

    /// Writes the rows of `tokens` (`(offset, token)`) into a block's exact rows.
    fn place(&self, rows: &mut [f16], tokens: &[(usize, usize)], key: &[f32], value: &[f32]) {
        let width = self.kv_heads * self.head_dim;
        let half = self.row_values();
        for &(off, t) in tokens {
            let src = t * width..(t + 1) * width;
            for (dst, &x) in rows[off * width..(off + 1) * width]
                .iter_mut()
                .zip(&key[src.clone()])
            {
                *dst = f16::from_f32(x);
            }
            let v_rows = &mut rows[half + off * width..half + (off + 1) * width];
            for (dst, &x) in v_rows.iter_mut().zip(&value[src]) {
                *dst = f16::from_f32(x);
            }
        }
    }

    /// Lossless pages `[kv_heads][2][BLOCK][head_dim]` in the page dtype: rows go straight in.
    fn write_lossless(
        &self,
        pages: PagesMut<'_>,
        key: &[f32],
        value: &[f32],
        by_block: &BTreeMap<usize, Vec<(usize, usize)>>,
    ) {
        let (d, kvh, page) = (self.head_dim, self.kv_heads, self.page_bytes());
        for (&block, tokens) in by_block {
            let bytes = &mut pages.bytes[block * page..(block + 1) * page];
            for &(off, t) in tokens {
                for h in 0..kvh {
                    let src = (t * kvh + h) * d;
                    for (side, x) in [key, value].into_iter().enumerate() {
                        let at = ((h * 2 + side) * BLOCK + off) * d;
                        for i in 0..d {
                            self.dtype.put(bytes, at + i, x[src + i]);
                        }
                    }
                }
            }
        }
    }

    /// The record of `rows`: one per KV head, the tiles in `[kv_heads][BLOCK][head_dim]`.
    pub(crate) fn seal(&self, rows: &[f16]) -> PagedResult<Vec<u8>> {
        let Some(codec) = &self.codec else {
            return invalid("lossless pages hold no records");
        };
        let (k, v) = (self.tiles(rows, 0), self.tiles(rows, 1));
        Ok(encode_records(codec, &k, &v, false, None)?)
    }

    /// Side `side` (0 K, 1 V) of exact rows as float32 tiles `[kv_heads][BLOCK][head_dim]`.
    fn tiles(&self, rows: &[f16], side: usize) -> Vec<f32> {
        let (d, kvh) = (self.head_dim, self.kv_heads);
        let base = side * self.row_values();
        let mut out = vec![0.0f32; self.row_values()];
        for h in 0..kvh {
            for t in 0..BLOCK {
                let src = base + (t * kvh + h) * d;
                let dst = (h * BLOCK + t) * d;
                for i in 0..d {
                    out[dst + i] = rows[src + i].to_f32();
                }
            }
        }
        out
    }

    /// K and V of `block`'s record, `[kv_heads][BLOCK][head_dim]` float32 each.
    pub(crate) fn decoded(&self, bytes: &[u8], block: usize) -> PagedResult<(Vec<f32>, Vec<f32>)> {
        let Some(codec) = &self.codec else {
            return invalid("lossless pages hold no records");
        };
        if !self.recorded.contains(&block) {
            return invalid(format!(
                "block {block} holds no record: it was never written in full"
            ));
        }
        let page = self.page_bytes();
        let record = &bytes[block * page..(block + 1) * page];
        let (mut k, mut v) = (vec![0.0; self.row_values()], vec![0.0; self.row_values()]);
        decode_records(codec, record, &mut k, &mut v, false, None)?;
        Ok((k, v))
    }

    /// Exact rows of a sealed block that is open no more: its sink copy, else its record.
    fn reopened(&self, bytes: &[u8], block: usize, offset: usize) -> PagedResult<Rows> {
        if let Some(rows) = self.sinks.get(block) {
            return Ok(rows.clone());
        }
        if !self.recorded.contains(&block) {
            return invalid(format!(
                "slot {} continues block {block}, which was never written",
                block * BLOCK + offset
            ));
        }
        let (k, v) = self.decoded(bytes, block)?;
        let (d, kvh) = (self.head_dim, self.kv_heads);
        let half = self.row_values();
        let mut rows = self.fresh();
        for h in 0..kvh {
            for t in 0..BLOCK {
                let src = (h * BLOCK + t) * d;
                let dst = (t * kvh + h) * d;
                for i in 0..d {
                    rows[dst + i] = f16::from_f32(k[src + i]);
                    rows[half + dst + i] = f16::from_f32(v[src + i]);
                }
            }
        }
        Ok(rows)
    }

    /// Drops the exact rows of full blocks that are no sink; keeps `live_sinks` (the first
    /// blocks of this step's sequences) exact, up to `max_sink_blocks`, the least recently
    /// used going first.
    pub fn forget(&mut self, live_sinks: &[usize]) {
        let mut live: Vec<usize> = live_sinks.to_vec();
        live.sort_unstable();
        live.dedup();
        let keep_sinks = self.settings.sink && self.window.is_none();
        let full: Vec<usize> = self.sealed.drain().collect();
        for block in full {
            if let Some(rows) = self.open.remove(&block) {
                if keep_sinks && live.binary_search(&block).is_ok() {
                    self.sinks.set(block, rows);
                }
            }
        }
        for &block in &live {
            self.sinks.touch(block);
        }
        self.sinks.shrink_to(self.settings.max_sink_blocks);
    }

    /// Exact sink blocks held now.
    pub fn sink_count(&self) -> usize {
        self.sinks.len()
    }
}
