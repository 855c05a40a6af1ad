//! Snapshots: a sequence saved to one file and restored, refusing anything that does not match.
//!
//! Layout (little-endian): `b"SJKVSNAP"`, `version: u32`, `payload_len: u64`, payload,
//! `fnv1a64(everything before): u64`. The payload holds the configuration, then per layer the
//! length, sealed group count, the occupied sink rows (fp16), the occupied ring rows (staged
//! bytes, position order) and the sealed records (all KV heads of a group, group order). Files
//! are written to a temporary name, synced, then renamed, so an interrupted save never replaces
//! a good file.

use super::config::{CacheConfig, LayerCoding, Staging, SINK};
use super::pool::{RecordPool, SlotId};
use super::sequence::Sequence;
use super::{CacheError, CacheResult};
use crate::balance::{BalanceConfig, BalanceMode, BalanceStat};
use crate::body::{BodyCoding, TrellisAxis, GROUP};
use crate::gtq::KeySchedule;
use half::f16;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

const MAGIC: &[u8; 8] = b"SJKVSNAP";
/// Format version; bumped on any layout change.
pub const VERSION: u32 = 1;

/// FNV-1a, 64-bit: small, dependency-free and enough to catch corruption (not tampering).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn coding_byte(c: BodyCoding) -> u8 {
    match c {
        BodyCoding::Scalar => 0,
        BodyCoding::Trellis(TrellisAxis::Token) => 1,
        BodyCoding::Trellis(TrellisAxis::Channel) => 2,
        BodyCoding::RopeBlocks => 3,
    }
}

fn coding_of(b: u8) -> CacheResult<BodyCoding> {
    match b {
        0 => Ok(BodyCoding::Scalar),
        1 => Ok(BodyCoding::Trellis(TrellisAxis::Token)),
        2 => Ok(BodyCoding::Trellis(TrellisAxis::Channel)),
        3 => Ok(BodyCoding::RopeBlocks),
        _ => Err(corrupt("unknown body coding")),
    }
}

fn corrupt(what: &str) -> CacheError {
    CacheError::Snapshot(format!("corrupt or foreign file ({what})"))
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: usize) {
        self.0.extend_from_slice(&(v as u32).to_le_bytes());
    }
    fn u64(&mut self, v: usize) {
        self.0.extend_from_slice(&(v as u64).to_le_bytes());
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> CacheResult<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| corrupt("truncated payload"))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> CacheResult<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> CacheResult<usize> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as usize)
    }
    fn u64(&mut self) -> CacheResult<usize> {
        usize::try_from(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
        .map_err(|_| corrupt("length"))
    }
}

fn write_config(w: &mut Writer, c: &CacheConfig) {
    for v in [c.layers, c.q_heads, c.kv_heads, c.head_dim] {
        w.u32(v);
    }
    for v in [c.min_tail, c.max_tail, c.max_chunk, c.max_tokens] {
        w.u64(v);
    }
    w.u8(match c.staging {
        Staging::Tq6 => 0,
        Staging::Q8_0 => 1,
        Staging::F16 => 2,
    });
    w.u32(c.balance.passes as usize);
    w.u8((c.balance.mode == BalanceMode::Best) as u8);
    w.u8((c.balance.stat == BalanceStat::Rms) as u8);
    for lc in &c.layer_coding {
        w.u8(lc.k_bits as u8);
        w.u8(lc.v_bits as u8);
        w.u8(coding_byte(lc.k_coding));
        w.u8(coding_byte(lc.v_coding));
    }
    // Block-GTQ layers: one width per RoPE block, per KV head (absent otherwise, so files
    // without them keep the original layout).
    for heads in &c.key_schedules {
        for s in heads {
            for &b in s.block_bits() {
                w.u8(b as u8);
            }
        }
    }
}

fn read_config(r: &mut Reader) -> CacheResult<CacheConfig> {
    let (layers, q_heads, kv_heads, head_dim) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
    let (min_tail, max_tail, max_chunk, max_tokens) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
    let staging = match r.u8()? {
        0 => Staging::Tq6,
        1 => Staging::Q8_0,
        2 => Staging::F16,
        _ => return Err(corrupt("unknown staging")),
    };
    let balance = BalanceConfig {
        passes: r.u32()? as u32,
        mode: if r.u8()? == 1 {
            BalanceMode::Best
        } else {
            BalanceMode::Final
        },
        stat: if r.u8()? == 1 {
            BalanceStat::Rms
        } else {
            BalanceStat::Std
        },
    };
    if layers > 4096 {
        return Err(corrupt("layer count"));
    }
    let mut layer_coding = Vec::with_capacity(layers);
    for _ in 0..layers {
        layer_coding.push(LayerCoding {
            k_bits: r.u8()? as u32,
            v_bits: r.u8()? as u32,
            k_coding: coding_of(r.u8()?)?,
            v_coding: coding_of(r.u8()?)?,
        });
    }
    let mut key_schedules = Vec::new();
    if layer_coding
        .iter()
        .any(|lc| lc.k_coding == BodyCoding::RopeBlocks)
    {
        if kv_heads > 1024 || !(64..=256).contains(&head_dim) {
            return Err(corrupt("key schedule geometry"));
        }
        for lc in &layer_coding {
            let mut heads = Vec::new();
            if lc.k_coding == BodyCoding::RopeBlocks {
                for _ in 0..kv_heads {
                    let bits = r.take(head_dim / 2)?.iter().map(|&b| b as u32).collect();
                    heads.push(KeySchedule::new(head_dim, bits).map_err(|e| {
                        CacheError::Snapshot(format!("stored key schedule is invalid: {e}"))
                    })?);
                }
            }
            key_schedules.push(heads);
        }
    }
    let config = CacheConfig {
        layers,
        q_heads,
        kv_heads,
        head_dim,
        layer_coding,
        min_tail,
        max_tail,
        max_chunk,
        max_tokens,
        balance,
        staging,
        key_schedules,
    };
    config
        .validate()
        .map_err(|e| CacheError::Snapshot(format!("stored configuration is invalid: {e}")))?;
    Ok(config)
}

