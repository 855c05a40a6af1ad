//! The `SJKVSEQ` version-1 stream: one sequence saved byte-exactly as the SJ-KVaRN reference
//! writes it, so states move between this crate, the C reference and the CUDA sequences.
//!
//! Layout (little-endian): a 128-byte header (see [`StateHeader`] and the offsets below), then per
//! layer in order the sink rows of positions `[0, min(sink, n))` as `[pos][head]`, the sealed
//! records of groups `[0, (B - sink)/G)` as `[group][head]`, the tail rows of positions `[B, n)`
//! as `[pos][head]`, and last the FNV-1a 64 of every byte before it. A sink row is `K | V`: fp16
//! (`2*D` bytes each) for an fp16 sink, staging rows for an inherited sink; a tail row is two
//! staging rows. The ring offset, `n_ubatch` and `n_ctx` are not stored, so a state restores into
//! a cache with a different ring or context as long as it fits.
//!
//! This module owns the framing only: the cache serves and receives the row and record bytes
//! ([`StateSource`], [`walk_payload`]) from wherever it keeps them.

use super::policy::Policy;

/// First 8 bytes of every stream.
pub const STATE_MAGIC: [u8; 8] = *b"SJKVSEQ\0";
/// Layout version of the stream.
pub const STATE_VERSION: u32 = 1;
/// Version of the record and staging byte formats the payload holds.
pub const FORMAT_VERSION: u32 = 1;
/// Fixed header length (the rest after the last field is zero).
pub const STATE_HEADER_BYTES: usize = 128;
/// Trailing checksum length.
pub const CHECKSUM_BYTES: usize = 8;
/// Rotation id: orthonormal Sylvester-Hadamard per head, size `head_dim`.
pub const ROTATION_HADAMARD: u32 = 1;

/// `sink_type`: a separate fp16 sink.
pub const SINK_F16: u32 = 0;
/// `sink_type`: sink rows in the staging type.
pub const SINK_INHERIT: u32 = 1;
/// `body` (resolved): round-to-nearest codes.
pub const BODY_SCALAR: u32 = 0;
/// `body` (resolved): trellis-coded codes.
pub const BODY_TRELLIS: u32 = 1;
/// `staging`: tq6_0 rows.
pub const STAGING_TQ6_0: u32 = 0;
/// `staging`: exact fp16 rows.
pub const STAGING_F16: u32 = 1;
/// `staging`: `q8_0` rows (sjkvarn extension; the reference refuses it by name).
pub const STAGING_Q8_0: u32 = 2;

/// Offset basis of the reference (see [`fnv1a64`]).
const FNV_OFFSET: u64 = 1_469_598_103_934_665_603;
const FNV_PRIME: u64 = 1_099_511_628_211;

// header field offsets
const OFF_STATE_VERSION: usize = 8;
const OFF_FORMAT_VERSION: usize = 12;
const OFF_HEADER_BYTES: usize = 16;
const OFF_HEAD_DIM: usize = 20;
const OFF_N_HEAD_KV: usize = 24;
const OFF_GROUP: usize = 28;
const OFF_SINK: usize = 32;
const OFF_SINK_TYPE: usize = 36;
const OFF_BITS_K: usize = 40;
const OFF_BITS_V: usize = 44;
const OFF_BODY: usize = 48;
const OFF_ITERS: usize = 52;
const OFF_STAGING: usize = 56;
const OFF_TAIL: usize = 60;
const OFF_TAIL_MAX: usize = 64;
const OFF_FLUSH_CHUNK: usize = 68;
const OFF_ROTATION: usize = 72;
const OFF_ROTATION_N: usize = 76;
const OFF_CODEBOOK: usize = 80;
const OFF_N_LAYERS: usize = 88;
const OFF_N: usize = 92;
const OFF_B: usize = 96;
const OFF_B_PREV: usize = 100;
const OFF_DRAINING: usize = 104;
const OFF_PAYLOAD: usize = 108;

