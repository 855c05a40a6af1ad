//! Fault injection: a seal that fails part-way (an injected encode error, an exhausted pool)
//! leaves the sequence byte-identical to before, and a snapshot write that stops part-way never
//! replaces a good file. The faults are process-wide, so this binary runs its cases in order.

use sjkvarn::backend::cpu::faults;
use sjkvarn::backend::{RecordPool, Sequence};
use sjkvarn::error::CacheError;
use sjkvarn::journal::{CacheConfig, LayerCoding};
use sjkvarn::rng::SplitMix64;
use sjkvarn::Journal;
use std::sync::{Arc, Mutex};

static SERIAL: Mutex<()> = Mutex::new(());

fn config() -> Arc<CacheConfig> {
    let mut c = CacheConfig::uniform(2, 4, 2, 64, LayerCoding::scalar(3, 2), 8192);
    c.min_tail = 256;
    c.max_tail = 512;
    c.max_chunk = 128;
    Arc::new(c)
}

fn tokens(rng: &mut SplitMix64, n: usize) -> (Vec<f32>, Vec<f32>) {
    (rng.gaussians(n * 2 * 64), rng.gaussians(n * 2 * 64))
}

#[test]
fn failed_seals_change_nothing() {
    let _guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = config();
    let pool = Sequence::pool_for(&cfg, 2);
    let mut seq = Sequence::new(cfg.clone(), pool.clone()).unwrap();
    let mut rng = SplitMix64::new(1);
    for layer in 0..2 {
        let (k, v) = tokens(&mut rng, 600);
        seq.append(layer, &k, &v).unwrap();
    }
    // A 700-token append runs several seals (chunks of 128 against a 512-token tail).
    let (k, v) = tokens(&mut rng, 700);
    let before = seq.snapshot_bytes().unwrap();
    let used = pool.stats().used;
    let mut failures = 0;
    for after in 0..8 {
        faults::fail_seals_after(after);
        let r = seq.append(0, &k, &v);
        faults::clear();
        match r {
            Err(CacheError::InvalidConfig(m)) if m.contains("injected") => failures += 1,
            Err(e) => panic!("unexpected error {e}"),
            Ok(()) => panic!("the append needs more than {after} records"),
        }
        assert_eq!(
            seq.snapshot_bytes().unwrap(),
            before,
            "failure after {after} records changed it"
        );
        assert_eq!(
            pool.stats().used,
            used,
            "failure after {after} records leaked slots"
        );
    }
    assert_eq!(failures, 8);
    // seal_idle failing part-way (layer 0 encoded, layer 1 failing) changes nothing either.
    faults::fail_seals_after(1);
    assert!(seq.seal_idle(0).is_err());
    faults::clear();
    assert_eq!(seq.snapshot_bytes().unwrap(), before);
    // Disarmed, the same append gives the bytes of a sequence that never failed.
    let mut twin = Sequence::from_snapshot(&before, None, None).unwrap();
    seq.append(0, &k, &v).unwrap();
    twin.append(0, &k, &v).unwrap();
    assert_eq!(
        seq.snapshot_bytes().unwrap(),
        twin.snapshot_bytes().unwrap()
    );
}

#[test]
fn exhausted_pool_mid_plan_changes_nothing() {
    let _guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let cfg = config();
    // Room for exactly two sealed groups.
    let pool = RecordPool::new(cfg.slot_bytes(), 2);
    let mut seq = Sequence::new(cfg.clone(), pool.clone()).unwrap();
    let mut rng = SplitMix64::new(2);
    let (k, v) = tokens(&mut rng, 600);
    seq.append(0, &k, &v).unwrap();
    let before = seq.snapshot_bytes().unwrap();
    let (k, v) = tokens(&mut rng, 900);
    assert!(matches!(
        seq.append(0, &k, &v),
        Err(CacheError::PoolExhausted { .. })
    ));
    assert_eq!(seq.snapshot_bytes().unwrap(), before);
    assert_eq!(pool.stats().used, seq.sealed_groups(0).unwrap());
}

#[test]
fn interrupted_snapshot_never_replaces_a_good_file() {
    let _guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = std::env::temp_dir().join(format!("sjkvarn-faults-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("seq.sjkv");
    let cfg = config();
    let mut seq = Sequence::new(cfg.clone(), Sequence::pool_for(&cfg, 1)).unwrap();
    let mut rng = SplitMix64::new(3);
    let (k, v) = tokens(&mut rng, 700);
    seq.append(0, &k, &v).unwrap();
    seq.save(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let (k, v) = tokens(&mut rng, 50);
    seq.append(1, &k, &v).unwrap();
    let newer = seq.snapshot_bytes().unwrap();
    for cut in [0, 1, 27, good.len() / 2, newer.len() - 1] {
        faults::fail_snapshot_write_after(cut);
        assert!(matches!(seq.save(&path), Err(CacheError::Io { .. })));
        faults::clear();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            good,
            "cut at {cut} replaced the file"
        );
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != "seq.sjkv")
            .collect();
        assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
        Sequence::load(&path, None, None).unwrap();
    }
    seq.save(&path).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), newer);
    std::fs::remove_dir_all(&dir).unwrap();
}
