//! Zero-copy access to numpy arrays and torch tensors through the DLPack protocol.
//!
//! We call the producer's `__dlpack__()`, read the `DLManagedTensor` behind the returned capsule
//! while holding the capsule, and never rename it: the capsule's own destructor then hands the
//! tensor back to its producer when we drop it, as the protocol allows for an unconsumed capsule.

use crate::errors::{invalid, unsupported_type};
use pyo3::prelude::*;
use std::ffi::c_void;

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

const DL_CPU: i32 = 1;
const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;

fn device_name(device_type: i32) -> &'static str {
    match device_type {
        1 => "cpu",
        2 => "cuda",
        3 => "cuda pinned host",
        4 => "opencl",
        7 => "vulkan",
        8 => "metal",
        10 => "rocm",
        _ => "an unknown device",
    }
}

fn dtype_name(dt: DlDataType) -> String {
    let kind = match dt.code {
        DL_INT => "int",
        DL_UINT => "uint",
        DL_FLOAT => "float",
        DL_BFLOAT => "bfloat",
        5 => "complex",
        6 => "bool",
        _ => "unknown",
    };
    if dt.lanes == 1 {
        format!("{kind}{}", dt.bits)
    } else {
        format!("{kind}{}x{}", dt.bits, dt.lanes)
    }
}

/// A borrowed view of a CPU tensor; valid while `_capsule` lives.
struct View<'py> {
    _capsule: Bound<'py, PyAny>,
    data: *mut u8,
    dtype: DlDataType,
    shape: Vec<usize>,
    /// Strides in elements, always filled in (compact row-major when the producer gave none).
    strides: Vec<isize>,
    device_id: i32,
}

fn compact_strides(shape: &[usize]) -> Vec<isize> {
    let mut strides = vec![1isize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1) as isize;
    }
    strides
}

impl<'py> View<'py> {
    fn of(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        Self::open(obj, what, DL_CPU)
    }

    /// Opens `obj`'s DLPack capsule; the tensor must live on `device_type`.
    fn open(obj: &Bound<'py, PyAny>, what: &str, device_type: i32) -> PyResult<Self> {
        if !obj.hasattr("__dlpack__")? {
            return Err(unsupported_type(format!(
                "{what}: expected a numpy array or torch tensor (an object with __dlpack__), got {}",
                obj.get_type().name()?
            )));
        }
        let capsule = obj.call_method0("__dlpack__")?;
        // SAFETY: PyCapsule_GetPointer checks that `capsule` is a capsule named "dltensor" and
        // returns null with a Python error set otherwise; the pointer stays valid while we hold
        // the capsule, which we keep inside the returned view.
        let managed = unsafe {
            pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr())
                as *const DlManagedTensor
        };
        if managed.is_null() {
            return Err(PyErr::take(obj.py()).unwrap_or_else(|| {
                unsupported_type(format!(
                    "{what}: __dlpack__ did not return a DLPack capsule"
                ))
            }));
        }
        // SAFETY: non-null pointer to the producer's DLManagedTensor, alive with the capsule.
        let t = unsafe { &(*managed).dl_tensor };
        if t.device.device_type != device_type {
            return Err(invalid(format!(
                "{what}: tensor is on {} (device {}); this call needs a {} tensor",
                device_name(t.device.device_type),
                t.device.device_id,
                device_name(device_type)
            )));
        }
        let ndim =
            usize::try_from(t.ndim).map_err(|_| invalid(format!("{what}: negative ndim")))?;
        // SAFETY: DLPack guarantees `shape` has `ndim` entries and `strides` is null or has `ndim`.
        let shape_raw = if ndim == 0 {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(t.shape, ndim) }
        };
        let shape: Vec<usize> = shape_raw
            .iter()
            .map(|&s| {
                usize::try_from(s).map_err(|_| invalid(format!("{what}: negative dimension {s}")))
            })
            .collect::<PyResult<_>>()?;
        let strides = if t.strides.is_null() || ndim == 0 {
            compact_strides(&shape)
        } else {
            // SAFETY: see above.
            unsafe { std::slice::from_raw_parts(t.strides, ndim) }
                .iter()
                .map(|&s| s as isize)
                .collect()
        };
        // SAFETY: data + byte_offset is the start of the tensor's storage per the DLPack contract.
        let data = unsafe { (t.data as *mut u8).add(t.byte_offset as usize) };
        Ok(Self {
            _capsule: capsule,
            data,
            dtype: t.dtype,
            shape,
            strides,
            device_id: t.device.device_id,
        })
    }

    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    fn is_compact(&self) -> bool {
        self.shape
            .iter()
            .zip(self.strides.iter().zip(compact_strides(&self.shape)))
            .all(|(&n, (&s, c))| n <= 1 || s == c)
    }

    /// Element offsets in row-major order.
    fn offsets(&self) -> Vec<isize> {
        let mut out = Vec::with_capacity(self.len());
        if self.len() == 0 {
            return out;
        }
        let nd = self.shape.len();
        let mut idx = vec![0usize; nd];
        let mut offset = 0isize;
        loop {
            out.push(offset);
            let mut d = nd;
            loop {
                if d == 0 {
                    return out;
                }
                d -= 1;
                idx[d] += 1;
                offset += self.strides[d];
                if idx[d] < self.shape[d] {
                    break;
                }
                offset -= self.strides[d] * self.shape[d] as isize;
                idx[d] = 0;
            }
        }
    }
}

