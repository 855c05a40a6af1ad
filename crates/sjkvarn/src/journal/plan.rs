//! The journal rules applied to one layer of a cache, in the terms the CPU and CUDA sequences
//! use (tokens held, sealed groups): what an append seals and when, what an idle step seals, and
//! what a truncation keeps. Both backends call these functions, so they take the same decisions.

use super::policy::{ring_capacity, Policy};
use std::ops::Range;

/// Journal state of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerState {
    /// Positions stored.
    pub len: usize,
    /// Sealed groups: the body is `[sink, sink + sealed * G)`.
    pub sealed: usize,
    /// Sealed groups before the last seal (part of the saved state).
    pub sealed_prev: usize,
    /// A chunked flush is unfinished.
    pub draining: bool,
}

/// One ubatch of an append: seal up to `state.sealed` groups, then store `take` positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub take: usize,
    /// The layer state after the seal and before the chunk is stored (`len` is the chunk start).
    pub state: LayerState,
}

/// The journal settings of a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    pub sink: usize,
    pub group: usize,
    /// Exact positions kept after a seal.
    pub tail: usize,
    /// Unsealed span that triggers a seal; 0 = fixed tail.
    pub tail_max: usize,
    /// Groups a decode-sized ubatch may seal; 0 = all at once.
    pub flush_chunk: usize,
    /// Largest ubatch; longer appends run as several.
    pub ubatch: usize,
    pub max_tokens: usize,
}

impl Rules {
    fn policy(&self, st: &LayerState) -> Policy {
        let mut p = Policy::new(
            self.sink as u32,
            self.tail as u32,
            self.tail_max as u32,
            self.group as u32,
            self.flush_chunk as u32,
        );
        p.b = (self.sink + st.sealed * self.group) as u32;
        p.b_prev = (self.sink + st.sealed_prev * self.group) as u32;
        p.b_pending = p.b;
        p.draining = st.draining;
        p
    }

    fn state(&self, p: &Policy, len: usize) -> LayerState {
        LayerState {
            len,
            sealed: (p.b as usize - self.sink) / self.group,
            sealed_prev: (p.b_prev as usize - self.sink) / self.group,
            draining: p.draining,
        }
    }

    /// Ring rows per layer: enough that no unsealed row is overwritten before it is sealed
    /// (`max(tail, tail_max) + G + 2 * ubatch`, padded to 128), and never more than a sequence of
    /// `max_tokens` can stage.
    pub fn ring_rows(&self) -> usize {
        let cap = ring_capacity(
            self.tail as u32,
            self.tail_max as u32,
            self.group as u32,
            self.ubatch as u32,
        ) as usize;
        cap.min(self.max_tokens.saturating_sub(self.sink).max(1))
    }

    /// The ubatches an append of `n` tokens to a layer in state `st` runs as. Each seal is
    /// decided at its ubatch's start, as the reference rule says.
    pub fn plan_append(&self, st: LayerState, n: usize) -> Vec<Chunk> {
        let mut p = self.policy(&st);
        let mut plan = Vec::new();
        let mut len = st.len;
        while len < st.len + n {
            let take = (st.len + n - len).min(self.ubatch.max(1));
            p.begin_ubatch(len as u32, take as u32);
            p.commit();
            plan.push(Chunk {
                take,
                state: self.state(&p, len),
            });
            len += take;
        }
        plan
    }

    /// The state after an idle step that never seals the last `max(keep_recent, tail)`
    /// positions (nothing is sealed with a fixed tail or when nothing is due; like every step,
    /// it commits, so `sealed_prev` becomes the sealed count it started from).
    pub fn idle(&self, st: LayerState, keep_recent: usize) -> LayerState {
        let mut p = self.policy(&st);
        p.idle(st.len as u32, keep_recent.min(u32::MAX as usize) as u32);
        p.commit();
        self.state(&p, st.len)
    }

    /// Truncation to the first `n` positions: the new state and the position to re-append from
    /// (`n` for a cut in the sink or ring, the group floor for a cut in the body; the layer's
    /// length when `n` is at or past it, which changes nothing).
    pub fn truncate(&self, st: LayerState, n: usize) -> (LayerState, usize) {
        if n >= st.len {
            return (st, st.len);
        }
        let mut p = self.policy(&st);
        let (resume, _) = p
            .truncate(n as u32)
            .expect("no seal is pending between calls");
        let resume = resume as usize;
        let mut out = self.state(&p, resume.min(st.len));
        if out.sealed == st.sealed {
            out.sealed_prev = st.sealed_prev;
            out.draining = st.draining;
        }
        (out, resume)
    }

    /// Positions `(sink, body, ring)` of a layer as half-open ranges.
    pub fn regions(&self, st: &LayerState) -> [Range<usize>; 3] {
        let sink_end = st.len.min(self.sink);
        let body_end = if st.len <= self.sink {
            sink_end
        } else {
            self.sink + self.group * st.sealed
        };
        [0..sink_end, sink_end..body_end, body_end..st.len]
    }

    /// Tokens the next append can take as one ubatch (a seal can only run at its start).
    pub fn chunk_limit(&self, st: &LayerState) -> usize {
        self.ubatch.min(self.max_tokens.saturating_sub(st.len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Rules {
        Rules {
            sink: 128,
            group: 128,
            tail: 256,
            tail_max: 512,
            flush_chunk: 0,
            ubatch: 64,
            max_tokens: 4096,
        }
    }

    #[test]
    fn seals_at_the_start_of_the_ubatch_that_finds_the_span_full() {
        let r = rules();
        let mut st = LayerState::default();
        let mut seals = Vec::new();
        for _ in 0..1100 {
            let plan = r.plan_append(st, 1);
            let c = plan[0];
            if c.state.sealed != st.sealed {
                seals.push((st.len, c.state.sealed));
            }
            st = LayerState {
                len: st.len + 1,
                ..c.state
            };
        }
        // Span 640 - 128 = 512 at position 640: seal down to floor(640 - 256) = 384 (2 groups).
        assert_eq!(seals[0], (640, 2));
        assert_eq!(st.sealed, 4); // B = 640 after 1,100 single-token ubatches
        let idle = r.idle(st, 0);
        assert_eq!(128 + 128 * idle.sealed, 768);
        assert_eq!(r.idle(st, 1100 - 700).sealed, st.sealed);
    }

    #[test]
    fn truncation_is_free_in_the_ring_and_floors_in_the_body() {
        let r = rules();
        let st = LayerState {
            len: 1100,
            sealed: 4,
            sealed_prev: 2,
            draining: false,
        };
        assert_eq!(r.truncate(st, 1000), (LayerState { len: 1000, ..st }, 1000));
        assert_eq!(r.truncate(st, 640).1, 640);
        let (cut, resume) = r.truncate(st, 500);
        assert_eq!((resume, cut.len, cut.sealed), (384, 384, 2));
        let (cut, resume) = r.truncate(st, 100);
        assert_eq!((resume, cut.len, cut.sealed), (100, 100, 0));
        assert_eq!(r.truncate(st, 5000), (st, 1100));
    }
}
