//! Host builds of the CUDA kernels' lane functions (`cuda/*.cuh`), for testing them against the
//! Rust reference on machines without a GPU. Each wrapper runs the same code a kernel block runs,
//! with one lane.

use sjkvarn::cache::{CacheConfig, LayerImage};
use sjkvarn::kernel_abi::{KernelBalance, KernelLayerView};

mod ffi {
    use sjkvarn::kernel_abi::{KernelBalance, KernelLayerView};
    extern "C" {
        pub fn sj_host_f32_to_f16(x: f32) -> u16;
        pub fn sj_host_f16_to_f32(h: u16) -> f32;
        pub fn sj_host_pack(codes: *const u8, n: u32, bits: u32, out: *mut u8);
        pub fn sj_host_fwht(x: *mut f32, n: i32);
        pub fn sj_host_stage_row(
            row: *mut f32,
            head_dim: i32,
            table: *const f32,
            out: *mut u8,
        ) -> i32;
        pub fn sj_host_seal_group(
            view: *const KernelLayerView,
            g: i32,
            h: i32,
            cfg: *const KernelBalance,
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
        pub fn sj_host_sizeof_balance() -> i32;
        pub fn sj_host_seal_scratch_bytes(width: i32) -> i32;
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

/// `sj_pack_lanes` into a new buffer.
pub fn pack(codes: &[u8], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; sjkvarn::bitpack::packed_len(codes.len(), bits)];
    // SAFETY: `out` holds packed_len(n, bits) bytes, which is all the function writes.
    unsafe { ffi::sj_host_pack(codes.as_ptr(), codes.len() as u32, bits, out.as_mut_ptr()) };
    out
}

/// `sj_fwht_lanes` in place (`x.len()` a power of two).
pub fn fwht(x: &mut [f32]) {
    assert!(x.len().is_power_of_two());
    // SAFETY: the function touches x[0..n) only.
    unsafe { ffi::sj_host_fwht(x.as_mut_ptr(), x.len() as i32) };
}

/// `sj_stage_row_lanes`: rotates a model-frame row and codes it as a tq6_0 ring row.
pub fn stage_row(row: &[f32]) -> (Vec<u8>, i32) {
    let d = row.len();
    let codec = sjkvarn::cache::staging::RowCodec::new(sjkvarn::cache::Staging::Tq6, d);
    let mut out = vec![0u8; codec.row_bytes()];
    let mut work = row.to_vec();
    let table = sjkvarn::lloyd_max::gaussian_table(6).expect("6-bit table ships");
    // SAFETY: `work` holds head_dim floats, `out` the row's bytes, `table` 64 floats.
    let status = unsafe {
        ffi::sj_host_stage_row(
            work.as_mut_ptr(),
            d as i32,
            table.as_ptr(),
            out.as_mut_ptr(),
        )
    };
    (out, status)
}

/// A layer image with the view the kernels would get over it (addresses into the image).
pub struct HostLayer<'a> {
    pub view: KernelLayerView,
    _image: &'a LayerImage,
    _blocks: Vec<u32>,
}

impl<'a> HostLayer<'a> {
    pub fn new(config: &CacheConfig, layer: usize, image: &'a LayerImage) -> Self {
        let spec = config.body_spec(layer);
        let blocks: Vec<u32> = (0..image.sealed as u32).collect();
        let mut view = KernelLayerView::describe(config, layer, image.len, image.sealed);
        let codebook = |bits: u32, coded: bool| {
            if coded {
                sjkvarn::trellis::shipped(bits)
                    .map(|cb| cb.values().as_ptr() as u64)
                    .unwrap_or(0)
            } else {
                0
            }
        };
        view.sink_k = image.sink_k.as_ptr() as u64;
        view.sink_v = image.sink_v.as_ptr() as u64;
        view.ring = image.ring.as_ptr() as u64;
        view.pool = image.records.as_ptr() as u64;
        view.blocks = blocks.as_ptr() as u64;
        view.tq_table = sjkvarn::lloyd_max::gaussian_table(6)
            .expect("6-bit table ships")
            .as_ptr() as u64;
        view.k_codebook = codebook(spec.k_bits, view.k_coding != 0);
        view.v_codebook = codebook(spec.v_bits, view.v_coding != 0);
        Self {
            view,
            _image: image,
            _blocks: blocks,
        }
    }

    /// `sj_seal` for every half of group `g`, KV head `h`: the group must still be in
    /// the ring (not sealed yet, every token appended).
    pub fn seal_group(&self, g: usize, h: usize, balance: &KernelBalance) -> (Vec<u8>, i32) {
        let in_ring = g >= self.view.sealed as usize
            && sjkvarn::cache::SINK + (g + 1) * sjkvarn::GROUP <= self.view.len as usize;
        assert!(in_ring && h < self.view.kv_heads as usize);
        let mut out = vec![0u8; self.view.rec.record_bytes as usize];
        // SAFETY: the view points into the borrowed image and `_blocks`, which outlive the call;
        // the group's ring rows lie inside the ring; `out` holds one record.
        let status = unsafe {
            ffi::sj_host_seal_group(&self.view, g as i32, h as i32, balance, out.as_mut_ptr())
        };
        (out, status)
    }

    /// `sj_attend_gs*` over `splits` splits and `sj_attend_merge`, for query rows at positions
    /// `len - rows ..`; `None` when no kernel exists for the query group size.
    pub fn attend(&self, q: &[f32], q_heads: usize, scale: f32, splits: usize) -> Option<Vec<f32>> {
        let d = self.view.head_dim as usize;
        let rows = q.len() / (q_heads * d);
        assert!(rows >= 1 && rows <= self.view.len as usize && splits >= 1);
        let mut out = vec![0.0f32; q.len()];
        let base = self.view.len - rows as i32;
        // SAFETY: the view points into live host buffers; q and out hold rows*q_heads*d floats.
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

/// Sizes of the C structs (view, record layout, balance settings).
pub fn c_struct_sizes() -> (usize, usize, usize) {
    // SAFETY: constant functions.
    unsafe {
        (
            ffi::sj_host_sizeof_view() as usize,
            ffi::sj_host_sizeof_record_layout() as usize,
            ffi::sj_host_sizeof_balance() as usize,
        )
    }
}

/// `sj_seal_scratch_bytes(width)` as the C compiler computes it.
pub fn c_seal_scratch_bytes(width: usize) -> usize {
    // SAFETY: pure function.
    unsafe { ffi::sj_host_seal_scratch_bytes(width as i32) as usize }
}

/// `sj_attend_scratch_floats(gs)` as the C compiler computes it.
pub fn c_attend_scratch_floats(gs: usize) -> usize {
    // SAFETY: pure function.
    unsafe { ffi::sj_host_attend_scratch_floats(gs as i32) as usize }
}