/// A float tensor copied to f32 (the conversion is needed anyway for fp16/bf16 inputs).
pub struct HostArray {
    pub values: Vec<f32>,
    pub shape: Vec<usize>,
}

/// Reads a CPU float tensor of any layout as row-major f32.
pub fn read_f32(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<HostArray> {
    let view = View::of(obj, what)?;
    let dt = view.dtype;
    let convert: fn(*const u8) -> f32 = match (dt.code, dt.bits, dt.lanes) {
        // SAFETY (all four): `p` points at one element of the stated type inside the tensor;
        // unaligned reads because DLPack does not promise alignment after byte_offset.
        (DL_FLOAT, 32, 1) => |p| unsafe { (p as *const f32).read_unaligned() },
        (DL_FLOAT, 64, 1) => |p| unsafe { (p as *const f64).read_unaligned() as f32 },
        (DL_FLOAT, 16, 1) => {
            |p| half::f16::from_bits(unsafe { (p as *const u16).read_unaligned() }).to_f32()
        }
        (DL_BFLOAT, 16, 1) => {
            |p| half::bf16::from_bits(unsafe { (p as *const u16).read_unaligned() }).to_f32()
        }
        _ => {
            return Err(unsupported_type(format!(
                "{what}: dtype {} is not supported; use float32, float16, bfloat16 or float64",
                dtype_name(dt)
            )))
        }
    };
    let size = dt.bits as isize / 8;
    let values = if view.is_compact() {
        (0..view.len() as isize)
            // SAFETY: compact layout: element i lives at data + i * size, within the tensor.
            .map(|i| convert(unsafe { view.data.offset(i * size) }))
            .collect()
    } else {
        view.offsets()
            .into_iter()
            // SAFETY: offsets follow the producer's own shape and strides.
            .map(|o| convert(unsafe { view.data.offset(o * size) }))
            .collect()
    };
    Ok(HostArray {
        values,
        shape: view.shape.clone(),
    })
}

/// Runs `work` on the memory of a compact, writable float32 CPU tensor.
pub fn with_f32_out<'py, T>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    work: impl FnOnce(&mut [f32], &[usize]) -> PyResult<T>,
) -> PyResult<T> {
    let view = View::of(obj, what)?;
    if (view.dtype.code, view.dtype.bits, view.dtype.lanes) != (DL_FLOAT, 32, 1) {
        return Err(unsupported_type(format!(
            "{what}: must be float32, got {}",
            dtype_name(view.dtype)
        )));
    }
    if !view.is_compact() {
        return Err(invalid(format!("{what}: must be C-contiguous")));
    }
    if view.len() > 0 && !(view.data as usize).is_multiple_of(std::mem::align_of::<f32>()) {
        return Err(invalid(format!("{what}: data is not 4-byte aligned")));
    }
    let len = view.len();
    let out: &mut [f32] = if len == 0 {
        &mut []
    } else {
        // SAFETY: compact, aligned float32 storage of `len` elements owned by the producer and
        // kept alive by the capsule in `view`; the caller passed it as an output, so we are the
        // only writer for the duration of `work`.
        unsafe { std::slice::from_raw_parts_mut(view.data as *mut f32, len) }
    };
    work(out, &view.shape.clone())
}

/// Runs `work` on the bytes of a compact CPU tensor of any dtype (pages of records), without
/// copying them; `shape` is the tensor's.
pub fn with_bytes<'py, T>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    work: impl FnOnce(&[u8], &[usize]) -> PyResult<T>,
) -> PyResult<T> {
    let view = View::of(obj, what)?;
    if !view.is_compact() {
        return Err(invalid(format!("{what}: must be C-contiguous")));
    }
    let bytes =
        view.len() * usize::from(view.dtype.bits).div_ceil(8) * usize::from(view.dtype.lanes);
    let data: &[u8] = if bytes == 0 {
        &[]
    } else {
        // SAFETY: compact storage of `bytes` bytes owned by the producer and kept alive by the
        // capsule in `view` for the duration of `work`; it is only read.
        unsafe { std::slice::from_raw_parts(view.data as *const u8, bytes) }
    };
    work(data, &view.shape.clone())
}

const DL_CUDA: i32 = 2;

/// A compact float32 CUDA tensor borrowed through DLPack: its device address stays valid while
/// this value (which holds the capsule) lives.
pub struct CudaF32<'py> {
    view: View<'py>,
}

