//! Trains the trellis codebooks (generalized Lloyd on seeded N(0,1) runs) and writes them to
//! `crates/sjkvarn/data/trellis_{2,3,4}bit.bin`, or checks the shipped files are reproduced.
//!
//! Usage: `cargo run --release -p sjkvarn --bin sjkvarn-train-trellis -- [--check] [--bits B]...`

use sjkvarn::trellis_train::{gaussian_runs, mse, train, TrainConfig};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let check = args.iter().any(|a| a == "--check");
    let mut bits: Vec<u32> = args
        .windows(2)
        .filter(|w| w[0] == "--bits")
        .filter_map(|w| w[1].parse().ok())
        .collect();
    if bits.is_empty() {
        bits = vec![2, 3, 4];
    }
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/data");
    let mut failed = false;
    for b in bits {
        let cfg = TrainConfig::shipped(b);
        let start = Instant::now();
        let cb = train(&cfg, |it, err| {
            eprintln!(
                "  {b}-bit iteration {:>2}/{}: training mse {err:.5}",
                it + 1,
                cfg.iterations
            )
        });
        let held_out = gaussian_runs(cfg.seed ^ 0xFFFF, 2048, cfg.run_len);
        let eval = mse(&cb, &held_out, cfg.run_len);
        let path = format!("{dir}/trellis_{b}bit.bin");
        let bytes = cb.to_le_bytes();
        println!(
            "{b}-bit: held-out mse {eval:.5} on 2048 N(0,1) runs of {} ({:.1} s)",
            cfg.run_len,
            start.elapsed().as_secs_f64()
        );
        if check {
            match std::fs::read(&path) {
                Ok(shipped) if shipped == bytes => println!("{path}: reproduced byte for byte"),
                Ok(_) => {
                    eprintln!("{path}: differs from a fresh training run");
                    failed = true;
                }
                Err(e) => {
                    eprintln!("{path}: {e}");
                    failed = true;
                }
            }
        } else if let Err(e) =
            std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, &bytes))
        {
            eprintln!("cannot write {path}: {e}");
            failed = true;
        } else {
            println!("wrote {path}");
        }
    }
    if failed {
        std::process::exit(1);
    }
}