/// Why a stream cannot be saved or restored: one variant per reference status code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("state stream is shorter than it says (cut off in transfer or storage); re-save the sequence")]
    Truncated,
    #[error(
        "not an SJ-KVaRN sequence state (bad magic); pass a stream written by the SJKVSEQ writer"
    )]
    Magic,
    #[error("state layout version {0} is not supported (this build reads {v}); re-save the sequence with this build", v = STATE_VERSION)]
    Version(u32),
    #[error("state holds record/staging byte format {0}, this build uses {v}; re-prefill the prompt instead of restoring", v = FORMAT_VERSION)]
    Format(u32),
    #[error("state checksum or consistency check failed ({0}); discard the stream and re-prefill")]
    Corrupt(&'static str),
    #[error("a seal is pending (begin_ubatch or idle without commit); seal and commit before saving or truncating")]
    Pending,
    #[error(
        "state does not fit this cache ({0}); restore into a cache with a larger context or ring"
    )]
    Capacity(&'static str),
    #[error("the record pool has no free block for the restore; free other sequences or enlarge the pool")]
    PoolFull,
    #[error("config mismatch: head_dim {state} in the state, {cache} here; restore into a cache with the saved config")]
    HeadDim { state: u32, cache: u32 },
    #[error("config mismatch: n_head_kv {state} in the state, {cache} here; restore into a cache with the saved config")]
    NHeadKv { state: u32, cache: u32 },
    #[error("config mismatch: group {state} in the state, {cache} here; restore into a cache with the saved config")]
    Group { state: u32, cache: u32 },
    #[error("config mismatch: (sink, sink_type) {state:?} in the state, {cache:?} here; restore into a cache with the saved sink")]
    Sink {
        state: (u32, u32),
        cache: (u32, u32),
    },
    #[error("config mismatch: (bits_k, bits_v) {state:?} in the state, {cache:?} here; restore into a cache with the saved bit widths")]
    Bits {
        state: (u32, u32),
        cache: (u32, u32),
    },
    #[error("config mismatch: body {state} in the state, {cache} here (0 scalar, 1 trellis); restore into a cache with the saved body")]
    Body { state: u32, cache: u32 },
    #[error("config mismatch: {state} balancing iterations in the state, {cache} here; restore into a cache with the saved config")]
    Iters { state: u32, cache: u32 },
    #[error("config mismatch: staging {state} in the state, {cache} here (0 tq6_0, 1 f16, 2 q8_0); restore into a cache with the saved staging")]
    Staging { state: u32, cache: u32 },
    #[error("config mismatch: (tail, tail_max, flush_chunk) {state:?} in the state, {cache:?} here; restore into a cache with the saved tail policy")]
    Tail {
        state: (u32, u32, u32),
        cache: (u32, u32, u32),
    },
    #[error("config mismatch: rotation (id, size) {state:?} in the state, {cache:?} here; the state was rotated differently and cannot be restored")]
    Rotation {
        state: (u32, u32),
        cache: (u32, u32),
    },
    #[error("config mismatch: trellis codebook {state:#018x} in the state, {cache:#018x} here; restore with the codebooks the state was sealed with")]
    Codebook { state: u64, cache: u64 },
    #[error("config mismatch: {state} layers in the state, {cache} here; restore into a model with the same layer count")]
    NLayers { state: u32, cache: u32 },
    #[error("destination holds {have} bytes, the state needs {need}; size it with StateHeader::stream_bytes")]
    Buffer { need: usize, have: usize },
}

/// FNV-1a 64 as the reference computes it: cheap, enough to catch corruption (not tampering).
///
/// The reference's offset basis is `1469598103934665603` (`0x14650fb0739d0383`), one decimal
/// digit short of the textbook `14695981039346656037`; streams only verify with the same value,
/// so this is NOT interchangeable with `cache::snapshot::fnv1a64`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv_continue(FNV_OFFSET, bytes)
}

fn fnv_continue(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME))
}

