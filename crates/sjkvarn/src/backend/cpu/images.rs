//! A layer's journal as plain bytes ([`LayerImage`]), out of a sequence and back into one:
//! what snapshots, states and device copies read and write.

use super::sequence::Sequence;
use crate::backend::cpu::exact_window::ExactWindow;
use crate::backend::pool::RecordPool;
use crate::codec::extension::body::GROUP;
use crate::error::{CacheError, CacheResult};
use crate::journal::CacheConfig;
use crate::journal::LayerState;
use half::f16;
use std::sync::Arc;

/// One layer's journal as plain bytes: what a device copy of the layer holds, and what crosses
/// between the CPU and a device backend. Records are in block order, one `slot_bytes` slot per
/// sealed group (the layer's records first, zero padding after).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerImage {
    pub len: usize,
    pub sealed: usize,
    pub sealed_prev: usize,
    pub draining: bool,
    /// `[sink][kv_heads][head_dim]` fp16 bits, rotated frame.
    pub sink_k: Vec<u16>,
    pub sink_v: Vec<u16>,
    /// `[ring_rows][kv_heads][K, V][row_bytes]`.
    pub ring: Vec<u8>,
    /// `[sealed][slot_bytes]`.
    pub records: Vec<u8>,
}

impl LayerImage {
    /// The image's journal state.
    pub fn state(&self) -> LayerState {
        LayerState {
            len: self.len,
            sealed: self.sealed,
            sealed_prev: self.sealed_prev,
            draining: self.draining,
        }
    }
}

impl Sequence {
    /// The bytes of `layer` (see [`LayerImage`]).
    pub fn layer_image(&self, layer: usize) -> CacheResult<LayerImage> {
        let l = self.layer(layer)?;
        let slot = self.config.slot_bytes();
        let mut records = vec![0u8; l.blocks.len() * slot];
        for (dst, &id) in records.chunks_exact_mut(slot).zip(&l.blocks) {
            let bytes = self.pool.get(id);
            dst[..bytes.len()].copy_from_slice(&bytes);
        }
        Ok(LayerImage {
            len: l.state.len,
            sealed: l.state.sealed,
            sealed_prev: l.state.sealed_prev,
            draining: l.state.draining,
            sink_k: l.sink_k.iter().map(|h| h.to_bits()).collect(),
            sink_v: l.sink_v.iter().map(|h| h.to_bits()).collect(),
            ring: l.ring.clone(),
            records,
        })
    }

    /// A sequence holding exactly these layer images (for example copied back from a device).
    /// Every image is checked against the configuration first (sizes, sealed groups within the
    /// length, unsealed tokens within the ring).
    pub fn from_images(
        config: Arc<CacheConfig>,
        pool: Arc<RecordPool>,
        images: &[LayerImage],
    ) -> CacheResult<Self> {
        let mut seq = Sequence::new(config.clone(), pool)?;
        if images.len() != config.layers {
            return Err(CacheError::InvalidConfig(format!(
                "{} layer images for {} layers",
                images.len(),
                config.layers
            )));
        }
        let slot = config.slot_bytes();
        for (i, img) in images.iter().enumerate() {
            let l = &seq.layers[i];
            let body_end = config.sink + GROUP * img.sealed;
            let bad = img.len > config.max_tokens
                || (img.sealed > 0 && body_end > img.len)
                || img.sealed_prev > img.sealed
                || img.len.saturating_sub(body_end.max(config.sink)) > config.ring_rows()
                || img.sink_k.len() != l.sink_k.len()
                || img.sink_v.len() != l.sink_v.len()
                || img.ring.len() != l.ring.len()
                || img.records.len() != img.sealed * slot;
            if bad {
                return Err(CacheError::InvalidConfig(format!(
                    "layer {i} image does not match the configuration (len {}, sealed {})",
                    img.len, img.sealed
                )));
            }
        }
        let total: usize = images.iter().map(|img| img.sealed).sum();
        let mut slots = seq.pool.reserve(total)?.into_iter();
        for (i, img) in images.iter().enumerate() {
            let rb = config.kv_heads * config.record_bytes(i);
            let l = &mut seq.layers[i];
            l.state = img.state();
            l.sink_k = img.sink_k.iter().map(|&b| f16::from_bits(b)).collect();
            l.sink_v = img.sink_v.iter().map(|&b| f16::from_bits(b)).collect();
            l.ring.copy_from_slice(&img.ring);
            // Images carry no exact-window copies: queries read the restored rows from the ring.
            l.window = ExactWindow {
                first: img.len.max(config.sink),
                k: Vec::new(),
                v: Vec::new(),
            };
            for rec in img.records.chunks_exact(slot) {
                let id = slots.next().expect("reserved one slot per sealed group");
                seq.pool.fill(id, Arc::from(&rec[..rb]));
                l.blocks.push(id);
            }
            l.refresh_centring(&config)?;
        }
        Ok(seq)
    }
}
