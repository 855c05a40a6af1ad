//! The exact copies of sink blocks, least recently used first out.

use std::collections::{BTreeMap, HashMap};

/// Exact rows of sealed sink blocks, evicted least recently used first. Replacing a block's
/// rows keeps its place; only [`touch`](Self::touch) makes it the most recent.
#[derive(Debug, Default, Clone)]
pub(crate) struct Sinks<T> {
    rows: HashMap<usize, (u64, T)>,
    order: BTreeMap<u64, usize>,
    clock: u64,
}

impl<T> Sinks<T> {
    pub(crate) fn len(&self) -> usize {
        self.rows.len()
    }

    pub(crate) fn get(&self, block: usize) -> Option<&T> {
        self.rows.get(&block).map(|(_, rows)| rows)
    }

    /// Stores `rows` for `block`: a new block becomes the most recent, a known one keeps
    /// its place.
    pub(crate) fn set(&mut self, block: usize, rows: T) {
        if let Some(entry) = self.rows.get_mut(&block) {
            entry.1 = rows;
            return;
        }
        self.clock += 1;
        self.order.insert(self.clock, block);
        self.rows.insert(block, (self.clock, rows));
    }

    /// Makes `block` the most recently used, if held.
    pub(crate) fn touch(&mut self, block: usize) {
        if let Some(entry) = self.rows.get_mut(&block) {
            self.order.remove(&entry.0);
            self.clock += 1;
            entry.0 = self.clock;
            self.order.insert(self.clock, block);
        }
    }

    pub(crate) fn remove(&mut self, block: usize) -> Option<T> {
        let (tick, rows) = self.rows.remove(&block)?;
        self.order.remove(&tick);
        Some(rows)
    }

    /// Drops the least recently used blocks until at most `keep` remain.
    pub(crate) fn shrink_to(&mut self, keep: usize) {
        while self.rows.len() > keep {
            let Some((_, block)) = self.order.pop_first() else {
                break;
            };
            self.rows.remove(&block);
        }
    }

    /// Blocks held, least recently used first.
    pub(crate) fn blocks(&self) -> Vec<usize> {
        self.order.values().copied().collect()
    }
}
