//! Compiles `shim.cpp`, which includes the kernel headers from `crates/sjkvarn/cuda/` as plain
//! C++.
fn main() {
    let cuda = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../sjkvarn/cuda");
    println!("cargo:rerun-if-changed=shim.cpp");
    println!("cargo:rerun-if-changed={}", cuda.display());
    for entry in std::fs::read_dir(&cuda).expect("crates/sjkvarn/cuda/ exists") {
        println!(
            "cargo:rerun-if-changed={}",
            entry.expect("dir entry").path().display()
        );
    }
    cc::Build::new()
        .cpp(true)
        .file("shim.cpp")
        .include(&cuda)
        .flag_if_supported("-std=c++17")
        // The reference never fuses a multiply and an add; neither may the host build.
        .flag_if_supported("-ffp-contract=off")
        .flag_if_supported("-fno-fast-math")
        .warnings(true)
        .compile("sjkvarn_cuda_host");
}
