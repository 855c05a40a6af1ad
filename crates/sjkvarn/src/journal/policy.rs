//! The adaptive-tail journal policy of one sequence: where the sealed end `B` moves, and where a
//! truncation resumes.
//!
//! The arithmetic is `u32` like the reference. Preconditions of a valid configuration: `group > 0`,
//! `tail_max == 0 || tail_max >= tail`, positions below `u32::MAX`. Outside them nothing panics:
//! sums saturate (a saturated sum is larger than any position, which is what the reference's
//! comparisons mean), and a zero `group` seals nothing.

/// Group boundary at or below `pos`: `pos` itself inside the sink, else the start of its group.
///
/// Hybrid models should checkpoint recurrent state at such positions, because a truncation in the
/// body resumes exactly there. A zero `group` has no boundary past the sink, so the sink end.
pub fn group_floor(sink: u32, group: u32, pos: u32) -> u32 {
    if pos <= sink {
        return pos;
    }
    sink + whole_groups(pos - sink, group)
}

/// Staging-ring rows a sequence needs so that no unsealed row is ever overwritten:
/// `max(tail, tail_max) + group + 2*n_ubatch`, padded to 128.
///
/// The span before a ubatch is below `tail_max` (or `tail + group` right after a seal), and a
/// seal still reads the previous ubatch's rows while this one is stored, hence two ubatches.
/// Saturates at the largest multiple of 128 in `u32` for absurd inputs.
pub fn ring_capacity(tail: u32, tail_max: u32, group: u32, n_ubatch: u32) -> u32 {
    let need = u64::from(tail.max(tail_max)) + u64::from(group) + 2 * u64::from(n_ubatch);
    let padded = need.div_ceil(128) * 128;
    u32::try_from(padded).unwrap_or(u32::MAX - 127)
}

/// Ring slot of position `pos` (`pos >= sink`, `cap > 0`): the ring starts at the sink end.
///
/// Out of the preconditions it wraps like the reference (`pos < sink`) or returns 0 (`cap == 0`).
pub fn ring_slot(sink: u32, cap: u32, pos: u32) -> u32 {
    pos.wrapping_sub(sink).checked_rem(cap).unwrap_or(0)
}

/// `group * floor(span / group)`, and 0 for a zero group (no whole groups fit).
fn whole_groups(span: u32, group: u32) -> u32 {
    span.checked_div(group).map_or(0, |k| k * group)
}

/// Journal state of ONE sequence: the sealed end and the seal in flight.
///
/// Usage per ubatch: [`begin_ubatch`](Self::begin_ubatch) returns the seal target, the caller
/// seals `[b, b_pending)` in every layer, then [`commit`](Self::commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Leading positions kept exact.
    pub sink: u32,
    /// Exact positions kept behind the sealed end after a seal.
    pub tail: u32,
    /// Unsealed span that triggers a seal; 0 = fixed tail (seal at every ubatch).
    pub tail_max: u32,
    /// Positions per sealed group (`G`).
    pub group: u32,
    /// Groups a decode-sized ubatch may seal; 0 = no limit.
    pub flush_chunk: u32,
    /// Sealed end: positions `[sink, b)` are in the body.
    pub b: u32,
    /// `b` before the last commit.
    pub b_prev: u32,
    /// Seal target of the step in flight; equals `b` when nothing is pending.
    pub b_pending: u32,
    /// A chunked flush is unfinished: the next ubatch continues it.
    pub draining: bool,
}

impl Policy {
    /// An empty sequence (`b = sink`).
    pub fn new(sink: u32, tail: u32, tail_max: u32, group: u32, flush_chunk: u32) -> Self {
        let mut p = Policy {
            sink,
            tail,
            tail_max,
            group,
            flush_chunk,
            b: sink,
            b_prev: sink,
            b_pending: sink,
            draining: false,
        };
        p.reset();
        p
    }

    /// Forget every sealed group, keeping the configuration.
    pub fn reset(&mut self) {
        self.b = self.sink;
        self.b_prev = self.sink;
        self.b_pending = self.sink;
        self.draining = false;
    }

    /// Whether a seal was planned but not committed (saving and truncating must wait).
    pub fn is_pending(&self) -> bool {
        self.b_pending != self.b
    }

