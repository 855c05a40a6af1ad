//! `sjkvarn._core`: thin PyO3 bindings over the `sjkvarn` crate. Arrays cross by DLPack; every
//! error becomes a Python exception; heavy work runs with the GIL released.

mod cache;
mod cuda;
mod dlpack;
mod errors;
mod paged;
mod shared;

use dlpack::{read_f32, with_f32_out};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use sjkvarn::codec::extension::body::BodyCoding;
use sjkvarn::codec::extension::body::GROUP;
use sjkvarn::codec::extension::records;
use sjkvarn::codec::BodyCodec;
use sjkvarn::{BalanceConfig, BalanceMode, BalanceStat, BlockFormat, BodySpec};

use errors::invalid;

fn err(e: sjkvarn::CodecError) -> PyErr {
    errors::codec(e)
}

fn format_of(name: &str) -> PyResult<BlockFormat> {
    BlockFormat::from_name(name).map_err(err)
}

/// `(name, values_per_block, bytes_per_block, rotated)` for every flat format.
#[pyfunction]
fn formats() -> Vec<(&'static str, usize, usize, bool)> {
    BlockFormat::all()
        .iter()
        .map(|f| (f.name(), f.block_values(), f.block_bytes(), f.rotated()))
        .collect()
}

/// Encodes a float tensor; blocks run along the last dimension, which must divide into blocks.
/// `rotated`: the values are already in the Hadamard frame (rotated formats skip their rotation).
#[pyfunction]
#[pyo3(signature = (format, array, threads=None, rotated=false))]
fn encode<'py>(
    py: Python<'py>,
    format: &str,
    array: &Bound<'py, PyAny>,
    threads: Option<usize>,
    rotated: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let f = format_of(format)?;
    let host = read_f32(array, "array")?;
    let last = host.shape.last().copied().unwrap_or(1);
    if host.shape.is_empty() || last % f.block_values_for(last) != 0 {
        return Err(invalid(format!(
            "{}: the last dimension ({last}) must be a multiple of the block size {}",
            f.name(),
            f.block_values_for(last)
        )));
    }
    let bytes = py
        .detach(|| {
            let mut out =
                vec![0u8; sjkvarn::codec::format::encoded_len_rows(f, host.values.len(), last)?];
            sjkvarn::codec::format::encode_rows_frame(
                f,
                &host.values,
                last,
                rotated,
                &mut out,
                threads,
            )
            .map(|()| out)
        })
        .map_err(err)?;
    Ok(PyBytes::new(py, &bytes))
}

/// Decodes `blob` into `out` (a C-contiguous float32 CPU tensor whose size fixes the count).
#[pyfunction]
#[pyo3(signature = (format, blob, out, threads=None, rotated=false))]
fn decode_into(
    py: Python<'_>,
    format: &str,
    blob: &[u8],
    out: &Bound<'_, PyAny>,
    threads: Option<usize>,
    rotated: bool,
) -> PyResult<()> {
    let f = format_of(format)?;
    with_f32_out(out, "out", |values, shape| {
        let last = shape.last().copied().unwrap_or(0);
        py.detach(|| {
            sjkvarn::codec::format::decode_rows_frame(f, blob, last, rotated, values, threads)
        })
        .map_err(err)
    })
}

pub(crate) fn coding(name: &str) -> PyResult<BodyCoding> {
    name.parse().map_err(err)
}

/// The layer codec of a body: the reference format where it defines the coding, an extension
/// otherwise.
fn body_codec(
    head_dim: usize,
    k_bits: u32,
    v_bits: u32,
    k_body: &str,
    v_body: &str,
    balance: BalanceConfig,
) -> PyResult<BodyCodec> {
    let (k, v) = (coding(k_body)?, coding(v_body)?);
    BodyCodec::for_layer(head_dim, k_bits, v_bits, k, v, balance).map_err(err)
}

fn balance_config(passes: u32, mode: &str, stat: &str) -> PyResult<BalanceConfig> {
    let mode: BalanceMode = mode.parse().map_err(err)?;
    let stat: BalanceStat = stat.parse().map_err(err)?;
    let config = BalanceConfig { passes, mode, stat };
    config.validate().map_err(err)?;
    Ok(config)
}

