fn main() {
    let mut rng = sjkvarn::rng::SplitMix64::new(0);
    let name = std::env::args().nth(1).unwrap();
    let f = sjkvarn::format::BlockFormat::from_name(&name).unwrap();
    let x = rng.gaussians(1024);
    let e = sjkvarn::format::encode_rows(f, &x, 256, Some(1)).unwrap();
    println!("{name} {}", e.iter().map(|&b| b as u64).sum::<u64>());
}
