//! Saving and restoring one sequence.
//!
//! The sequence state is the reference's `SJKVSEQ` version-1 stream ([`crate::journal`]):
//! a 128-byte identity header (geometry, bits, body, staging, tails, rotation, codebook id, the
//! journal state), then per layer the sink rows, the sealed records and the tail rows, then an
//! FNV-1a checksum. [`Sequence::state_bytes`] writes it and [`Sequence::from_state`] reads it;
//! for a reference configuration ([`CacheConfig::is_reference`]) the reference codec loads the
//! same bytes and the other way round. Extension configurations write the same layout with
//! extension codes in the header (body 224, staging 2 for `q8_0`), which the reference refuses
//! by name.
//!
//! A snapshot file wraps the stream with everything else sjkvarn's configuration holds (query
//! heads, per-layer codings, balancing, sink, `max_tokens`), so a load restores the
//! full configuration; it holds one single-layer stream per layer, so layers caught between
//! appends, and tiered layers with different record sizes, save too. Layout (little-endian):
//! `b"SJKVSNAP"`, `version: u32` ([`VERSION`]; 2 and later are read too), `payload_len: u64`, payload = configuration block then per
//! layer `len: u64` and its `SJKVSEQ` stream, `fnv1a64(everything before): u64`. Version-1 files (written before the reference format) are refused with what to do.
//! Files are replaced through `atomic_file` (a private temporary, fsync, rename,
//! directory fsync), so an interrupted save never replaces a good file.

use crate::backend::pool::{RecordPool, SlotId};
use crate::backend::Sequence;
use crate::codec::extension::body::GROUP;
use crate::codec::{trellis::codebook, Body, BodyCodec};
use crate::error::{CacheError, CacheResult};
use crate::journal::RingRows;
use crate::journal::StagingPick;
use crate::journal::{self, StateHeader, StateIdentity, StateItem};
use crate::journal::{CacheConfig, SinkType, Staging};
use half::f16;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

mod config_block;

use config_block::{corrupt, read_config, write_config, Reader, Writer};

/// The name ending of a save's temporary file (`.NAME.<pid>-<n>-<t>` plus this, beside the
/// target): one a killed process left is removed by the next save to the same path.
pub use crate::atomic_file::TEMP_SUFFIX;

const MAGIC: &[u8; 8] = b"SJKVSNAP";
/// Format version; bumped on any layout change (2: the configuration plus an `SJKVSEQ` stream;
/// 3: a flags byte after the sink, bit 0 = centred keys; 4: `exact_recent: u32` after the
/// flags; 5: staging bytes in [`Staging::code`]'s one numbering, `tq6_0` 0, `f16` 1, `q8_0` 2).
/// Version-2 to -4 files still load.
pub const VERSION: u32 = 5;
/// Magic of the exact-window section that follows the `SJKVSEQ` stream of a cache with
/// `exact_recent > 0` (extension, version 1): `exact_recent: u32`, then per layer of the
/// stream `first: u64`, `rows: u64`, the K copies and the V copies (`[rows][kv_heads][d]`
/// fp16), then `fnv1a64` of the section before it.
pub const WINDOW_MAGIC: &[u8; 8] = b"SJKVWIN1";

/// Header body code of extension records (not a reference body).
pub const BODY_EXTENSION: u32 = 224;
/// Header rotation id of a cache whose keys after the sink are stored minus the sink's mean key
/// (extension; see [`CacheConfig::centre_keys`]): Hadamard rotation, then the offset. The sink
/// rows are stored as appended and the mean is recomputed from them, so the payload is unchanged.
pub const ROTATION_CENTRED_KEYS: u32 = 0x101;
/// Header staging codes of rings whose keys and values use different types (extension):
/// `STAGING_SIDES + 16 * code(K) + code(V)`.
pub const STAGING_SIDES: u32 = 0x100;

/// The header staging code of a ring stored as `rows`.
pub fn staging_code(rows: RingRows) -> u32 {
    let (k, v) = (rows.k.staging, rows.v.staging);
    if k == v {
        k.code() as u32
    } else {
        STAGING_SIDES + 16 * k.code() as u32 + v.code() as u32
    }
}

/// The K and V staging of a header staging code.
pub fn staging_of_code(code: u32) -> Option<(Staging, Staging)> {
    if let Some(s) = Staging::from_code(code) {
        return Some((s, s));
    }
    let sides = code.checked_sub(STAGING_SIDES).filter(|&c| c < 256)?;
    Some((
        Staging::from_code(sides / 16)?,
        Staging::from_code(sides % 16)?,
    ))
}