/// Identity of the trellis codebooks a body decodes with: FNV-1a 64 over the little-endian fp16
/// K table, continued over the V table; 0 for a scalar body (it has no codebook).
///
/// A state sealed with other codebooks would decode to garbage, so restores compare this id.
pub fn codebook_id(body: u32, k_table: &[u16], v_table: &[u16]) -> u64 {
    if body != BODY_TRELLIS {
        return 0;
    }
    k_table
        .iter()
        .chain(v_table)
        .fold(FNV_OFFSET, |h, v| fnv_continue(h, &v.to_le_bytes()))
}

/// Everything that must match between a state and the cache restoring it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateIdentity {
    pub head_dim: u32,
    pub n_head_kv: u32,
    pub group: u32,
    pub sink: u32,
    /// [`SINK_F16`] or [`SINK_INHERIT`].
    pub sink_type: u32,
    pub bits_k: u32,
    pub bits_v: u32,
    /// Resolved body: [`BODY_SCALAR`] or [`BODY_TRELLIS`].
    pub body: u32,
    pub iters: u32,
    /// [`STAGING_TQ6_0`] or [`STAGING_F16`].
    pub staging: u32,
    pub tail: u32,
    pub tail_max: u32,
    pub flush_chunk: u32,
    /// See [`codebook_id`].
    pub codebook_id: u64,
    pub n_layers: u32,
    /// Rotation id: [`ROTATION_HADAMARD`], or an extension id of a cache that transforms keys
    /// further (the size stored beside it is always `head_dim`).
    pub rotation: u32,
}

/// The header of one state: identity plus the sequence's stored end and journal state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateHeader {
    pub identity: StateIdentity,
    /// Stored end: positions `[0, n)` are held in every layer.
    pub n: u32,
    /// Sealed end.
    pub b: u32,
    /// Sealed end before the last commit.
    pub b_prev: u32,
    /// 1 while a chunked flush is draining, else 0 (anything else is corrupt).
    pub draining: u32,
}

/// One piece of the payload, named by where it belongs in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateItem {
    /// Sink row `K | V` of `(layer, pos, head)`.
    SinkRow { layer: u32, pos: u32, head: u32 },
    /// Sealed record of `(layer, group, head)`; `group` counts from the sink end.
    Record { layer: u32, group: u32, head: u32 },
    /// Tail row `K | V` (two staging rows) of `(layer, pos, head)`.
    TailRow { layer: u32, pos: u32, head: u32 },
}

/// Serves the payload bytes to [`write_state`]; each call fills `dst`, which has exactly the
/// length of one item, so the cache can copy from host memory or download from a device.
pub trait StateSource {
    fn fill(&mut self, item: StateItem, dst: &mut [u8]);
}

impl<F: FnMut(StateItem, &mut [u8])> StateSource for F {
    fn fill(&mut self, item: StateItem, dst: &mut [u8]) {
        self(item, dst)
    }
}

/// A parsed, checksum-verified header (from [`peek`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateInfo {
    pub state_version: u32,
    pub format_version: u32,
    pub header: StateHeader,
    /// Rotation id and size as stored.
    pub rotation: u32,
    pub rotation_n: u32,
    /// Header + payload + checksum; bytes after it are ignored.
    pub total_bytes: usize,
}

/// Row and record sizes of one layer's payload items.
#[derive(Debug, Clone, Copy)]
struct ItemBytes {
    sink_row: u64,
    record: u64,
    tail_row: u64,
}

impl StateHeader {
    /// Header of a sequence with `n` stored positions whose journal is `policy`.
    ///
    /// `Pending` while a seal is in flight: its rows are neither staged-only nor sealed yet.
    pub fn from_policy(
        identity: StateIdentity,
        policy: &Policy,
        n: u32,
    ) -> Result<Self, StateError> {
        if policy.is_pending() {
            return Err(StateError::Pending);
        }
        Ok(StateHeader {
            identity,
            n,
            b: policy.b,
            b_prev: policy.b_prev,
            draining: u32::from(policy.draining),
        })
    }

