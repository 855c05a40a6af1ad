//! How a paged cache codes its blocks, and the checks the plugin's configuration goes through.

use super::{invalid, PagedResult, BLOCK, WINDOW_MIN_BLOCK};
use crate::codec::extension::body::{BodyCoding, TrellisAxis};
use crate::codec::BodyCodec;
use crate::BalanceConfig;

const BODIES: &str = "('scalar', 'trellis')";
const TRELLIS_BITS: [(u32, u32); 3] = [(3, 3), (3, 2), (2, 2)];

/// The element type of lossless pages (the model's dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageDtype {
    F32,
    F16,
    Bf16,
}

impl PageDtype {
    /// `"float32"`, `"float16"` or `"bfloat16"` (a `torch.` prefix is accepted).
    pub fn from_name(name: &str) -> PagedResult<Self> {
        match name.strip_prefix("torch.").unwrap_or(name) {
            "float32" | "float" => Ok(Self::F32),
            "float16" | "half" => Ok(Self::F16),
            "bfloat16" => Ok(Self::Bf16),
            other => invalid(format!(
                "page dtype must be float32, float16 or bfloat16, got {other:?}"
            )),
        }
    }

    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// Reads element `i` of little-endian `bytes`.
    pub(crate) fn get(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            Self::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap_or([0; 4])),
            Self::F16 => half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
            Self::Bf16 => half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        }
    }

    /// Writes `x` (rounded to nearest even) as element `i` of `bytes`.
    pub(crate) fn put(self, bytes: &mut [u8], i: usize, x: f32) {
        match self {
            Self::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes()),
            Self::F16 => {
                bytes[2 * i..2 * i + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes())
            }
            Self::Bf16 => {
                bytes[2 * i..2 * i + 2].copy_from_slice(&half::bf16::from_f32(x).to_le_bytes())
            }
        }
    }
}

/// How a paged cache codes its blocks.
///
/// `k_bits`/`v_bits`/`body`: the record coding (scalar 2..4 bits, or the reference trellis at
/// 3/3, 3/2, 2/2). `lossless`: every row stored in the model's dtype instead (the engine's own
/// layout, for checking the plumbing). `sink`: keep the first block exact. `max_sink_blocks`:
/// exact sink blocks kept per layer (least recently used ones beyond it read their records).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedSettings {
    pub k_bits: u32,
    pub v_bits: u32,
    pub body: BodyCoding,
    pub sink: bool,
    pub lossless: bool,
    pub max_sink_blocks: usize,
}

impl Default for PagedSettings {
    fn default() -> Self {
        Self {
            k_bits: 4,
            v_bits: 4,
            body: BodyCoding::Scalar,
            sink: true,
            lossless: false,
            max_sink_blocks: 256,
        }
    }
}

impl PagedSettings {
    /// Checked settings from the plugin's raw values (`body` by name; `max_sink_blocks` signed
    /// so that a negative value is named rather than wrapped).
    pub fn new(
        k_bits: i64,
        v_bits: i64,
        body: &str,
        sink: bool,
        lossless: bool,
        max_sink_blocks: i64,
    ) -> PagedResult<Self> {
        let body = match body {
            "scalar" => BodyCoding::Scalar,
            "trellis" => BodyCoding::Trellis(TrellisAxis::Token),
            other => return invalid(format!("body must be one of {BODIES}, got '{other}'")),
        };
        let bits = |b: i64| u32::try_from(b).unwrap_or(u32::MAX);
        let (k, v) = (bits(k_bits), bits(v_bits));
        if body != BodyCoding::Scalar && !TRELLIS_BITS.contains(&(k, v)) {
            return invalid(format!(
                "trellis bodies code k_bits/v_bits ((3, 3), (3, 2), (2, 2)), got {k_bits}/{v_bits}"
            ));
        }
        if body == BodyCoding::Scalar && !((2..=4).contains(&k) && (2..=4).contains(&v)) {
            return invalid(format!(
                "k_bits and v_bits must be 2..4, got {k_bits}/{v_bits}"
            ));
        }
        let Ok(max_sink_blocks) = usize::try_from(max_sink_blocks) else {
            return invalid(format!(
                "max_sink_blocks must be at least 0, got {max_sink_blocks}"
            ));
        };
        Ok(Self {
            k_bits: k,
            v_bits: v,
            body,
            sink,
            lossless,
            max_sink_blocks,
        })
    }

