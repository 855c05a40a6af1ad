//! Host builds of the CUDA kernels' lane functions (`crates/sjkvarn/cuda/*.cuh`), for testing them against the
//! Rust reference (`sjkvarn::codec`) on machines without a GPU. Each wrapper runs the same code a
//! kernel block runs, with one lane.

use sjkvarn::codec::{Body, RecordLayout};
use sjkvarn::kernel_abi::{codebook_f32, tq6_tables, KernelLayerView, KernelRecordLayout};

mod ffi {
    use sjkvarn::kernel_abi::{KernelLayerView, KernelRecordLayout};
    extern "C" {
        pub fn sj_host_f32_to_f16(x: f32) -> u16;
        pub fn sj_host_f16_to_f32(h: u16) -> f32;
        pub fn sj_host_pack(codes: *const u8, n: u32, bits: u32, out: *mut u8);
        pub fn sj_host_fwht(x: *mut f32, n: i32);
        pub fn sj_host_stage_row(
            row: *mut f32,
            head_dim: i32,
            tables: *const f32,
            out: *mut u8,
        ) -> i32;
        pub fn sj_host_tq_row(
            row: *const f32,
            head_dim: i32,
            tables: *const f32,
            out: *mut u8,
        ) -> i32;
        pub fn sj_host_tq_row_value(
            row: *const u8,
            head_dim: i32,
            tables: *const f32,
            c: i32,
        ) -> f32;
        pub fn sj_host_record_layout(
            head_dim: i32,
            bits_k: i32,
            bits_v: i32,
            body: i32,
            out: *mut KernelRecordLayout,
        );
        pub fn sj_host_code_bit(l: *const KernelRecordLayout, t: i32, d: i32, is_v: i32) -> i32;
        pub fn sj_host_k_slot(l: *const KernelRecordLayout, d: i32) -> i32;
        pub fn sj_host_v_slot(l: *const KernelRecordLayout, d: i32) -> i32;
        pub fn sj_host_record_q(
            l: *const KernelRecordLayout,
            rec: *const u8,
            cb: *const f32,
            t: i32,
            d: i32,
            is_v: i32,
        ) -> f32;
        #[allow(clippy::too_many_arguments)]
        pub fn sj_host_seal_record(
            l: *const KernelRecordLayout,
            k: *const u16,
            v: *const u16,
            stride: i32,
            iters: i32,
            cb_k: *const f32,
            cb_v: *const f32,
            out: *mut u8,
        ) -> i32;
        pub fn sj_host_seal_group(
            view: *const KernelLayerView,
            g: i32,
            h: i32,
            iters: i32,
            out: *mut u8,
        ) -> i32;
        #[allow(clippy::too_many_arguments)]
        pub fn sj_host_attend(
            view: *const KernelLayerView,
            q: *const f32,
            rows: i32,
            q_heads: i32,
            base: i32,
            scale: f32,
            splits: i32,
            out: *mut f32,
        ) -> i32;
        pub fn sj_host_sizeof_view() -> i32;
        pub fn sj_host_sizeof_record_layout() -> i32;
        pub fn sj_host_seal_scratch_bytes(head_dim: i32) -> i32;
        pub fn sj_host_attend_scratch_floats(gs: i32) -> i32;
    }
}

/// `sj_f32_to_f16`.
pub fn f32_to_f16(x: f32) -> u16 {
    // SAFETY: pure function of its argument.
    unsafe { ffi::sj_host_f32_to_f16(x) }
}

/// `sj_f16_to_f32`.
pub fn f16_to_f32(h: u16) -> f32 {
    // SAFETY: pure function of its argument.
    unsafe { ffi::sj_host_f16_to_f32(h) }
}

/// `sj_pack_lanes` (LSB-first stream order) into a new buffer.
pub fn pack(codes: &[u8], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; (codes.len() * bits as usize).div_ceil(8)];
    // SAFETY: `out` holds ceil(n * bits / 8) bytes, which is all the function writes.
    unsafe { ffi::sj_host_pack(codes.as_ptr(), codes.len() as u32, bits, out.as_mut_ptr()) };
    out
}

