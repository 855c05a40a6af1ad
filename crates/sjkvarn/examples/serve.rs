//! A native server's use of the crate: one configuration, several sequences sharing a record
//! pool, prefill in seal-aligned chunks, decode steps, a fork, a speculative rollback with
//! `truncate`, and a snapshot round trip.
//!
//! Run: `cargo run --release -p sjkvarn --example serve`

use sjkvarn::body::{BodyCoding, TrellisAxis};
use sjkvarn::cache::attention::attend;
use sjkvarn::cache::{CacheConfig, LayerCoding, Sequence};
use sjkvarn::rng::SplitMix64;
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A small model: 4 layers, 8 query heads over 2 KV heads of 128, 3/2 trellis body with the
    // first and last layers at 4/4 (tiered edge layers), a scaled-down 512/1,024 tail.
    let trellis = BodyCoding::Trellis(TrellisAxis::Token);
    let middle = LayerCoding {
        k_bits: 3,
        v_bits: 2,
        k_coding: trellis,
        v_coding: trellis,
    };
    let mut config = CacheConfig::uniform(4, 8, 2, 128, middle, 4096);
    config.layer_coding[0] = LayerCoding::scalar(4, 4);
    config.layer_coding[3] = LayerCoding::scalar(4, 4);
    config.min_tail = 512;
    config.max_tail = 1024;
    config.max_chunk = 256;
    config.validate()?;
    let config = Arc::new(config);
    let pool = Sequence::pool_for(&config, 3);
    let (kvh, qh, d) = (config.kv_heads, config.q_heads, config.head_dim);
    let mut rng = SplitMix64::new(42);

    let mut requests: Vec<Sequence> = (0..2)
        .map(|_| Sequence::new(config.clone(), pool.clone()))
        .collect::<Result<_, _>>()?;
    for (i, seq) in requests.iter_mut().enumerate() {
        let prompt = 1500 + 300 * i;
        for layer in 0..config.layers {
            let mut done = 0;
            while done < prompt {
                let take = seq.chunk_limit(layer)?.min(prompt - done);
                seq.append(
                    layer,
                    &rng.gaussians(take * kvh * d),
                    &rng.gaussians(take * kvh * d),
                )?;
                attend(seq, layer, &rng.gaussians(take * qh * d), None)?;
                done += take;
            }
        }
        for _step in 0..16 {
            for layer in 0..config.layers {
                seq.append(layer, &rng.gaussians(kvh * d), &rng.gaussians(kvh * d))?;
                let out = attend(seq, layer, &rng.gaussians(qh * d), None)?;
                assert!(out.iter().all(|x| x.is_finite()));
            }
        }
        let m = seq.memory();
        let l = config.layers;
        println!(
            "request {i}: {} tokens per layer (sink {}, body {}, ring {}), {:.2} bits/value occupied",
            m.tokens,
            m.sink_tokens / l,
            m.sealed_tokens / l,
            m.ring_tokens / l,
            m.effective_bits
        );
    }

    // Beam/branch: fork shares the sealed prefix; speculative tokens are rolled back for free.
    let mut branch = requests[0].fork();
    let before = pool.stats().used;
    for layer in 0..config.layers {
        branch.append(
            layer,
            &rng.gaussians(4 * kvh * d),
            &rng.gaussians(4 * kvh * d),
        )?;
    }
    let len = branch.len(0)?;
    let back = branch.truncate(len - 3)?;
    println!(
        "fork: shared {before} slots, rejected 3 draft tokens, re-append from {back} (= {})",
        len - 3
    );

    // Snapshot and restore.
    let path = std::env::temp_dir().join(format!("sjkvarn-serve-{}.sjkv", std::process::id()));
    requests[1].save(&path)?;
    let restored = Sequence::load(&path, Some(pool.clone()), Some(&config))?;
    let q = rng.gaussians(qh * d);
    assert_eq!(
        attend(&requests[1], 2, &q, None)?,
        attend(&restored, 2, &q, None)?
    );
    std::fs::remove_file(&path)?;
    println!(
        "snapshot: {} bytes, restored and identical",
        requests[1].snapshot_bytes()?.len()
    );
    println!("pool: {:?}", pool.stats());
    Ok(())
}