impl Sequence {
    /// The snapshot bytes of this sequence.
    pub fn snapshot_bytes(&self) -> Vec<u8> {
        let cfg = self.config();
        let mut w = Writer(Vec::new());
        write_config(&mut w, cfg);
        let per_pos = cfg.kv_heads * cfg.head_dim;
        let rb = self.rows.row_bytes();
        for (i, l) in self.layers.iter().enumerate() {
            w.u64(l.len);
            w.u64(l.sealed);
            let sink = l.len.min(SINK) * per_pos;
            for v in l.sink_k[..sink].iter().chain(&l.sink_v[..sink]) {
                w.0.extend_from_slice(&v.to_le_bytes());
            }
            for pos in l.ring_start().max(SINK)..l.len {
                let at = (pos - SINK) % cfg.ring_rows() * cfg.kv_heads * 2 * rb;
                w.0.extend_from_slice(&l.ring[at..at + cfg.kv_heads * 2 * rb]);
            }
            let slot = cfg.kv_heads * cfg.body_spec(i).record_bytes();
            for &id in &l.blocks {
                w.0.extend_from_slice(&self.pool().get(id)[..slot]);
            }
        }
        let mut out = Vec::with_capacity(w.0.len() + 28);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(w.0.len() as u64).to_le_bytes());
        out.extend_from_slice(&w.0);
        let sum = fnv1a64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// Writes the snapshot to `path` atomically (temporary file, fsync, rename).
    pub fn save(&self, path: &Path) -> CacheResult<()> {
        let io = |e: std::io::Error| CacheError::Io(format!("{}: {e}", path.display()));
        let bytes = self.snapshot_bytes();
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let result = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            if let Some(limit) = super::faults::take_snapshot_limit() {
                f.write_all(&bytes[..limit.min(bytes.len())])?;
                return Err(std::io::Error::other("injected failure while writing"));
            }
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map_err(io)
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
        if version != VERSION {
            return Err(CacheError::Snapshot(format!(
                "snapshot version {version}, this build reads {VERSION}"
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
        let config = read_config(&mut r)?;
        if let Some(exp) = expected {
            if exp != &config {
                return Err(CacheError::Snapshot(
                    "the snapshot's configuration differs from this cache's".into(),
                ));
            }
        }
        let pool = pool.unwrap_or_else(|| Sequence::pool_for(&config, 1));
        let mut seq = Sequence::new(Arc::new(config), pool)?;
        let cfg = seq.config.clone();
        let per_pos = cfg.kv_heads * cfg.head_dim;
        let rb = seq.rows.row_bytes();
        let mut records: Vec<(usize, Vec<u8>)> = Vec::new();
        for i in 0..cfg.layers {
            let (len, sealed) = (r.u64()?, r.u64()?);
            if len > cfg.max_tokens
                || SINK + sealed * GROUP > len.max(SINK)
                || len.saturating_sub(SINK + sealed * GROUP) > cfg.ring_rows()
            {
                return Err(corrupt("layer lengths"));
            }
            let l = &mut seq.layers[i];
            l.len = len;
            l.sealed = sealed;
            let sink = len.min(SINK) * per_pos;
            let raw = r.take(4 * sink)?;
            for (j, c) in raw.chunks_exact(2).enumerate() {
                let v = f16::from_le_bytes([c[0], c[1]]);
                if j < sink {
                    l.sink_k[j] = v;
                } else {
                    l.sink_v[j - sink] = v;
                }
            }
            for pos in (SINK + sealed * GROUP).max(SINK)..len {
                let at = (pos - SINK) % cfg.ring_rows() * cfg.kv_heads * 2 * rb;
                let row = r.take(cfg.kv_heads * 2 * rb)?;
                l.ring[at..at + row.len()].copy_from_slice(row);
            }
            let slot = cfg.kv_heads * cfg.body_spec(i).record_bytes();
            for _ in 0..sealed {
                records.push((i, r.take(slot)?.to_vec()));
            }
        }
        if r.at != r.bytes.len() {
            return Err(corrupt("trailing bytes"));
        }
        let ids: Vec<SlotId> = seq.pool.reserve(records.len())?;
        for ((layer, bytes), id) in records.into_iter().zip(ids) {
            seq.pool.fill(id, Arc::from(bytes));
            seq.layers[layer].blocks.push(id);
        }
        Ok(seq)
    }

    /// Reads a snapshot file; see [`Sequence::from_snapshot`].
    pub fn load(
        path: &Path,
        pool: Option<Arc<RecordPool>>,
        expected: Option<&CacheConfig>,
    ) -> CacheResult<Sequence> {
        let bytes =
            std::fs::read(path).map_err(|e| CacheError::Io(format!("{}: {e}", path.display())))?;
        Self::from_snapshot(&bytes, pool, expected)
    }
}