/// `(record_bytes, metadata_bytes, bits_per_value)` of a body record: the reference layout for
/// 2..4-bit sides, the extension layout for 5/6/8-bit sides.
#[pyfunction]
fn body_layout(head_dim: usize, k_bits: u32, v_bits: u32) -> PyResult<(usize, usize, f64)> {
    if (2..=4).contains(&k_bits) && (2..=4).contains(&v_bits) {
        let l = sjkvarn::codec::RecordLayout::new(
            head_dim,
            sjkvarn::codec::GROUP,
            k_bits,
            v_bits,
            sjkvarn::codec::Body::Scalar,
        )
        .map_err(err)?;
        if !matches!(head_dim, 64 | 128 | 256 | 512) {
            return Err(err(sjkvarn::CodecError::UnsupportedHeadDim(head_dim)));
        }
        return Ok((l.bytes, l.bytes - l.k_scale, l.bits_per_value()));
    }
    let s = BodySpec::new(head_dim, k_bits, v_bits).map_err(err)?;
    Ok((s.record_bytes(), s.metadata_bytes(), s.bits_per_value()))
}

fn check_tiles(shape: &[usize], what: &str) -> PyResult<usize> {
    match shape {
        [.., g, d] if *g == GROUP => Ok(*d),
        _ => Err(invalid(format!(
            "{what}: expected shape [..., {GROUP}, head_dim] (tokens, channels), got {shape:?}"
        ))),
    }
}

/// Encodes K and V tiles `[..., 128, head_dim]` into one scalar body record per tile.
#[pyfunction]
#[pyo3(signature = (k, v, k_bits, v_bits, passes=16, mode="final", stat="std", rotated=false, threads=None, k_body="scalar", v_body="scalar"))]
#[allow(clippy::too_many_arguments)]
fn encode_body<'py>(
    py: Python<'py>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    k_bits: u32,
    v_bits: u32,
    passes: u32,
    mode: &str,
    stat: &str,
    rotated: bool,
    threads: Option<usize>,
    k_body: &str,
    v_body: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let config = balance_config(passes, mode, stat)?;
    let (kh, vh) = (read_f32(k, "k")?, read_f32(v, "v")?);
    let d = check_tiles(&kh.shape, "k")?;
    check_tiles(&vh.shape, "v")?;
    if kh.shape != vh.shape {
        return Err(invalid(format!(
            "k and v shapes differ: {:?} vs {:?}",
            kh.shape, vh.shape
        )));
    }
    let codec = body_codec(d, k_bits, v_bits, k_body, v_body, config)?;
    let bytes = py
        .detach(|| records::encode_records(&codec, &kh.values, &vh.values, rotated, threads))
        .map_err(err)?;
    Ok(PyBytes::new(py, &bytes))
}

/// Decodes records into float32 K and V outputs of shape `[..., 128, head_dim]`.
#[pyfunction]
#[pyo3(signature = (blob, k_out, v_out, k_bits, v_bits, rotated=false, threads=None, k_body="scalar", v_body="scalar", passes=16, mode="final", stat="std"))]
#[allow(clippy::too_many_arguments)]
fn decode_body_into(
    py: Python<'_>,
    blob: &[u8],
    k_out: &Bound<'_, PyAny>,
    v_out: &Bound<'_, PyAny>,
    k_bits: u32,
    v_bits: u32,
    rotated: bool,
    threads: Option<usize>,
    k_body: &str,
    v_body: &str,
    passes: u32,
    mode: &str,
    stat: &str,
) -> PyResult<()> {
    let config = balance_config(passes, mode, stat)?;
    with_f32_out(k_out, "k_out", |k, k_shape| {
        let d = check_tiles(k_shape, "k_out")?;
        with_f32_out(v_out, "v_out", |v, v_shape| {
            if k_shape != v_shape {
                return Err(invalid("k_out and v_out shapes differ"));
            }
            let (k_range, v_range) = (k.as_ptr_range(), v.as_ptr_range());
            if !k.is_empty() && k_range.start < v_range.end && v_range.start < k_range.end {
                return Err(invalid("k_out and v_out must not share memory"));
            }
            let codec = body_codec(d, k_bits, v_bits, k_body, v_body, config)?;
            py.detach(|| records::decode_records(&codec, blob, k, v, rotated, threads))
                .map_err(err)
        })
    })
}

/// Rotates every head vector of `x` in place (the whole head; last dimension 64, 128, 256 or
/// 512), as the cache rotates K, V and Q.
#[pyfunction]
fn rotate_inplace(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    with_f32_out(x, "x", |values, shape| {
        let d = shape.last().copied().unwrap_or(0);
        if !matches!(d, 64 | 128 | 256 | 512) {
            return Err(err(sjkvarn::CodecError::UnsupportedHeadDim(d)));
        }
        py.detach(|| sjkvarn::codec::rotation::rotate_heads(values, d))
            .map_err(err)
    })
}

