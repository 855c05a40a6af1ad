//! The device path's rollback: an append whose seals fail part-way and a `seal_idle` failing
//! in its second layer leave the device sequence byte-identical and the pool as it was. Needs
//! an NVIDIA GPU, so it is ignored by default (it shows as ignored, not passed); run it on a GPU
//! machine with `cargo test -p sjkvarn --features cuda --test cuda_faults -- --ignored`
//! (`benches/gpu/run.sh` does). Without a GPU the backend's refusal is checked by
//! `tests/cuda_probe.rs`. The fault is process-wide, so this binary has one test.
#![cfg(feature = "cuda")]

use sjkvarn::backend::cpu::faults;
use sjkvarn::backend::cuda::{DevicePool, DeviceSequence};
use sjkvarn::backend::Sequence;
use sjkvarn::journal::{CacheConfig, LayerCoding};
use sjkvarn::rng::SplitMix64;
use std::sync::Arc;

#[test]
#[ignore = "needs an NVIDIA GPU: cargo test -p sjkvarn --features cuda --test cuda_faults -- --ignored"]
fn failed_device_seals_change_nothing() {
    let mut c = CacheConfig::uniform(2, 4, 2, 64, LayerCoding::scalar(3, 2), 8192);
    c.min_tail = 256;
    c.max_tail = 512;
    c.max_chunk = 128;
    let cfg = Arc::new(c);
    // Run on purpose (`--ignored`): no GPU here is a failure, not a skip.
    let pool = DevicePool::for_config(0, &cfg, 2).expect("this test needs a CUDA device");
    let mut seq = DeviceSequence::new(cfg.clone(), pool.clone()).unwrap();
    let mut rng = SplitMix64::new(1);
    for layer in 0..2 {
        let (k, v) = (rng.gaussians(600 * 128), rng.gaussians(600 * 128));
        seq.append_host(layer, &k, &v).unwrap();
    }
    let (k, v) = (rng.gaussians(700 * 128), rng.gaussians(700 * 128));
    let host = |s: &DeviceSequence| {
        s.to_host(Sequence::pool_for(&cfg, 1))
            .unwrap()
            .snapshot_bytes()
            .unwrap()
    };
    let before = host(&seq);
    let used = pool.stats().used;
    for after in 0..8 {
        faults::fail_seals_after(after);
        let r = seq.append_host(0, &k, &v);
        faults::clear();
        let e = r.expect_err("the append needs more records than that");
        assert!(e.to_string().contains("injected"), "{e}");
        assert_eq!(
            host(&seq),
            before,
            "failure after {after} records changed it"
        );
        assert_eq!(
            pool.stats().used,
            used,
            "failure after {after} records leaked"
        );
    }
    faults::fail_seals_after(2); // layer 0's two records seal on the device, layer 1's fail
    assert!(seq.seal_idle(0).is_err());
    faults::clear();
    assert_eq!(host(&seq), before);
    assert_eq!(pool.stats().used, used);
    let mut twin = Sequence::from_snapshot(&before, None, None).unwrap();
    seq.append_host(0, &k, &v).unwrap();
    twin.append(0, &k, &v).unwrap();
    assert_eq!(host(&seq), twin.snapshot_bytes().unwrap());
}