    fn item_bytes(&self, record_bytes: usize, tail_row_bytes: usize) -> ItemBytes {
        let stage2 = tail_row_bytes as u64;
        let sink_row = if self.identity.sink_type == SINK_F16 {
            4 * u64::from(self.identity.head_dim)
        } else {
            stage2
        };
        ItemBytes {
            sink_row,
            record: record_bytes as u64,
            tail_row: stage2,
        }
    }

    /// Sealed groups per layer, `None` when `b` is below the sink or the group is zero.
    fn n_records(&self) -> Option<u32> {
        let id = &self.identity;
        self.b.checked_sub(id.sink)?.checked_div(id.group)
    }

    /// Bytes of ONE layer's payload. `record_bytes`: one sealed record; `tail_row_bytes`: one
    /// tail row of one head, its K row and its V row (the two may be staged differently). `None` if `b < sink`, `group == 0` or it overflows.
    pub fn payload_bytes(&self, record_bytes: usize, tail_row_bytes: usize) -> Option<u64> {
        let sizes = self.item_bytes(record_bytes, tail_row_bytes);
        let h = u64::from(self.identity.n_head_kv);
        let n_sink = u64::from(self.n.min(self.identity.sink));
        let n_rec = u64::from(self.n_records()?);
        let n_tail = u64::from(self.n.saturating_sub(self.b));
        let sink = n_sink.checked_mul(h)?.checked_mul(sizes.sink_row)?;
        let rec = n_rec.checked_mul(h)?.checked_mul(sizes.record)?;
        let tail = n_tail.checked_mul(h)?.checked_mul(sizes.tail_row)?;
        sink.checked_add(rec)?.checked_add(tail)
    }

    /// Bytes of the whole stream (header, every layer, checksum); `None` as for
    /// [`payload_bytes`](Self::payload_bytes) or if it does not fit `usize`.
    pub fn stream_bytes(&self, record_bytes: usize, tail_row_bytes: usize) -> Option<usize> {
        let all = self
            .payload_bytes(record_bytes, tail_row_bytes)?
            .checked_mul(u64::from(self.identity.n_layers))?
            .checked_add((STATE_HEADER_BYTES + CHECKSUM_BYTES) as u64)?;
        usize::try_from(all).ok()
    }

    /// The reference's consistency rules for the journal state.
    fn check_consistency(&self) -> Result<(), StateError> {
        let (s, g) = (self.identity.sink, self.identity.group);
        let on_boundary = |x: u32| x >= s && (x - s).checked_rem(g) == Some(0);
        if !on_boundary(self.b) {
            return Err(StateError::Corrupt("sealed end off a group boundary"));
        }
        if !on_boundary(self.b_prev) || self.b_prev > self.b {
            return Err(StateError::Corrupt(
                "previous sealed end off a group boundary or past B",
            ));
        }
        if self.draining > 1 {
            return Err(StateError::Corrupt("draining flag is not 0 or 1"));
        }
        if self.b > s && self.b > self.n {
            return Err(StateError::Corrupt("sealed end past the stored end"));
        }
        Ok(())
    }

    /// The layer-major item sequence of the payload, in stream order.
    fn items(&self) -> impl Iterator<Item = StateItem> + '_ {
        let id = self.identity;
        let heads = move || 0..id.n_head_kv;
        let n_rec = self.n_records().unwrap_or(0);
        let (n, b) = (self.n, self.b);
        (0..id.n_layers).flat_map(move |layer| {
            let sink = (0..n.min(id.sink)).flat_map(move |pos| {
                heads().map(move |head| StateItem::SinkRow { layer, pos, head })
            });
            let recs = (0..n_rec).flat_map(move |group| {
                heads().map(move |head| StateItem::Record { layer, group, head })
            });
            let tail = (b..n.max(b)).flat_map(move |pos| {
                heads().map(move |head| StateItem::TailRow { layer, pos, head })
            });
            sink.chain(recs).chain(tail)
        })
    }
}

