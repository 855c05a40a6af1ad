//! The CUDA backend on a machine that may have no CUDA at all: probing and construction must
//! return errors, never panic; with a GPU they must work.
#![cfg(feature = "cuda")]

use sjkvarn::backend::cuda::{availability, CudaError, DevicePool, DeviceSequence};
use sjkvarn::journal::{CacheConfig, LayerCoding};
use sjkvarn::Journal;
use std::sync::Arc;

#[test]
fn probing_never_panics_and_says_why() {
    match availability(0) {
        Ok(info) => assert!(!info.name.is_empty() && info.devices >= 1),
        Err(CudaError::Unavailable(why)) => assert!(!why.is_empty()),
        Err(other) => panic!("unexpected error kind: {other}"),
    }
    // A device index past the end is refused, not a panic.
    assert!(availability(1 << 20).is_err());
}

#[test]
fn device_cache_without_cuda_is_an_error() {
    let config = CacheConfig::uniform(1, 4, 2, 64, LayerCoding::scalar(4, 4), 4096);
    match DevicePool::for_config(0, &config, 1) {
        Ok(pool) => {
            // A GPU is here: the sequence must come up empty.
            let seq = DeviceSequence::new(Arc::new(config), pool).expect("device sequence");
            assert_eq!(seq.len(0).unwrap(), 0);
        }
        Err(e) => assert!(matches!(e, CudaError::Unavailable(_)), "{e}"),
    }
}