    /// The body name the Python codec functions take.
    pub fn body_name(&self) -> &'static str {
        match self.body {
            BodyCoding::Scalar => "scalar",
            _ => "trellis",
        }
    }

    /// The layer codec every seal and read uses: the same one `sjkvarn.codec.encode_body`
    /// builds for these settings (default balancing), so sealed pages are its records.
    pub fn codec(&self, head_dim: usize) -> PagedResult<BodyCodec> {
        Ok(BodyCodec::for_layer(
            head_dim,
            self.k_bits,
            self.v_bits,
            self.body,
            self.body,
            BalanceConfig::default(),
        )?)
    }

    /// Bytes of one KV head's share of a block page: one record, or (lossless) the block's K
    /// and V rows in `dtype`.
    pub fn state_bytes(&self, head_dim: usize, dtype: PageDtype) -> PagedResult<usize> {
        if self.lossless {
            return Ok(BLOCK * 2 * head_dim * dtype.size());
        }
        Ok(self.codec(head_dim)?.record_bytes())
    }

    /// Tokens per sliding-window page: the most (a power of two, at least
    /// [`WINDOW_MIN_BLOCK`]) whose exact fp16 rows fit in one record page, so that both kinds
    /// of layer share the engine's page size.
    pub fn window_block_tokens(&self, head_dim: usize) -> PagedResult<usize> {
        let record = self.state_bytes(head_dim, PageDtype::F16)?;
        let row = window_row_bytes(head_dim);
        let mut tokens = BLOCK;
        while tokens > WINDOW_MIN_BLOCK && tokens * row > record {
            tokens /= 2;
        }
        Ok(tokens)
    }

    /// Sequences of `tokens` that fit in one GiB of KV memory, for `layers` layers of which
    /// `window_layers` attend over the last `window` positions.
    ///
    /// Full-attention layers: pages plus, unless lossless, the two exact blocks (sink and open
    /// block, fp16) each sequence holds beside them. Window layers hold the blocks an engine
    /// keeps for a decoding sequence (`ceil(window / block) + 1`): exact pages of
    /// [`window_block_tokens`](Self::window_block_tokens) rows, or plain pages when lossless.
    #[allow(clippy::too_many_arguments)]
    pub fn sequences_per_gib(
        &self,
        tokens: usize,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: PageDtype,
        window_layers: usize,
        window: usize,
    ) -> PagedResult<f64> {
        let Some(full) = layers.checked_sub(window_layers) else {
            return invalid(format!(
                "{window_layers} window layers of only {layers} layers"
            ));
        };
        let blocks = tokens.div_ceil(BLOCK);
        let page = kv_heads * self.state_bytes(head_dim, dtype)?;
        let side = if self.lossless {
            0
        } else {
            2 * full * 2 * BLOCK * kv_heads * head_dim * 2
        };
        let per_window = if self.lossless {
            BLOCK
        } else {
            self.window_block_tokens(head_dim)?
        };
        let kept = if window_layers > 0 {
            window.min(tokens).div_ceil(per_window) + 1
        } else {
            0
        };
        let bytes = full * blocks * page + side + window_layers * kept * page;
        if bytes == 0 {
            return invalid("no layers or no tokens: nothing to size");
        }
        Ok((1u64 << 30) as f64 / bytes as f64)
    }
}

/// Bytes of one token's exact K and V rows (fp16) for one KV head in a window page.
pub fn window_row_bytes(head_dim: usize) -> usize {
    2 * head_dim * 2
}
