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

/// Asks the CPU to bring `bytes` into its L2 cache ahead of use (a hint: no effect on results,
/// nothing on targets without a prefetch instruction here). Attention calls it for the next
/// record while it scores the current one, whose first reads otherwise wait on memory.
#[inline(always)]
pub fn prefetch_l2(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch only hints the cache; `line` points into a live slice.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                line.as_ptr() as *const i8
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}