/// The reference's trellis codebook for `bits` (2 or 3) of keys or values, as little-endian
/// float32 bytes (`2^(6+bits)` entries in units of the row step, indexed by the window).
#[pyfunction]
#[pyo3(signature = (bits, values=false))]
fn trellis_codebook<'py>(
    py: Python<'py>,
    bits: u32,
    values: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    if bits != 2 && bits != 3 {
        return Err(err(sjkvarn::CodecError::UnsupportedBits {
            what: "trellis codebook",
            bits,
            allowed: "2, 3",
        }));
    }
    let cb = sjkvarn::codec::trellis::codebook_f32(bits, values);
    let bytes: Vec<u8> = cb.iter().flat_map(|v| v.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &bytes))
}

/// Copies any supported CPU float tensor to row-major float32 bytes and its shape.
#[pyfunction]
fn to_float32<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyBytes>, Vec<usize>)> {
    let host = read_f32(x, "x")?;
    let bytes: Vec<u8> = host.values.iter().flat_map(|v| v.to_le_bytes()).collect();
    Ok((PyBytes::new(py, &bytes), host.shape))
}

/// Test hook: every seal record encode after the next `after` fails (`None` disarms). For the
/// tests that check a failed seal leaves a cache as it was, on the CPU and on a GPU; only in the
/// test build (`fault-injection` feature).
#[cfg(feature = "fault-injection")]
#[pyfunction]
#[pyo3(signature = (after))]
fn _inject_seal_failure(after: Option<usize>) {
    match after {
        Some(n) => sjkvarn::cache::faults::fail_seals_after(n),
        None => sjkvarn::cache::faults::clear(),
    }
}

/// The journal presets, stated once in the core: `{"default": {...}, "reference": {...}}`, each
/// with `min_tail`, `max_tail` and `staging` (`"K/V"` when keys and values differ).
#[pyfunction]
fn journal_presets(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    use sjkvarn::cache::{JournalPreset, DEFAULT_JOURNAL, REFERENCE_JOURNAL};
    let as_dict = |p: JournalPreset| -> PyResult<Bound<'_, pyo3::types::PyDict>> {
        let d = pyo3::types::PyDict::new(py);
        d.set_item("min_tail", p.min_tail)?;
        d.set_item("max_tail", p.max_tail)?;
        let staging = if p.k_staging == p.v_staging {
            p.k_staging.name().to_string()
        } else {
            format!("{}/{}", p.k_staging.name(), p.v_staging.name())
        };
        d.set_item("staging", staging)?;
        d.set_item("centre_keys", p.centre_keys)?;
        d.set_item("exact_recent", p.exact_recent)?;
        Ok(d)
    };
    let out = pyo3::types::PyDict::new(py);
    out.set_item("default", as_dict(DEFAULT_JOURNAL)?)?;
    out.set_item("reference", as_dict(REFERENCE_JOURNAL)?)?;
    Ok(out)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(journal_presets, m)?)?;
    errors::register(m)?;
    m.add_class::<cache::Cache>()?;
    m.add_function(wrap_pyfunction!(cuda::cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::compile_kernels, m)?)?;
    m.add("GROUP", GROUP)?;
    m.add_function(wrap_pyfunction!(formats, m)?)?;
    m.add_function(wrap_pyfunction!(encode, m)?)?;
    m.add_function(wrap_pyfunction!(decode_into, m)?)?;
    m.add_function(wrap_pyfunction!(body_layout, m)?)?;
    m.add_function(wrap_pyfunction!(encode_body, m)?)?;
    m.add_function(wrap_pyfunction!(decode_body_into, m)?)?;
    m.add_function(wrap_pyfunction!(rotate_inplace, m)?)?;
    m.add_function(wrap_pyfunction!(to_float32, m)?)?;
    m.add_function(wrap_pyfunction!(trellis_codebook, m)?)?;
    m.add_function(wrap_pyfunction!(paged::attend_paged, m)?)?;
    m.add_function(wrap_pyfunction!(paged::paged_check, m)?)?;
    m.add_function(wrap_pyfunction!(paged::paged_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(paged::paged_sequences_per_gib, m)?)?;
    m.add_class::<paged::PagedStep>()?;
    m.add_class::<paged::PagedJournal>()?;
    m.add_class::<paged::WindowJournal>()?;
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(_inject_seal_failure, m)?)?;
    m.add_class::<cache::CacheSpec>()?;
    Ok(())
}
