fn main() {
    let bits: u32 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let x = sjkvarn::rng::SplitMix64::new(1).gaussians(128 * 2048);
    let t = std::time::Instant::now();
    let out = sjkvarn::trellis::encode_runs(bits, &x, 128, Some(1)).unwrap();
    let dt = t.elapsed().as_secs_f64();
    println!("{bits}-bit: {:.1} us/run ({} bytes)", dt / 2048.0 * 1e6, out.len());
}