/// FNV-1a, 64-bit: small, dependency-free and enough to catch corruption (not tampering).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl CacheConfig {
    /// The `SJKVSEQ` identity of the whole configuration (a fixed staging), the size of one
    /// (largest) record and of one tail row (K and V).
    pub fn state_identity(&self) -> CacheResult<(StateIdentity, usize, usize)> {
        let all: Vec<usize> = (0..self.layers).collect();
        let rows = RingRows::new(self.k_staging, self.v_staging, self.head_dim);
        self.state_identity_of(&all, rows)
    }

    /// The identity of a stream holding `layers` whose rings are stored as `rows` (reference
    /// codes when those layers share one reference coding and one reference staging type,
    /// extension codes otherwise).
    fn state_identity_of(
        &self,
        layers: &[usize],
        rows: RingRows,
    ) -> CacheResult<(StateIdentity, usize, usize)> {
        let lc = self.layer_coding[layers[0]];
        let codec = self.body_codec(layers[0])?;
        let uniform = layers.iter().all(|&l| self.layer_coding[l] == lc);
        let reference = uniform
            && self.min_tail.is_multiple_of(GROUP)
            && self.max_tail.is_multiple_of(128)
            && codec.is_reference()
            && self.head_dim.is_multiple_of(128)
            && rows.k == rows.v
            && rows.k.staging != Staging::Q8_0;
        let body = match &codec {
            BodyCodec::Reference { layout, .. } => layout.body,
            _ => Body::Scalar,
        };
        let codebook_id = if reference && body == Body::Trellis {
            journal::codebook_id(
                journal::state::BODY_TRELLIS,
                codebook(lc.k_bits, false),
                codebook(lc.v_bits, true),
            )
        } else {
            0
        };
        let record_bytes = layers
            .iter()
            .map(|&l| self.record_bytes(l))
            .max()
            .unwrap_or(0);
        let id = StateIdentity {
            head_dim: self.head_dim as u32,
            n_head_kv: self.kv_heads as u32,
            group: GROUP as u32,
            sink: self.sink as u32,
            sink_type: match self.sink_type {
                SinkType::F16 => journal::state::SINK_F16,
                SinkType::Inherit => journal::state::SINK_INHERIT,
            },
            bits_k: lc.k_bits,
            bits_v: lc.v_bits,
            body: if reference {
                body as u32
            } else {
                BODY_EXTENSION
            },
            iters: self.balance.passes,
            staging: staging_code(rows),
            tail: self.min_tail as u32,
            tail_max: self.max_tail as u32,
            flush_chunk: self.flush_chunk as u32,
            codebook_id,
            n_layers: layers.len() as u32,
            rotation: if self.centre_keys {
                ROTATION_CENTRED_KEYS
            } else {
                journal::state::ROTATION_HADAMARD
            },
        };
        Ok((id, record_bytes, rows.entry_bytes()))
    }
}

impl Sequence {
    /// The sequence as an `SJKVSEQ` v1 stream (byte-compatible with the reference codec for
    /// reference configurations). Every layer must hold the same positions and sealed end, as
    /// the reference's one-policy-per-sequence state does.
    pub fn state_bytes(&self) -> CacheResult<Vec<u8>> {
        let all: Vec<usize> = (0..self.layers.len()).collect();
        self.write_layers(&all)
    }