    /// Plan the seal before the ubatch `[pos0, pos0 + n_tokens)` is stored; returns `b_pending`.
    ///
    /// Deciding at the ubatch start means the seal reads only rows of earlier ubatches, and every
    /// query row keeps at least `tail` exact positions behind it.
    pub fn begin_ubatch(&mut self, pos0: u32, n_tokens: u32) -> u32 {
        self.b_pending = self.b;
        let due = self.tail_max == 0
            || self.draining
            || (pos0 > self.b && pos0 - self.b >= self.tail_max);
        self.draining = false;
        if due && pos0 > self.sink.saturating_add(self.tail) {
            let mut target = self.sink + whole_groups(pos0 - self.tail - self.sink, self.group);
            target = target.max(self.b);
            if self.tail_max > 0 && self.flush_chunk > 0 && n_tokens < self.group {
                // Decode latency: spread a large commit over several small ubatches.
                let limit = self
                    .b
                    .saturating_add(self.group.saturating_mul(self.flush_chunk));
                if target > limit {
                    target = limit;
                    self.draining = true;
                }
            }
            self.b_pending = target;
        }
        self.b_pending
    }

    /// Make the planned seal the sealed end (after the rows are sealed in every layer).
    pub fn commit(&mut self) {
        self.b_prev = self.b;
        self.b = self.b_pending;
    }

    /// Plan an idle seal with `end` stored positions; returns the target, or `b` if none.
    ///
    /// Never seals the last `max(keep_recent, tail)` positions, so a turn the client may re-render
    /// stays in the exact tail (pass `end - k` to protect everything from `k` on). If the margin
    /// stops short of the full target, a chunked drain stays pending for `begin_ubatch` to finish.
    /// Only acts with an adaptive tail.
    pub fn idle(&mut self, end: u32, keep_recent: u32) -> u32 {
        self.b_pending = self.b;
        if self.tail_max == 0 || end <= self.sink.saturating_add(self.tail) {
            return self.b;
        }
        let full = self.sink + whole_groups(end - self.tail - self.sink, self.group);
        let mut target = full;
        let mut clamped = false;
        if keep_recent > self.tail {
            let keep_from = end.saturating_sub(keep_recent);
            let lim = if keep_from <= self.sink {
                self.sink
            } else {
                group_floor(self.sink, self.group, keep_from)
            };
            if lim < full {
                target = lim;
                clamped = true;
            }
        }
        if !clamped {
            self.draining = false;
        }
        if target <= self.b {
            return self.b;
        }
        self.b_pending = target;
        target
    }

    /// Resume position of a cut at `pos`, changing nothing: `pos` in the ring or the sink (those
    /// rows are exact), else its group floor. Always `pos - r <= group - 1`.
    pub fn trunc_floor(&self, pos: u32) -> u32 {
        if pos >= self.b || pos <= self.sink {
            return pos;
        }
        group_floor(self.sink, self.group, pos)
    }

