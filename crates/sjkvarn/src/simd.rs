//! Run-time choice of the instruction set for the hot loops (attention, record and staging-row
//! reading): one binary, built for baseline x86-64 as the wheel is, that still uses the vector
//! units of the machine it runs on. AArch64 always has NEON, which the portable code uses.

/// The instruction sets the hot loops are compiled for, chosen once at run time. Every level computes the same operations in the same order (Rust never fuses `a * b + c`), so the
/// results are bit-identical across levels; `SJKVARN_SIMD=portable|avx2|avx512` forces a
/// lower level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Portable,
    Avx2,
    Avx512,
}

/// The level this process uses (detected once).
pub fn simd_level() -> SimdLevel {
    static LEVEL: std::sync::OnceLock<SimdLevel> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detected_level();
        match std::env::var("SJKVARN_SIMD").as_deref() {
            Ok("portable") => SimdLevel::Portable,
            Ok("avx2") => detected.min(SimdLevel::Avx2),
            _ => detected,
        }
    })
}

/// The best level this CPU supports.
pub fn detected_level() -> SimdLevel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            return SimdLevel::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return SimdLevel::Avx2;
        }
    }
    SimdLevel::Portable
}

/// Whether the AVX-512 paths may run (the level is `Avx512`).
#[inline(always)]
pub fn avx512() -> bool {
    simd_level() == SimdLevel::Avx512
}

/// Whether the AVX-512 level may also use VNNI byte dot products (`vpdpbusd`): the body
/// records' 4-bit sides are scored with them. Without VNNI they take the portable integer loop,
/// which gives the same bits.
#[inline(always)]
pub fn avx512_vnni() -> bool {
    static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    avx512() && *VNNI.get_or_init(|| has_feature("avx512vnni"))
}

/// Whether the AVX-512 level may also use VBMI byte permutes and multishifts (`vpermb`,
/// `vpmultishiftqb`): the `tq6_0` ring rows unpack with them. Without VBMI they take the
/// 16-at-a-time unpack, which gives the same values.
#[inline(always)]
pub fn avx512_vbmi() -> bool {
    static VBMI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    avx512() && *VBMI.get_or_init(|| has_feature("avx512vbmi"))
}

/// Run-time detection of one of the AVX-512 extensions above.
fn has_feature(name: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match name {
            "avx512vnni" => std::arch::is_x86_feature_detected!("avx512vnni"),
            "avx512vbmi" => std::arch::is_x86_feature_detected!("avx512vbmi"),
            _ => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = name;
        false
    }
}

/// Asks the CPU to bring `bytes` into its L2 cache ahead of use (a hint: no effect on results,
/// nothing on targets without a prefetch instruction here). Attention calls it for the next
/// record while it scores the current one, whose first reads otherwise wait on memory.
#[inline(always)]
pub fn prefetch_l2(bytes: &[u8]) {
    let mut ahead = Ahead::new(bytes);
    ahead.finish();
}

/// A slice prefetched into L2 a line at a time, interleaved with other work: a burst of
/// prefetches stalls once the core's line-fill buffers are full, while one line per step of
/// a compute loop overlaps with it.
pub struct Ahead<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Ahead<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    /// Prefetches the next line, if any is left.
    #[inline(always)]
    pub fn step(&mut self) {
        if self.at < self.bytes.len() {
            prefetch_line(&self.bytes[self.at..]);
            self.at += 64;
        }
    }

    /// Prefetches every line not yet asked for.
    #[inline(always)]
    pub fn finish(&mut self) {
        while self.at < self.bytes.len() {
            self.step();
        }
    }
}

/// Hints the cache line holding `bytes[0]` into L2.
#[inline(always)]
fn prefetch_line(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the cache; the pointer is into a live, non-empty slice.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
            bytes.as_ptr() as *const i8
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}