impl CudaF32<'_> {
    pub fn ptr(&self) -> u64 {
        self.view.data as u64
    }

    pub fn shape(&self) -> &[usize] {
        &self.view.shape
    }

    pub fn device_id(&self) -> i32 {
        self.view.device_id
    }
}

/// Borrows a CUDA tensor that must be float32 and compact (the Python layer converts first).
pub fn cuda_f32<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<CudaF32<'py>> {
    if !obj.hasattr("__dlpack__")? {
        return Err(unsupported_type(format!(
            "{what}: expected a CUDA torch tensor, got {}",
            obj.get_type().name()?
        )));
    }
    let view = View::open(obj, what, DL_CUDA)?;
    if view.dtype.code != DL_FLOAT || view.dtype.bits != 32 || view.dtype.lanes != 1 {
        return Err(unsupported_type(format!(
            "{what}: expected float32, got {}",
            dtype_name(view.dtype)
        )));
    }
    if !view.is_compact() {
        return Err(invalid(format!(
            "{what}: the CUDA tensor must be contiguous"
        )));
    }
    Ok(CudaF32 { view })
}

/// An integer CPU tensor (block tables, slot mappings) copied to i64.
pub struct HostInts {
    pub values: Vec<i64>,
    pub shape: Vec<usize>,
}

/// Reads a CPU int32 or int64 tensor of any layout as row-major i64.
pub fn read_i64(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<HostInts> {
    let view = View::of(obj, what)?;
    let dt = view.dtype;
    let convert: fn(*const u8) -> i64 = match (dt.code, dt.bits, dt.lanes) {
        // SAFETY (both): `p` points at one element of the stated type inside the tensor;
        // unaligned reads because DLPack does not promise alignment after byte_offset.
        (DL_INT, 64, 1) => |p| unsafe { (p as *const i64).read_unaligned() },
        (DL_INT, 32, 1) => |p| i64::from(unsafe { (p as *const i32).read_unaligned() }),
        _ => {
            return Err(unsupported_type(format!(
                "{what}: dtype {} is not supported; use int32 or int64",
                dtype_name(dt)
            )))
        }
    };
    let size = dt.bits as isize / 8;
    let values = view
        .offsets()
        .into_iter()
        // SAFETY: offsets follow the producer's own shape and strides.
        .map(|o| convert(unsafe { view.data.offset(o * size) }))
        .collect();
    Ok(HostInts {
        values,
        shape: view.shape.clone(),
    })
}

/// Where the pages of a page tensor lie in its memory: `count` pages (the first dimension),
/// one every `stride` bytes, each compact; `shape_bytes` is the shape with the last dimension
/// counted in bytes.
pub struct PageSpan {
    pub count: usize,
    pub stride: usize,
    pub shape_bytes: Vec<usize>,
}

/// Runs `work` on the bytes of a CPU page tensor of any dtype, which it may write (seals), in
/// place. Every dimension but the first must be compact; the first may be padded (engines pad
/// window pages to a larger page).
pub fn with_pages_mut<'py, T>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    work: impl FnOnce(&mut [u8], PageSpan) -> PyResult<T>,
) -> PyResult<T> {
    let view = View::of(obj, what)?;
    let elem = usize::from(view.dtype.bits).div_ceil(8) * usize::from(view.dtype.lanes);
    let Some((&count, inner)) = view.shape.split_first() else {
        return Err(invalid(format!(
            "{what}: expected [pages, ...], got a scalar"
        )));
    };
    let page: usize = inner.iter().product();
    let compact_inner = inner
        .iter()
        .zip(view.strides[1..].iter().zip(compact_strides(inner)))
        .all(|(&n, (&s, c))| n <= 1 || s == c);
    let stride0 = if count <= 1 {
        page
    } else {
        view.strides[0].max(0) as usize
    };
    if !compact_inner || (count > 1 && stride0 < page) {
        return Err(invalid(format!(
            "{what}: each page must be C-contiguous and pages must not overlap (strides {:?})",
            view.strides
        )));
    }
    let mut shape_bytes = view.shape.clone();
    if let Some(last) = shape_bytes.last_mut() {
        *last *= elem;
    }
    let span = PageSpan {
        count,
        stride: stride0 * elem,
        shape_bytes,
    };
    let bytes = if count == 0 || page == 0 {
        0
    } else {
        ((count - 1) * stride0 + page) * elem
    };
    let data: &mut [u8] = if bytes == 0 {
        &mut []
    } else {
        // SAFETY: the tensor's pages lie within `bytes` bytes from its start (checked
        // strides), storage owned by the producer and kept alive by the capsule in `view` for
        // the duration of `work`; the caller hands the pages over to be written.
        unsafe { std::slice::from_raw_parts_mut(view.data, bytes) }
    };
    work(data, span)
}
