//! Fault injection for the reliability tests: make the n-th record encode of a seal fail, or a
//! snapshot write stop after n bytes, to check that failures leave the cache and files as they
//! were. Only in builds with the `fault-injection` feature (this crate's tests and the Python
//! test build); elsewhere the checks are empty and the arming functions do not exist.
//! Process-wide and off until armed (one relaxed atomic load per record and per save); tests
//! that arm them run in their own test binary.

#[cfg(feature = "fault-injection")]
use crate::error::CacheError;
use crate::error::CacheResult;
#[cfg(feature = "fault-injection")]
use std::sync::atomic::{AtomicI64, Ordering};

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn check_record() -> CacheResult<()> {
    Ok(())
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn take_snapshot_limit() -> Option<usize> {
    None
}

#[cfg(feature = "fault-injection")]
pub use armed::*;

#[cfg(feature = "fault-injection")]
mod armed {
    use super::*;

    static SEAL_RECORDS_LEFT: AtomicI64 = AtomicI64::new(-1);
    static SNAPSHOT_BYTES_LEFT: AtomicI64 = AtomicI64::new(-1);

    /// After `records` more records have been encoded, every further record encode fails.
    pub fn fail_seals_after(records: usize) {
        SEAL_RECORDS_LEFT.store(records as i64, Ordering::SeqCst);
    }

    /// The next snapshot save writes `bytes` bytes of its temporary file, then fails as if the
    /// process had died there.
    pub fn fail_snapshot_write_after(bytes: usize) {
        SNAPSHOT_BYTES_LEFT.store(bytes as i64, Ordering::SeqCst);
    }

    /// Disarms every fault.
    pub fn clear() {
        SEAL_RECORDS_LEFT.store(-1, Ordering::SeqCst);
        SNAPSHOT_BYTES_LEFT.store(-1, Ordering::SeqCst);
    }

    pub(crate) fn check_record() -> CacheResult<()> {
        if SEAL_RECORDS_LEFT.load(Ordering::Relaxed) < 0 {
            return Ok(());
        }
        let left = SEAL_RECORDS_LEFT.fetch_sub(1, Ordering::SeqCst);
        if left <= 0 {
            SEAL_RECORDS_LEFT.store(0, Ordering::SeqCst);
            return Err(CacheError::InvalidConfig("injected seal failure".into()));
        }
        Ok(())
    }

    /// How many bytes the next snapshot write may write before failing (`None`: no fault).
    pub(crate) fn take_snapshot_limit() -> Option<usize> {
        let left = SNAPSHOT_BYTES_LEFT.swap(-1, Ordering::SeqCst);
        (left >= 0).then_some(left as usize)
    }
}