/// `sj_fwht_lanes` in place (`x.len()` a power of two).
pub fn fwht(x: &mut [f32]) {
    assert!(x.len().is_power_of_two());
    // SAFETY: the function touches x[0..n) only.
    unsafe { ffi::sj_host_fwht(x.as_mut_ptr(), x.len() as i32) };
}

/// Bytes of one staged `tq6_0` row of `d` values.
pub fn tq_row_bytes(d: usize) -> usize {
    sjkvarn::codec::tq6::row_bytes(d)
}

fn check_head_dim(d: usize) {
    assert!([64, 128, 256, 512].contains(&d), "head_dim {d}");
}

/// `sj_stage_row_lanes`: rotates a model-frame row and codes it as a `tq6_0` ring row.
pub fn stage_row(row: &[f32]) -> (Vec<u8>, i32) {
    let d = row.len();
    check_head_dim(d);
    let mut out = vec![0u8; tq_row_bytes(d)];
    let mut work = row.to_vec();
    let tables = tq6_tables(d);
    // SAFETY: `work` holds head_dim floats, `out` the row's bytes, `tables` 127 floats.
    let status = unsafe {
        ffi::sj_host_stage_row(
            work.as_mut_ptr(),
            d as i32,
            tables.as_ptr(),
            out.as_mut_ptr(),
        )
    };
    (out, status)
}

/// `sj_tq_row_lanes`: codes an already rotated row as a `tq6_0` ring row.
pub fn tq_row(row: &[f32]) -> (Vec<u8>, i32) {
    let d = row.len();
    check_head_dim(d);
    let mut out = vec![0u8; tq_row_bytes(d)];
    let tables = tq6_tables(d);
    // SAFETY: `row` holds head_dim floats, `out` the row's bytes, `tables` 127 floats.
    let status =
        unsafe { ffi::sj_host_tq_row(row.as_ptr(), d as i32, tables.as_ptr(), out.as_mut_ptr()) };
    (out, status)
}

/// `sj_tq_row_value` for every value of a staged row.
pub fn tq_row_values(row: &[u8], d: usize) -> Vec<f32> {
    check_head_dim(d);
    assert_eq!(row.len(), tq_row_bytes(d));
    let tables = tq6_tables(d);
    (0..d)
        // SAFETY: `row` holds one staged row of `d` values; `c < d`.
        .map(|c| unsafe {
            ffi::sj_host_tq_row_value(row.as_ptr(), d as i32, tables.as_ptr(), c as i32)
        })
        .collect()
}

/// `sj_record_layout` as the C code computes it.
pub fn c_record_layout(
    head_dim: usize,
    bits_k: u32,
    bits_v: u32,
    body: Body,
) -> KernelRecordLayout {
    let mut out = KernelRecordLayout::default();
    // SAFETY: writes one struct.
    unsafe {
        ffi::sj_host_record_layout(
            head_dim as i32,
            bits_k as i32,
            bits_v as i32,
            body as i32,
            &mut out,
        )
    };
    out
}

/// `sj_code_bit`, `sj_k_slot`, `sj_v_slot` of a layout.
pub fn c_code_bit(l: &KernelRecordLayout, t: usize, d: usize, is_v: bool) -> usize {
    // SAFETY: pure function of the layout.
    unsafe { ffi::sj_host_code_bit(l, t as i32, d as i32, is_v as i32) as usize }
}
pub fn c_k_slot(l: &KernelRecordLayout, d: usize) -> usize {
    // SAFETY: pure function of the layout.
    unsafe { ffi::sj_host_k_slot(l, d as i32) as usize }
}
pub fn c_v_slot(l: &KernelRecordLayout, d: usize) -> usize {
    // SAFETY: pure function of the layout.
    unsafe { ffi::sj_host_v_slot(l, d as i32) as usize }
}

/// The f32 codebooks of a layout's sides (empty for scalar bodies).
fn codebooks(l: &RecordLayout) -> [Vec<f32>; 2] {
    if l.body == Body::Trellis {
        [codebook_f32(l.bits_k, false), codebook_f32(l.bits_v, true)]
    } else {
        [Vec::new(), Vec::new()]
    }
}

