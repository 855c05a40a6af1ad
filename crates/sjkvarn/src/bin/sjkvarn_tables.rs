//! Regenerates `crates/sjkvarn/src/codec/lloyd_max_tables.rs` (Lloyd-Max centroid tables).
//! Usage: `cargo run -p sjkvarn --bin sjkvarn-tables [-- OUTPUT_PATH]`.

fn main() {
    let default = concat!(env!("CARGO_MANIFEST_DIR"), "/src/codec/lloyd_max_tables.rs");
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| default.to_string());
    let text = sjkvarn::codec::lloyd_max::render_tables();
    if let Err(e) = std::fs::write(&path, text) {
        eprintln!("sjkvarn-tables: cannot write {path}: {e}");
        std::process::exit(1);
    }
    println!("wrote {path}");
}