    /// Keep only positions below `pos`: returns `(resume, dropped_groups)`; the caller keeps
    /// `[0, resume)` and re-prefills from `resume`.
    ///
    /// A cut below `b` drops every sealed group from the resume point on (`b = max(sink, resume)`);
    /// the kept records are untouched. `None`, changing nothing, while a seal is pending, because
    /// the rows being sealed may be the ones cut away.
    pub fn truncate(&mut self, pos: u32) -> Option<(u32, u32)> {
        if self.is_pending() {
            return None;
        }
        let r = self.trunc_floor(pos);
        let mut dropped = 0;
        if r < self.b {
            let nb = r.max(self.sink);
            dropped = (self.b.saturating_sub(nb))
                .checked_div(self.group)
                .unwrap_or(0);
            self.b = nb;
            self.b_prev = nb;
            self.b_pending = nb;
            self.draining = false;
        }
        Some((r, dropped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SINK: u32 = 128;
    const G: u32 = 128;

    /// Grow with 1-token ubatches from `from` to `to` (positions stored: `[0, to)`).
    fn decode(p: &mut Policy, from: u32, to: u32) {
        for pos in from..to {
            p.begin_ubatch(pos, 1);
            p.commit();
        }
    }

    fn at(b: u32) -> Policy {
        let mut p = Policy::new(SINK, 256, 512, G, 0);
        p.b = b;
        p.b_prev = b;
        p.b_pending = b;
        p
    }

    #[test]
    fn decode_then_idle_with_margin() {
        let mut p = Policy::new(SINK, 256, 512, G, 0);
        decode(&mut p, 0, 1100);
        assert_eq!(p.b, 640);
        // keep the last turn (from 700) exact: the full target 768 would cut into it
        assert_eq!(p.idle(1100, 1100 - 700), 640);
        assert!(!p.is_pending());
        p.commit();
        assert_eq!(p.b, 640);
        assert_eq!(p.trunc_floor(700), 700);
        assert_eq!(p.idle(1100, 0), SINK + G * ((1100 - 256 - SINK) / G));
        assert_eq!(p.b_pending, 768);
        p.commit();
        assert_eq!((p.b, p.b_prev), (768, 640));
    }

    #[test]
    fn idle_cases() {
        // (B, end, keep_recent, want) with sink 128, G 128, tail 256, tail_max 512
        let cases = [
            (128, 1000, 0, 640),
            (128, 1000, 100, 640),
            (128, 1000, 256, 640),
            (128, 1000, 400, 512),
            (128, 1000, 872, 128),
            (128, 1000, 5000, 128),
            (640, 1000, 400, 640),
            (128, 300, 0, 128),
        ];
        for (b, end, keep, want) in cases {
            assert_eq!(at(b).idle(end, keep), want, "B {b} end {end} keep {keep}");
        }
        let mut fixed = Policy::new(SINK, 256, 0, G, 0);
        assert_eq!(fixed.idle(5000, 0), SINK);
    }

    #[test]
    fn clamped_idle_keeps_drain() {
        let mut p = Policy::new(SINK, 256, 512, G, 1);
        p.draining = true;
        p.idle(1000, 600);
        p.commit();
        assert!(
            p.draining,
            "a clamped idle step must leave the drain to begin_ubatch"
        );
        p.idle(1000, 0);
        p.commit();
        assert!(!p.draining);
        assert_eq!(p.b, 640);
    }

    #[test]
    fn flush_chunk_drains_over_decode_ubatches() {
        let mut p = Policy::new(SINK, 256, 512, G, 1);
        p.b = 128;
        // span 1000 - 128 >= 512: full target 640, but one group per decode ubatch
        assert_eq!(p.begin_ubatch(1000, 1), 256);
        assert!(p.draining);
        p.commit();
        assert_eq!(p.begin_ubatch(1001, 1), 384);
        p.commit();
        // a prefill-sized ubatch takes the rest at once
        assert_eq!(p.begin_ubatch(1002, G), 640);
        assert!(!p.draining);
    }

    #[test]
    fn truncate_table() {
        // B = 1024: 7 sealed groups past sink 128. (cut, resume, B after, dropped)
        let cases = [
            (2000, 2000, 1024, 0),
            (1024, 1024, 1024, 0),
            (1023, 896, 896, 1),
            (896, 896, 896, 1),
            (897, 896, 896, 1),
            (500, 384, 384, 5),
            (256, 256, 256, 6),
            (129, 128, 128, 7),
            (128, 128, 128, 7),
            (60, 60, 128, 7),
            (0, 0, 128, 7),
        ];
        for (cut, res, b, dropped) in cases {
            let mut p = at(1024);
            assert_eq!(p.truncate(cut), Some((res, dropped)), "cut {cut}");
            assert_eq!((p.b, p.b_prev, p.b_pending), (b, b, b), "cut {cut}");
        }
    }

    #[test]
    fn truncate_grown_sequence() {
        let mut grown = Policy::new(SINK, 256, 512, G, 0);
        let mut pos = 0;
        let mut step = 0u32;
        while pos < 1500 {
            let n = (1 + (step % 4)).min(1500 - pos);
            grown.begin_ubatch(pos, n);
            grown.commit();
            pos += n;
            step += 1;
        }
        let b0 = grown.b;
        assert!(b0 > SINK + 3 * G);
        let cuts = [
            1550,
            1499,
            b0 + 7,
            b0,
            b0 - 1,
            b0 - G,
            b0 - G - 5,
            SINK + G + 1,
            SINK + 1,
            SINK,
            SINK - 10,
            0,
        ];
        for cut in cuts {
            let mut p = grown;
            let (r, dropped) = p.truncate(cut).expect("nothing pending");
            let in_body = cut < b0 && cut > SINK;
            let want_r = if in_body {
                group_floor(SINK, G, cut)
            } else {
                cut
            };
            assert_eq!(r, want_r, "cut {cut}");
            assert!(r <= cut && cut - r < G, "cut {cut}");
            let want_b = if cut >= b0 { b0 } else { want_r.max(SINK) };
            assert_eq!(p.b, want_b, "cut {cut}");
            assert_eq!(dropped, (b0 - want_b) / G, "cut {cut}");
        }
    }

    #[test]
    fn truncate_refused_while_pending() {
        let mut p = Policy::new(SINK, 256, 512, G, 0);
        p.begin_ubatch(2000, 1);
        assert!(p.is_pending());
        let before = p;
        assert_eq!(p.truncate(300), None);
        assert_eq!(p, before);
    }

    #[test]
    fn floors_and_ring() {
        assert_eq!(group_floor(128, 128, 100), 100);
        assert_eq!(group_floor(128, 128, 383), 256);
        assert_eq!(group_floor(128, 128, 384), 384);
        assert_eq!(ring_capacity(4096, 8192, 128, 512), 9344);
        assert_eq!(ring_capacity(256, 0, 128, 1), 512);
        assert_eq!(ring_slot(128, 512, 128), 0);
        assert_eq!(ring_slot(128, 512, 128 + 513), 1);
    }

    #[test]
    fn hostile_inputs_do_not_panic() {
        let mut z = Policy::new(u32::MAX, u32::MAX, u32::MAX, 0, u32::MAX);
        z.begin_ubatch(u32::MAX, 0);
        z.commit();
        z.idle(u32::MAX, u32::MAX);
        z.commit();
        let _ = z.truncate(5);
        let mut g0 = Policy::new(0, 0, 0, 0, 3);
        assert_eq!(g0.begin_ubatch(1000, 1), 0);
        g0.commit();
        assert_eq!(g0.idle(1000, 0), 0);
        assert_eq!(group_floor(5, 0, 100), 5);
        let mut bad = Policy::new(128, 256, 512, 128, 0);
        bad.b = 0; // below the sink: invalid, but must not underflow
        let _ = bad.truncate(0);
        assert_eq!(
            ring_capacity(u32::MAX, u32::MAX, u32::MAX, u32::MAX) % 128,
            0
        );
        assert_eq!(ring_slot(10, 0, 5), 0);
        assert_eq!(ring_slot(10, 7, 5), 5u32.wrapping_sub(10) % 7);
    }

    /// The per-ubatch rule restated plainly, in u64, stepping one group at a time.
    fn restated(
        b: u32,
        draining: bool,
        pos0: u32,
        n: u32,
        (tail, tail_max, chunk): (u32, u32, u32),
    ) -> (u32, bool) {
        let (b, pos0, tail, g) = (u64::from(b), u64::from(pos0), u64::from(tail), u64::from(G));
        let span = pos0.saturating_sub(b);
        if !(tail_max == 0 || draining || span >= u64::from(tail_max)) {
            return (b as u32, false);
        }
        // largest boundary at or above b that keeps `tail` positions exact before pos0
        let mut target = b;
        while target + g + tail <= pos0 {
            target += g;
        }
        let mut drain = false;
        if tail_max > 0 && chunk > 0 && u64::from(n) < g && target > b + g * u64::from(chunk) {
            target = b + g * u64::from(chunk);
            drain = true;
        }
        (target as u32, drain)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn default_schedule_matches_restatement(
            sizes in prop::collection::vec(1u32..=512, 1..250),
            chunk in 0u32..3,
        ) {
            let cfg = (4096, 8192, chunk);
            let n_ubatch = 512;
            let cap = ring_capacity(cfg.0, cfg.1, G, n_ubatch);
            let mut p = Policy::new(SINK, cfg.0, cfg.1, G, chunk);
            let (mut rb, mut rdrain) = (SINK, false);
            let mut pos0 = 0u32;
            for n in sizes {
                let b_old = p.b;
                let pending = p.begin_ubatch(pos0, n);
                (rb, rdrain) = restated(rb, rdrain, pos0, n, cfg);
                prop_assert_eq!(pending, rb);
                prop_assert_eq!(p.draining, rdrain);
                if pending > b_old {
                    prop_assert!(pos0 - pending >= cfg.0, "seal cut into the tail");
                }
                p.commit();
                prop_assert_eq!((p.b - SINK) % G, 0);
                prop_assert!(pos0 - p.b.min(pos0) <= cap - n_ubatch, "span {} before storing", pos0 - p.b);
                // the rows being sealed and the ubatch being stored fit the ring together
                prop_assert!(pos0 + n <= b_old + cap, "ring overflow");
                pos0 += n;
            }
        }

        #[test]
        fn truncation_and_idle_keep_invariants(
            ops in prop::collection::vec((1u32..=512, 0u32..64, 0u32..1500, 0u32..12000), 1..200),
        ) {
            let mut p = Policy::new(SINK, 256, 512, G, 1);
            let mut pos = 0u32;
            for (n, dice, back, keep) in ops {
                p.begin_ubatch(pos, n);
                p.commit();
                pos += n;
                if dice == 0 {
                    let t = p.idle(pos, keep);
                    if t > p.b {
                        prop_assert!(pos - t >= keep.max(256));
                        prop_assert_eq!((t - SINK) % G, 0);
                    }
                    p.commit();
                } else if dice == 1 {
                    let cut = pos - back.min(pos);
                    let b_before = p.b;
                    let floor = p.trunc_floor(cut);
                    let (r, dropped) = p.truncate(cut).expect("committed");
                    prop_assert_eq!(r, floor);
                    prop_assert!(r <= cut && cut - r < G);
                    if cut >= b_before || cut <= SINK {
                        prop_assert_eq!(r, cut);
                    }
                    prop_assert_eq!(dropped, (b_before - p.b) / G);
                    prop_assert!(!p.draining || cut >= b_before);
                    pos = r;
                }
                prop_assert!(p.b >= SINK && (p.b - SINK).is_multiple_of(G));
            }
        }
    }
}