fn ptr_or_null(v: &[f32]) -> *const f32 {
    if v.is_empty() {
        std::ptr::null()
    } else {
        v.as_ptr()
    }
}

/// `sj_record_q`: the code value of token `t`, channel `d` of a record.
pub fn record_q(l: &RecordLayout, rec: &[u8], t: usize, d: usize, is_v: bool) -> f32 {
    assert!(rec.len() == l.bytes && t < l.group && d < l.head_dim);
    let k = KernelRecordLayout::of(l);
    let cb = codebooks(l);
    // SAFETY: `rec` holds one record of layout `l`, `cb` the side's codebook for trellis bodies.
    unsafe {
        ffi::sj_host_record_q(
            &k,
            rec.as_ptr(),
            ptr_or_null(&cb[is_v as usize]),
            t as i32,
            d as i32,
            is_v as i32,
        )
    }
}

/// `sj_seal_record_lanes`: seals 128 rotated fp16 rows of K and V (row `t` at `t * stride`).
pub fn seal_record(
    l: &RecordLayout,
    k: &[u16],
    v: &[u16],
    stride: usize,
    iters: u32,
) -> (Vec<u8>, i32) {
    let need = (l.group - 1) * stride + l.head_dim;
    assert!(stride >= l.head_dim && k.len() >= need && v.len() >= need);
    let kl = KernelRecordLayout::of(l);
    let cb = codebooks(l);
    let mut out = vec![0u8; l.bytes];
    // SAFETY: the rows cover every index the seal reads (checked above), `out` holds one
    // record, the codebooks are the layout's (or null for scalar bodies, never read).
    let status = unsafe {
        ffi::sj_host_seal_record(
            &kl,
            k.as_ptr(),
            v.as_ptr(),
            stride as i32,
            iters as i32,
            ptr_or_null(&cb[0]),
            ptr_or_null(&cb[1]),
            out.as_mut_ptr(),
        )
    };
    (out, status)
}

/// The bytes of one layer of one sequence as the device keeps them, built by the caller (the
/// tests build them from `sjkvarn::codec` pieces). Records of sealed group `g` are in pool slot
/// `g` (`kv_heads` records per slot).
#[derive(Debug, Clone)]
pub struct LayerBytes {
    pub layout: RecordLayout,
    pub kv_heads: usize,
    pub len: usize,
    pub sealed: usize,
    /// `kernel_abi::STAGING_*`.
    pub staging: i32,
    pub row_bytes: usize,
    pub ring_rows: usize,
    /// `[128][kv_heads][head_dim]` rotated fp16.
    pub sink_k: Vec<u16>,
    pub sink_v: Vec<u16>,
    /// `[ring_rows][kv_heads][2][row_bytes]`.
    pub ring: Vec<u8>,
    /// `[sealed][kv_heads][record bytes]`.
    pub pool: Vec<u8>,
}

/// A layer's bytes with the view the kernels would get over them (addresses into the buffers,
/// which this struct owns and never resizes).
pub struct HostLayer {
    view: KernelLayerView,
    bytes: LayerBytes,
    _blocks: Vec<u32>,
    _tables: Vec<f32>,
    _cb: [Vec<f32>; 2],
}

