//! Time to seal one Qwen3.8-27B-shaped batch on the CPU: 16 layers x 4 KV heads x 32 groups,
//! K and V tiles of 128 x 256 (2,048 records), for the scalar 4/4 body and the trellis 3/3t and
//! 3/2t bodies, on both cores (2 threads; the scalar arm also on 1). Tiles are synthetic (Gaussian with a few loud channels).
//!
//! Run: `cargo bench -p sjkvarn --bench seal_batch`

use sjkvarn::codec::extension::body::{BodyCoding, TrellisAxis, GROUP};
use sjkvarn::codec::extension::records::encode_records;
use sjkvarn::codec::BodyCodec;
use sjkvarn::rng::SplitMix64;
use sjkvarn::BalanceConfig;
use std::time::Instant;

fn main() {
    let (layers, heads, groups, d) = (16usize, 4usize, 32usize, 256usize);
    let records = layers * heads * groups;
    let mut rng = SplitMix64::new(27);
    let mut tiles = |loud: f32| -> Vec<f32> {
        let mut x = rng.gaussians(records * GROUP * d);
        for (i, v) in x.iter_mut().enumerate() {
            if i % d < 4 {
                *v *= loud;
            }
        }
        x
    };
    let (k, v) = (tiles(12.0), tiles(1.0));
    let trellis = BodyCoding::Trellis(TrellisAxis::Token);
    let arms = [
        ("4/4 scalar", 4, 4, BodyCoding::Scalar, BodyCoding::Scalar),
        ("3/3t", 3, 3, trellis, trellis),
        ("3/2t", 3, 2, trellis, trellis),
    ];
    println!("sealing {records} records (K and V tiles of {GROUP}x{d}) = one Qwen3.8-27B batch");
    for (name, kb, vb, kc, vc) in arms {
        let codec = BodyCodec::for_layer(d, kb, vb, kc, vc, BalanceConfig::default()).unwrap();
        let threads_to_try: &[usize] = if kc == BodyCoding::Scalar {
            &[1, 2]
        } else {
            &[2]
        };
        for &threads in threads_to_try {
            let start = Instant::now();
            let out = encode_records(&codec, &k, &v, true, Some(threads)).unwrap();
            let secs = start.elapsed().as_secs_f64();
            println!(
                "{name:>10}, {threads} thread(s): {secs:6.2} s ({:.0} records/s, {} MiB written)",
                records as f64 / secs,
                out.len() >> 20
            );
        }
    }
}