    /// The stream of `layers` (equal journal states).
    fn write_layers(&self, layers: &[usize]) -> CacheResult<Vec<u8>> {
        let first = self.layers[layers[0]].state();
        if layers.iter().any(|&l| self.layers[l].state() != first) {
            return Err(CacheError::Snapshot(
                "layers hold different lengths or sealed ends; append the same tokens to every \
                 layer before saving the sequence state"
                    .into(),
            ));
        }
        let cfg = self.config.clone();
        let rows = self.layers[layers[0]].rows;
        if layers.iter().any(|&l| self.layers[l].rows != rows) {
            return Err(CacheError::Snapshot(
                "layers stage their rings in different types (auto staging picked per layer); \
                 save a snapshot file instead, which holds one stream per layer"
                    .into(),
            ));
        }
        let (identity, record_bytes, stage) = cfg.state_identity_of(layers, rows)?;
        let header = StateHeader {
            identity,
            n: first.len as u32,
            b: (cfg.sink + GROUP * first.sealed) as u32,
            b_prev: (cfg.sink + GROUP * first.sealed_prev) as u32,
            draining: first.draining as u32,
        };
        let (h, d) = (cfg.kv_heads, cfg.head_dim);
        let ring_rows = cfg.ring_rows();
        let layer_record_bytes: Vec<usize> = layers.iter().map(|&l| cfg.record_bytes(l)).collect();
        let mut fill = |item: StateItem, dst: &mut [u8]| match item {
            StateItem::SinkRow { layer, pos, head } => {
                let l = &self.layers[layers[layer as usize]];
                let at = (pos as usize * h + head as usize) * d;
                let row = l.sink_k[at..at + d].iter().chain(&l.sink_v[at..at + d]);
                for (o, v) in dst.chunks_exact_mut(2).zip(row) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            StateItem::Record { layer, group, head } => {
                let l = &self.layers[layers[layer as usize]];
                let rb = layer_record_bytes[layer as usize];
                let slot = self.pool().get(l.blocks[group as usize]);
                let head = head as usize;
                dst.fill(0);
                dst[..rb].copy_from_slice(&slot[head * rb..(head + 1) * rb]);
            }
            StateItem::TailRow { layer, pos, head } => {
                let l = &self.layers[layers[layer as usize]];
                let slot = (pos as usize - cfg.sink) % ring_rows;
                let at = (slot * h + head as usize) * stage;
                dst.copy_from_slice(&l.ring[at..at + stage]);
            }
        };
        let mut out = journal::write_state_vec(&header, record_bytes, stage, &mut fill)?;
        if cfg.exact_recent > 0 {
            self.write_window(layers, &mut out);
        }
        Ok(out)
    }

    /// Appends the exact-window section of `layers` (see [`WINDOW_MAGIC`]).
    fn write_window(&self, layers: &[usize], out: &mut Vec<u8>) {
        let mut w = Writer(Vec::new());
        w.0.extend_from_slice(WINDOW_MAGIC);
        w.u32(self.config.exact_recent);
        for &l in layers {
            let win = &self.layers[l].window;
            w.u64(win.first);
            w.u64(win.rows(self.config.kv_heads * self.config.head_dim));
            for x in win.k.iter().chain(&win.v) {
                w.0.extend_from_slice(&x.to_le_bytes());
            }
        }
        let sum = fnv1a64(&w.0);
        out.extend_from_slice(&w.0);
        out.extend_from_slice(&sum.to_le_bytes());
    }

    /// Reads the exact-window section `bytes` of `layers` (each already holding its restored
    /// length) into their windows; anything but one whole, consistent section is refused.
    fn read_window(&mut self, layers: &[usize], bytes: &[u8]) -> CacheResult<()> {
        let bad = |what: &str| CacheError::Snapshot(format!("exact-window section: {what}"));
        if bytes.len() < 8 + 4 + 8 || &bytes[..8] != WINDOW_MAGIC {
            return Err(bad("missing or not a window section"));
        }
        let (body, sum) = bytes.split_at(bytes.len() - 8);
        if fnv1a64(body) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
            return Err(bad("checksum mismatch"));
        }
        let mut r = Reader {
            bytes: &body[8..],
            at: 0,
        };
        if r.u32()? != self.config.exact_recent {
            return Err(bad("written for another exact_recent"));
        }
        let (sink, per_pos) = (
            self.config.sink,
            self.config.kv_heads * self.config.head_dim,
        );
        let mut windows = Vec::with_capacity(layers.len());
        for &l in layers {
            let (first, rows) = (r.u64()?, r.u64()?);
            let end = self.layers[l].state.len.max(sink);
            if first < sink || first > end || rows != end - first {
                return Err(bad("positions do not match the stream"));
            }
            let mut side = || -> CacheResult<Vec<f16>> {
                let raw = r.take(rows * per_pos * 2)?;
                let out: Vec<f16> = raw
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]))
                    .collect();
                if out.iter().any(|x| !x.is_finite()) {
                    return Err(bad("non-finite copy"));
                }
                Ok(out)
            };
            let (k, v) = (side()?, side()?);
            windows.push(crate::backend::cpu::exact_window::ExactWindow { first, k, v });
        }
        if r.at != r.bytes.len() {
            return Err(bad("trailing bytes"));
        }
        for (&l, w) in layers.iter().zip(windows) {
            self.layers[l].window = w;
        }
        Ok(())
    }

    /// Restores a sequence of `config` from an `SJKVSEQ` stream into `pool` (a new pool sized
    /// for one sequence when `None`). Every mismatch and every damage is refused with its own
    /// [`journal::StateError`] before anything is allocated in the pool.
    pub fn from_state(
        config: Arc<CacheConfig>,
        pool: Option<Arc<RecordPool>>,
        bytes: &[u8],
    ) -> CacheResult<Sequence> {
        config.validate()?;
        let pool = pool.unwrap_or_else(|| Sequence::pool_for(&config, 1));
        let mut seq = Sequence::new(config.clone(), pool)?;
        let all: Vec<usize> = (0..config.layers).collect();
        seq.read_layers(&all, bytes)?;
        Ok(seq)
    }

    /// Fills the (empty) `layers` of this sequence from a stream holding exactly them.
    /// The stream must end where its header says (the reference reads a stream out of a larger
    /// buffer; one handed over on its own, as a snapshot's, must not carry more), followed by
    /// the exact-window section exactly when the configuration has a window.
    fn read_layers(&mut self, layers: &[usize], bytes: &[u8]) -> CacheResult<()> {
        let config = self.config.clone();
        let info = journal::peek(bytes)?;
        let (bytes, window) = bytes.split_at(info.total_bytes.min(bytes.len()));
        if config.exact_recent == 0 && !window.is_empty() {
            return Err(journal::StateError::Corrupt("bytes after the end of the stream").into());
        }
        // An `auto` cache takes each layer's staging from the stream (a layer that held nothing
        // has not picked yet and stays so); a fixed one must match it.
        let mut rows = self.layers[layers[0]].rows;
        let mut restored = None;
        if config.auto_staging.is_some() && info.header.n > 0 {
            let (k, v) = staging_of_code(info.header.identity.staging)
                .ok_or_else(|| corrupt("unknown staging code in the stream"))?;
            rows = RingRows::new(k, v, config.head_dim);
            restored = Some(crate::backend::cpu::alloc::zeroed_ring(
                config.ring_bytes(rows),
            )?);
        }
        let (identity, record_bytes, stage) = config.state_identity_of(layers, rows)?;
        journal::check_identity(&info, &identity, record_bytes, stage)?;
        let groups_cap = config
            .max_tokens
            .saturating_sub(config.sink)
            .div_ceil(GROUP);
        info.check_capacity(
            config.max_tokens as u32,
            groups_cap as u32,
            config.ring_rows() as u32,
        )?;
        let hd = info.header;
        let (h, d) = (config.kv_heads, config.head_dim);
        let ring_rows = config.ring_rows();
        let layer_record_bytes: Vec<usize> =
            layers.iter().map(|&l| config.record_bytes(l)).collect();
        let n_rec = ((hd.b - hd.identity.sink) / hd.identity.group) as usize;
        let slot_bytes = config.slot_bytes();
        let mut slots: Vec<Vec<u8>> = vec![vec![0u8; slot_bytes]; n_rec * layers.len()];
        if let Some(ring) = restored {
            for &l in layers {
                let lj = &mut self.layers[l];
                (lj.rows, lj.ring) = (rows, ring.clone());
                lj.pick = Some(StagingPick::restored(rows.k.staging, rows.v.staging));
            }
        }
        let journals = &mut self.layers;
        journal::walk_payload(bytes, &info, record_bytes, stage, |item, src| match item {
            StateItem::SinkRow { layer, pos, head } => {
                let l = &mut journals[layers[layer as usize]];
                let at = (pos as usize * h + head as usize) * d;
                for (i, c) in src.chunks_exact(2).enumerate() {
                    let v = f16::from_le_bytes([c[0], c[1]]);
                    if i < d {
                        l.sink_k[at + i] = v;
                    } else {
                        l.sink_v[at + i - d] = v;
                    }
                }
            }
            StateItem::Record { layer, group, head } => {
                let rb = layer_record_bytes[layer as usize];
                let slot = &mut slots[layer as usize * n_rec + group as usize];
                let head = head as usize;
                slot[head * rb..(head + 1) * rb].copy_from_slice(&src[..rb]);
            }
            StateItem::TailRow { layer, pos, head } => {
                let l = &mut journals[layers[layer as usize]];
                let slot = (pos as usize - config.sink) % ring_rows;
                let at = (slot * h + head as usize) * stage;
                l.ring[at..at + stage].copy_from_slice(src);
            }
        })?;
        let ids: Vec<SlotId> = self.pool.reserve(slots.len())?;
        for (i, (bytes, id)) in slots.into_iter().zip(ids).enumerate() {
            let layer = layers[i / n_rec.max(1)];
            let rb = config.kv_heads * config.record_bytes(layer);
            self.pool.fill(id, Arc::from(&bytes[..rb]));
            self.layers[layer].blocks.push(id);
        }
        let st = crate::journal::LayerState {
            len: hd.n as usize,
            sealed: n_rec,
            sealed_prev: ((hd.b_prev - hd.identity.sink) / hd.identity.group) as usize,
            draining: hd.draining == 1,
        };
        for &l in layers {
            self.layers[l].set_state(st);
            self.layers[l].refresh_centring(&config)?;
        }
        if config.exact_recent > 0 {
            self.read_window(layers, window)?;
        }
        Ok(())
    }

    /// The snapshot bytes of this sequence: the configuration block, then one single-layer
    /// `SJKVSEQ` stream per layer (so layers at different points, and tiered layers, save too).
    pub fn snapshot_bytes(&self) -> CacheResult<Vec<u8>> {
        let mut w = Writer(Vec::new());
        write_config(&mut w, self.config());
        for layer in 0..self.layers.len() {
            let stream = self.write_layers(&[layer])?;
            w.u64(stream.len());
            w.0.extend_from_slice(&stream);
        }
        let mut out = Vec::with_capacity(w.0.len() + 28);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(w.0.len() as u64).to_le_bytes());
        out.extend_from_slice(&w.0);
        let sum = fnv1a64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        Ok(out)
    }

    /// Writes the snapshot to `path` atomically and durably: a
    /// temporary of this call's own, fsync, rename, directory fsync. Concurrent saves (of one
    /// path or of paths sharing a stem) never mix: each file holds one whole snapshot.
    pub fn save(&self, path: &Path) -> CacheResult<()> {
        let bytes = self.snapshot_bytes()?;
        crate::atomic_file::replace_with(path, |f| {
            if let Some(limit) = crate::backend::cpu::faults::take_snapshot_limit() {
                f.write_all(&bytes[..limit.min(bytes.len())])?;
                return Err(std::io::Error::other("injected failure while writing"));
            }
            f.write_all(&bytes)
        })
        .map_err(|e| CacheError::io(path, &e))
    }

    /// Restores a sequence from snapshot bytes into `pool` (a new pool sized for one sequence
    /// when `None`). If `expected` is given, the stored configuration must equal it.
    pub fn from_snapshot(
        bytes: &[u8],
        pool: Option<Arc<RecordPool>>,
        expected: Option<&CacheConfig>,
    ) -> CacheResult<Sequence> {
        if bytes.len() < 28 || &bytes[..8] != MAGIC {
            return Err(CacheError::Snapshot(
                "not an sjkvarn snapshot (bad magic or too short)".into(),
            ));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version == 1 {
            return Err(CacheError::Snapshot(
                "snapshot version 1 was written before sjkvarn adopted the SJ-KVaRN reference \
                 record format; this build cannot read its records. Rebuild the cache from the \
                 prompt (append the tokens again) and save it anew"
                    .into(),
            ));
        }
        if !(2..=VERSION).contains(&version) {
            return Err(CacheError::Snapshot(format!(
                "snapshot version {version}, this build reads versions 2 to {VERSION}"
            )));
        }
        let payload_len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
        if payload_len != (bytes.len() - 28) as u64 {
            return Err(CacheError::Snapshot(format!(
                "file is {} bytes, header promises {} (truncated or padded)",
                bytes.len(),
                payload_len + 28
            )));
        }
        let (body, sum) = bytes.split_at(bytes.len() - 8);
        if fnv1a64(body) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
            return Err(CacheError::Snapshot(
                "checksum mismatch (corrupted file)".into(),
            ));
        }
        let mut r = Reader {
            bytes: &body[20..],
            at: 0,
        };
        let config = read_config(&mut r, version)?;
        if let Some(exp) = expected {
            if exp != &config {
                return Err(CacheError::Snapshot(
                    "the snapshot's configuration differs from this cache's".into(),
                ));
            }
        }
        let config = Arc::new(config);
        let mut streams = Vec::with_capacity(config.layers);
        for _ in 0..config.layers {
            let len = r.u64()?;
            streams.push(r.take(len)?);
        }
        if r.at != r.bytes.len() {
            return Err(corrupt("trailing bytes"));
        }
        let pool = pool.unwrap_or_else(|| Sequence::pool_for(&config, 1));
        let mut seq = Sequence::new(config, pool)?;
        for (layer, stream) in streams.into_iter().enumerate() {
            seq.read_layers(&[layer], stream)?;
        }
        Ok(seq)
    }

    /// Reads a snapshot file; see [`Sequence::from_snapshot`].
    pub fn load(
        path: &Path,
        pool: Option<Arc<RecordPool>>,
        expected: Option<&CacheConfig>,
    ) -> CacheResult<Sequence> {
        let bytes = std::fs::read(path).map_err(|e| CacheError::io(path, &e))?;
        Self::from_snapshot(&bytes, pool, expected)
    }
}
