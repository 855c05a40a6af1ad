//! Cutting a sequence back (prompt caching, speculative rollback) and forking it (children
//! share the sealed records).

use super::sequence::Sequence;
use crate::backend::pool::SlotId;
use crate::error::CacheResult;

impl Sequence {
    /// Keeps the first `n` tokens of every layer and returns the position from which the caller
    /// must append K/V again: `n` for a cut in the ring or the sink (free and exact), the group
    /// floor `128 + 128 * floor((n - 128) / 128)` for a cut in the body (at most 127 tokens to
    /// re-run; the sealed groups from there on are dropped, the kept ones are untouched), and
    /// the length when `n` is at or past it.
    pub fn truncate(&mut self, n: usize) -> CacheResult<usize> {
        let rules = self.config.rules();
        let mut reprocess = usize::MAX;
        for l in self.layers.iter_mut() {
            let (st, resume) = rules.truncate(l.state(), n);
            if st.sealed < l.state.sealed {
                let dropped: Vec<SlotId> = l.blocks.split_off(st.sealed);
                self.pool.release(&dropped);
            }
            l.set_state(st);
            if l.state.len < self.config.sink {
                l.centring = None;
            }
            let per_pos = self.config.kv_heads * self.config.head_dim;
            l.window.truncate(l.state.len, self.config.sink, per_pos);
            reprocess = reprocess.min(resume);
        }
        Ok(reprocess)
    }

    /// A child sequence sharing this one's sealed records (reference counted) and owning copies
    /// of its sink and ring.
    pub fn fork(&self) -> Sequence {
        for l in &self.layers {
            self.pool.retain(&l.blocks);
        }
        Sequence {
            config: self.config.clone(),
            pool: self.pool.clone(),
            layers: self.layers.clone(),
        }
    }
}
