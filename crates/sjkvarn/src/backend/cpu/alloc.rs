//! Allocations that fail with an error instead of aborting the process.

use crate::error::{CacheError, CacheResult};

/// `n` copies of `value`, or an out-of-memory error instead of an abort.
pub(crate) fn zeroed<T: Clone>(n: usize, value: T, what: &'static str) -> CacheResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| CacheError::OutOfMemory {
            what,
            bytes: n.saturating_mul(std::mem::size_of::<T>()),
        })?;
    v.resize(n, value);
    Ok(v)
}

/// `n` zero bytes, fallibly and lazily zeroed by the allocator (untouched ring rows cost no
/// resident memory, as with `vec![0; n]`).
pub(crate) fn zeroed_bytes(n: usize, what: &'static str) -> CacheResult<Vec<u8>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let oom = || CacheError::OutOfMemory { what, bytes: n };
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| oom())?;
    // SAFETY: the layout has a non-zero size (n > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(oom());
    }
    advise_huge_pages(ptr, n);
    // SAFETY: `ptr` comes from the global allocator with the layout of `[u8; n]`, and all `n`
    // bytes are initialised (zeroed); the Vec takes ownership and frees it with that layout.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// Asks Linux to back the whole 2 MiB pages inside a large, not yet touched allocation with
/// transparent huge pages (a hint; nothing changes if the kernel declines). Attention reads
/// one KV head's ring rows a whole position apart, a new 4 KiB page every few rows: with
/// small pages nearly every page costs a TLB miss, and a page walk is dear in a VM.
fn advise_huge_pages(ptr: *mut u8, n: usize) {
    const HUGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    if n >= 2 * HUGE {
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + n) / HUGE * HUGE;
        if end > start {
            // SAFETY: `[start, end)` lies inside the allocation of `n` bytes at `ptr`, which
            // this process owns; MADV_HUGEPAGE changes no contents and no access rights.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    let _ = (ptr, n, HUGE);
}

/// A zeroed ring of `n` bytes (see [`zeroed_bytes`]).
pub(crate) fn zeroed_ring(n: usize) -> CacheResult<Vec<u8>> {
    zeroed_bytes(n, "staging ring")
}
