//! The snapshot's configuration block (everything sjkvarn's configuration holds beyond the
//! `SJKVSEQ` header) and the little-endian writer and reader of the file.

use crate::codec::extension::balance::{BalanceConfig, BalanceMode, BalanceStat};
use crate::codec::extension::body::{BodyCoding, TrellisAxis};
use crate::error::{CacheError, CacheResult};
use crate::journal::{CacheConfig, LayerCoding, SinkType, Staging};

/// Flag bit of the configuration block: keys centred on the sink's mean.
pub(crate) const FLAG_CENTRE_KEYS: u8 = 1;

/// The staging kind of a configuration byte: [`Staging::code`] from version 5 on; files before
/// it numbered the kinds `tq6_0` 0, `q8_0` 1, `f16` 2.
pub(crate) fn staging_of_byte(b: u8, version: u32) -> CacheResult<Staging> {
    let legacy = [Staging::Tq6, Staging::Q8_0, Staging::F16];
    let kind = if version >= 5 {
        Staging::from_code(b as u32)
    } else {
        legacy.get(b as usize).copied()
    };
    kind.ok_or_else(|| corrupt("unknown staging"))
}

pub(crate) fn coding_byte(c: BodyCoding) -> u8 {
    match c {
        BodyCoding::Scalar => 0,
        BodyCoding::Trellis(TrellisAxis::Token) => 1,
    }
}

pub(crate) fn coding_of(b: u8) -> CacheResult<BodyCoding> {
    match b {
        0 => Ok(BodyCoding::Scalar),
        1 => Ok(BodyCoding::Trellis(TrellisAxis::Token)),
        _ => Err(corrupt("unknown body coding")),
    }
}

pub(crate) fn corrupt(what: &str) -> CacheError {
    CacheError::Snapshot(format!("corrupt or foreign file ({what})"))
}

pub(crate) struct Writer(pub(crate) Vec<u8>);

impl Writer {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u32(&mut self, v: usize) {
        self.0.extend_from_slice(&(v as u32).to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: usize) {
        self.0.extend_from_slice(&(v as u64).to_le_bytes());
    }
}

pub(crate) struct Reader<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> CacheResult<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| corrupt("truncated payload"))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    pub(crate) fn u8(&mut self) -> CacheResult<u8> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> CacheResult<usize> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as usize)
    }
    pub(crate) fn u64(&mut self) -> CacheResult<usize> {
        usize::try_from(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
        .map_err(|_| corrupt("length"))
    }
}

pub(crate) fn write_config(w: &mut Writer, c: &CacheConfig) {
    for v in [c.layers, c.q_heads, c.kv_heads, c.head_dim] {
        w.u32(v);
    }
    for v in [
        c.min_tail,
        c.max_tail,
        c.max_chunk,
        c.max_tokens,
        c.flush_chunk,
    ] {
        w.u64(v);
    }
    w.u8((c.sink_type == SinkType::Inherit) as u8);
    w.u64(c.sink);
    w.u8(if c.centre_keys { FLAG_CENTRE_KEYS } else { 0 });
    w.u32(c.exact_recent);
    // One byte for one type (as version-2 files always held); 3 then K and V bytes for
    // different types; 4 then the budget's f32 bits for `auto` (each layer's pick is in its
    // stream's header).
    match c.auto_staging {
        Some(budget) => {
            w.u8(4);
            w.u32(budget.to_bits() as usize);
        }
        None if c.k_staging == c.v_staging => w.u8(c.k_staging.code()),
        None => {
            w.u8(3);
            w.u8(c.k_staging.code());
            w.u8(c.v_staging.code());
        }
    }
    w.u32(c.balance.passes as usize);
    w.u8((c.balance.mode == BalanceMode::Best) as u8);
    w.u8((c.balance.stat == BalanceStat::Rms) as u8);
    for lc in &c.layer_coding {
        w.u8(lc.k_bits as u8);
        w.u8(lc.v_bits as u8);
        w.u8(coding_byte(lc.k_coding));
        w.u8(coding_byte(lc.v_coding));
    }
}

pub(crate) fn read_config(r: &mut Reader, version: u32) -> CacheResult<CacheConfig> {
    let (layers, q_heads, kv_heads, head_dim) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
    let (min_tail, max_tail, max_chunk, max_tokens) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
    let flush_chunk = r.u64()?;
    let sink_type = match r.u8()? {
        0 => SinkType::F16,
        1 => SinkType::Inherit,
        _ => return Err(corrupt("unknown sink type")),
    };
    let sink = r.u64()?;
    let flags = if version >= 3 { r.u8()? } else { 0 };
    if flags & !FLAG_CENTRE_KEYS != 0 {
        return Err(corrupt("unknown configuration flags"));
    }
    let exact_recent = if version >= 4 { r.u32()? } else { 0 };
    let (k_staging, v_staging, auto_staging) = match r.u8()? {
        3 => (
            staging_of_byte(r.u8()?, version)?,
            staging_of_byte(r.u8()?, version)?,
            None,
        ),
        4 => {
            let budget = f32::from_bits(r.u32()? as u32);
            (Staging::Tq6, Staging::Tq6, Some(budget))
        }
        b => {
            let s = staging_of_byte(b, version)?;
            (s, s, None)
        }
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
    let config = CacheConfig {
        layers,
        q_heads,
        kv_heads,
        head_dim,
        layer_coding,
        min_tail,
        max_tail,
        max_chunk,
        flush_chunk,
        max_tokens,
        balance,
        k_staging,
        v_staging,
        auto_staging,
        sink,
        sink_type,
        centre_keys: flags & FLAG_CENTRE_KEYS != 0,
        exact_recent,
    };
    config
        .validate()
        .map_err(|e| CacheError::Snapshot(format!("stored configuration is invalid: {e}")))?;
    Ok(config)
}