impl HostLayer {
    pub fn new(bytes: LayerBytes) -> Self {
        let l = bytes.layout;
        let d = l.head_dim;
        check_head_dim(d);
        assert_eq!(bytes.sink_k.len(), 128 * bytes.kv_heads * d);
        assert_eq!(bytes.sink_v.len(), bytes.sink_k.len());
        assert_eq!(
            bytes.ring.len(),
            bytes.ring_rows * bytes.kv_heads * 2 * bytes.row_bytes
        );
        assert_eq!(bytes.pool.len(), bytes.sealed * bytes.kv_heads * l.bytes);
        assert!(bytes.len <= 128 + 128 * bytes.sealed + bytes.ring_rows);
        let blocks: Vec<u32> = (0..bytes.sealed as u32).collect();
        let tables = tq6_tables(d);
        let cb = codebooks(&l);
        let addr = |p: *const f32| p as u64;
        let view = KernelLayerView {
            sink_k: bytes.sink_k.as_ptr() as u64,
            sink_v: bytes.sink_v.as_ptr() as u64,
            ring: bytes.ring.as_ptr() as u64,
            pool: bytes.pool.as_ptr() as u64,
            blocks: blocks.as_ptr() as u64,
            tq_table: tables.as_ptr() as u64,
            k_codebook: addr(ptr_or_null(&cb[0])),
            v_codebook: addr(ptr_or_null(&cb[1])),
            slot_bytes: (bytes.kv_heads * l.bytes) as u64,
            len: bytes.len as i32,
            sealed: bytes.sealed as i32,
            kv_heads: bytes.kv_heads as i32,
            head_dim: d as i32,
            ring_rows: bytes.ring_rows as i32,
            row_bytes: bytes.row_bytes as i32,
            staging: bytes.staging,
            pad: 0,
            rec: KernelRecordLayout::of(&l),
        };
        Self {
            view,
            bytes,
            _blocks: blocks,
            _tables: tables,
            _cb: cb,
        }
    }

    pub fn view(&self) -> &KernelLayerView {
        &self.view
    }

    pub fn bytes(&self) -> &LayerBytes {
        &self.bytes
    }

    /// `sj_seal` for group `g`, KV head `h`: the group's rows must be in the ring (positions
    /// `128 + 128 g ..` below `len`).
    pub fn seal_group(&self, g: usize, h: usize, iters: u32) -> (Vec<u8>, i32) {
        assert!(128 + (g + 1) * 128 <= self.bytes.len && h < self.bytes.kv_heads);
        assert!(g >= self.bytes.sealed);
        let mut out = vec![0u8; self.bytes.layout.bytes];
        // SAFETY: the view points into buffers this struct owns; the group's ring rows lie
        // inside the ring (ring_rows >= the unsealed span, checked in `new`); `out` holds one
        // record.
        let status = unsafe {
            ffi::sj_host_seal_group(
                &self.view,
                g as i32,
                h as i32,
                iters as i32,
                out.as_mut_ptr(),
            )
        };
        (out, status)
    }

    /// `sj_attend_gs*` over `splits` splits and `sj_attend_merge`, for query rows at positions
    /// `len - rows ..`; `None` when no kernel exists for the query group size.
    pub fn attend(&self, q: &[f32], q_heads: usize, scale: f32, splits: usize) -> Option<Vec<f32>> {
        let d = self.view.head_dim as usize;
        let rows = q.len() / (q_heads * d);
        assert!(rows >= 1 && rows <= self.view.len as usize && splits >= 1);
        assert_eq!(q.len(), rows * q_heads * d);
        assert_eq!(q_heads % self.bytes.kv_heads, 0);
        let mut out = vec![0.0f32; q.len()];
        let base = self.view.len - rows as i32;
        // SAFETY: the view points into buffers this struct owns; q and out hold
        // rows * q_heads * d floats.
        let rc = unsafe {
            ffi::sj_host_attend(
                &self.view,
                q.as_ptr(),
                rows as i32,
                q_heads as i32,
                base,
                scale,
                splits as i32,
                out.as_mut_ptr(),
            )
        };
        (rc == 0).then_some(out)
    }
}

/// Sizes of the C structs (view, record layout).
pub fn c_struct_sizes() -> (usize, usize) {
    // SAFETY: constant functions.
    unsafe {
        (
            ffi::sj_host_sizeof_view() as usize,
            ffi::sj_host_sizeof_record_layout() as usize,
        )
    }
}

/// `sj_seal_scratch_bytes(head_dim)` as the C compiler computes it.
pub fn c_seal_scratch_bytes(head_dim: usize) -> usize {
    // SAFETY: pure function.
    unsafe { ffi::sj_host_seal_scratch_bytes(head_dim as i32) as usize }
}

/// `sj_attend_scratch_floats(gs)` as the C compiler computes it.
pub fn c_attend_scratch_floats(gs: usize) -> usize {
    // SAFETY: pure function.
    unsafe { ffi::sj_host_attend_scratch_floats(gs as i32) as usize }
}