fn put32(o: &mut [u8], at: usize, v: u32) {
    o[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(o: &mut [u8], at: usize, v: u64) {
    o[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Little-endian u32 at `at`; callers have checked the length, 0 otherwise.
fn get32(p: &[u8], at: usize) -> u32 {
    p.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

fn get64(p: &[u8], at: usize) -> u64 {
    p.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn size_of_stream(
    header: &StateHeader,
    record_bytes: usize,
    tail_row_bytes: usize,
) -> Result<(usize, u64), StateError> {
    header.check_consistency()?;
    let layer = header
        .payload_bytes(record_bytes, tail_row_bytes)
        .ok_or(StateError::Capacity("payload size overflows"))?;
    let total = header
        .stream_bytes(record_bytes, tail_row_bytes)
        .ok_or(StateError::Capacity("stream size overflows"))?;
    Ok((total, layer * u64::from(header.identity.n_layers)))
}

/// Write the stream into `dst`; returns the bytes written ([`StateHeader::stream_bytes`]).
///
/// The header is checked with the restore's consistency rules first, so a written stream is
/// always one a matching cache accepts. `Buffer` if `dst` is too small.
pub fn write_state(
    header: &StateHeader,
    record_bytes: usize,
    tail_row_bytes: usize,
    source: &mut impl StateSource,
    dst: &mut [u8],
) -> Result<usize, StateError> {
    let (total, payload) = size_of_stream(header, record_bytes, tail_row_bytes)?;
    let have = dst.len();
    let out = dst
        .get_mut(..total)
        .ok_or(StateError::Buffer { need: total, have })?;
    let id = &header.identity;
    out[..STATE_HEADER_BYTES].fill(0);
    out[..8].copy_from_slice(&STATE_MAGIC);
    put32(out, OFF_STATE_VERSION, STATE_VERSION);
    put32(out, OFF_FORMAT_VERSION, FORMAT_VERSION);
    put32(out, OFF_HEADER_BYTES, STATE_HEADER_BYTES as u32);
    put32(out, OFF_HEAD_DIM, id.head_dim);
    put32(out, OFF_N_HEAD_KV, id.n_head_kv);
    put32(out, OFF_GROUP, id.group);
    put32(out, OFF_SINK, id.sink);
    put32(out, OFF_SINK_TYPE, id.sink_type);
    put32(out, OFF_BITS_K, id.bits_k);
    put32(out, OFF_BITS_V, id.bits_v);
    put32(out, OFF_BODY, id.body);
    put32(out, OFF_ITERS, id.iters);
    put32(out, OFF_STAGING, id.staging);
    put32(out, OFF_TAIL, id.tail);
    put32(out, OFF_TAIL_MAX, id.tail_max);
    put32(out, OFF_FLUSH_CHUNK, id.flush_chunk);
    put32(out, OFF_ROTATION, id.rotation);
    put32(out, OFF_ROTATION_N, id.head_dim);
    put64(out, OFF_CODEBOOK, id.codebook_id);
    put32(out, OFF_N_LAYERS, id.n_layers);
    put32(out, OFF_N, header.n);
    put32(out, OFF_B, header.b);
    put32(out, OFF_B_PREV, header.b_prev);
    put32(out, OFF_DRAINING, header.draining);
    put64(out, OFF_PAYLOAD, payload);

    let sizes = header.item_bytes(record_bytes, tail_row_bytes);
    let mut at = STATE_HEADER_BYTES;
    for item in header.items() {
        // sizes fit usize: their sum (the stream) does
        let len = match item {
            StateItem::SinkRow { .. } => sizes.sink_row,
            StateItem::Record { .. } => sizes.record,
            StateItem::TailRow { .. } => sizes.tail_row,
        } as usize;
        source.fill(item, &mut out[at..at + len]);
        at += len;
    }
    let sum = fnv1a64(&out[..at]);
    put64(out, at, sum);
    Ok(total)
}

/// [`write_state`] into a new vector of exactly the stream's size.
pub fn write_state_vec(
    header: &StateHeader,
    record_bytes: usize,
    tail_row_bytes: usize,
    source: &mut impl StateSource,
) -> Result<Vec<u8>, StateError> {
    let (total, _) = size_of_stream(header, record_bytes, tail_row_bytes)?;
    let mut out = vec![0u8; total];
    write_state(header, record_bytes, tail_row_bytes, source, &mut out)?;
    Ok(out)
}

/// Parse and verify a stream without a cache: magic, versions, length and checksum, in the
/// reference's order (so each damage reports the same code there and here).
pub fn peek(bytes: &[u8]) -> Result<StateInfo, StateError> {
    let size = bytes.len();
    match bytes.get(..8) {
        None => return Err(StateError::Truncated),
        Some(m) if m != STATE_MAGIC => return Err(StateError::Magic),
        Some(_) => {}
    }
    if size < 16 {
        return Err(StateError::Truncated);
    }
    let state_version = get32(bytes, OFF_STATE_VERSION);
    let format_version = get32(bytes, OFF_FORMAT_VERSION);
    if state_version != STATE_VERSION {
        return Err(StateError::Version(state_version));
    }
    if size < STATE_HEADER_BYTES + CHECKSUM_BYTES {
        return Err(StateError::Truncated);
    }
    if get32(bytes, OFF_HEADER_BYTES) != STATE_HEADER_BYTES as u32 {
        return Err(StateError::Corrupt("header length"));
    }
    let payload = get64(bytes, OFF_PAYLOAD);
    let room = size - STATE_HEADER_BYTES - CHECKSUM_BYTES;
    let payload = usize::try_from(payload)
        .ok()
        .filter(|&p| p <= room)
        .ok_or(StateError::Truncated)?;
    let total_bytes = STATE_HEADER_BYTES + payload + CHECKSUM_BYTES;
    let body_end = total_bytes - CHECKSUM_BYTES;
    if fnv1a64(&bytes[..body_end]) != get64(bytes, body_end) {
        return Err(StateError::Corrupt("checksum"));
    }
    if format_version != FORMAT_VERSION {
        return Err(StateError::Format(format_version));
    }
    let g = |at| get32(bytes, at);
    let identity = StateIdentity {
        head_dim: g(OFF_HEAD_DIM),
        n_head_kv: g(OFF_N_HEAD_KV),
        group: g(OFF_GROUP),
        sink: g(OFF_SINK),
        sink_type: g(OFF_SINK_TYPE),
        bits_k: g(OFF_BITS_K),
        bits_v: g(OFF_BITS_V),
        body: g(OFF_BODY),
        iters: g(OFF_ITERS),
        staging: g(OFF_STAGING),
        tail: g(OFF_TAIL),
        tail_max: g(OFF_TAIL_MAX),
        flush_chunk: g(OFF_FLUSH_CHUNK),
        codebook_id: get64(bytes, OFF_CODEBOOK),
        n_layers: g(OFF_N_LAYERS),
        rotation: g(OFF_ROTATION),
    };
    Ok(StateInfo {
        state_version,
        format_version,
        header: StateHeader {
            identity,
            n: g(OFF_N),
            b: g(OFF_B),
            b_prev: g(OFF_B_PREV),
            draining: g(OFF_DRAINING),
        },
        rotation: g(OFF_ROTATION),
        rotation_n: g(OFF_ROTATION_N),
        total_bytes,
    })
}

/// Accept a peeked state for a cache whose identity is `expected`: the reference's mismatch
/// order (first differing field wins), then the journal consistency rules and the exact length.
///
/// `record_bytes` and `tail_row_bytes` are the cache's sizes (see
/// [`StateHeader::payload_bytes`]). `expected.codebook_id` comes from [`codebook_id`].
pub fn check_identity(
    info: &StateInfo,
    expected: &StateIdentity,
    record_bytes: usize,
    tail_row_bytes: usize,
) -> Result<(), StateError> {
    use StateError as E;
    let (s, c) = (&info.header.identity, expected);
    if s.head_dim != c.head_dim {
        return Err(E::HeadDim {
            state: s.head_dim,
            cache: c.head_dim,
        });
    }
    if s.n_head_kv != c.n_head_kv {
        return Err(E::NHeadKv {
            state: s.n_head_kv,
            cache: c.n_head_kv,
        });
    }
    if s.group != c.group {
        return Err(E::Group {
            state: s.group,
            cache: c.group,
        });
    }
    if (s.sink, s.sink_type) != (c.sink, c.sink_type) {
        return Err(E::Sink {
            state: (s.sink, s.sink_type),
            cache: (c.sink, c.sink_type),
        });
    }
    if (s.bits_k, s.bits_v) != (c.bits_k, c.bits_v) {
        return Err(E::Bits {
            state: (s.bits_k, s.bits_v),
            cache: (c.bits_k, c.bits_v),
        });
    }
    if s.body != c.body {
        return Err(E::Body {
            state: s.body,
            cache: c.body,
        });
    }
    if s.iters != c.iters {
        return Err(E::Iters {
            state: s.iters,
            cache: c.iters,
        });
    }
    if s.staging != c.staging {
        return Err(E::Staging {
            state: s.staging,
            cache: c.staging,
        });
    }
    let (st, ct) = (
        (s.tail, s.tail_max, s.flush_chunk),
        (c.tail, c.tail_max, c.flush_chunk),
    );
    if st != ct {
        return Err(E::Tail {
            state: st,
            cache: ct,
        });
    }
    let rot = (info.rotation, info.rotation_n);
    if rot != (c.rotation, c.head_dim) {
        return Err(E::Rotation {
            state: rot,
            cache: (c.rotation, c.head_dim),
        });
    }
    if s.codebook_id != c.codebook_id {
        return Err(E::Codebook {
            state: s.codebook_id,
            cache: c.codebook_id,
        });
    }
    if s.n_layers != c.n_layers {
        return Err(E::NLayers {
            state: s.n_layers,
            cache: c.n_layers,
        });
    }
    info.header.check_consistency()?;
    if info.header.stream_bytes(record_bytes, tail_row_bytes) != Some(info.total_bytes) {
        return Err(E::Corrupt(
            "stored end and sealed end do not match the payload length",
        ));
    }
    Ok(())
}

impl StateInfo {
    /// Whether the state fits a cache of `n_ctx` positions, `n_groups` record slots per layer and
    /// a ring of `ring_cap` rows (the reference's capacity check, after [`check_identity`]).
    pub fn check_capacity(
        &self,
        n_ctx: u32,
        n_groups: u32,
        ring_cap: u32,
    ) -> Result<(), StateError> {
        let h = &self.header;
        if h.n > n_ctx {
            return Err(StateError::Capacity("stored end past the context"));
        }
        if h.n_records().unwrap_or(u32::MAX) > n_groups {
            return Err(StateError::Capacity("more sealed groups than record slots"));
        }
        if h.n > h.b && h.n - h.b > ring_cap {
            return Err(StateError::Capacity("tail longer than the staging ring"));
        }
        Ok(())
    }
}

/// Hand every payload item of an accepted stream to `sink`, in stream order.
///
/// Call after [`peek`] and [`check_identity`] on the same bytes; a length that does not match
/// the header is reported as `Corrupt` (never a panic), before any item is handed out.
pub fn walk_payload(
    bytes: &[u8],
    info: &StateInfo,
    record_bytes: usize,
    tail_row_bytes: usize,
    mut sink: impl FnMut(StateItem, &[u8]),
) -> Result<(), StateError> {
    let h = &info.header;
    let (total, _) = size_of_stream(h, record_bytes, tail_row_bytes)?;
    if total != info.total_bytes || bytes.len() < total {
        return Err(StateError::Corrupt(
            "payload length differs from the header",
        ));
    }
    let sizes = h.item_bytes(record_bytes, tail_row_bytes);
    let mut at = STATE_HEADER_BYTES;
    for item in h.items() {
        let len = match item {
            StateItem::SinkRow { .. } => sizes.sink_row,
            StateItem::Record { .. } => sizes.record,
            StateItem::TailRow { .. } => sizes.tail_row,
        } as usize;
        sink(item, &bytes[at..at + len]);
        at += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
