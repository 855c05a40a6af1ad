//! Compiles the CUDA kernels with NVRTC for the given virtual architectures and writes one PTX
//! file per architecture, for `ptxas -v` in CI (`tools/cuda_check.py`). Needs libnvrtc only,
//! no GPU: `sjkvarn-cuda-ptx OUT_DIR compute_90 compute_86`.

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(out) = args.next() else {
        eprintln!("usage: sjkvarn-cuda-ptx OUT_DIR ARCH...");
        std::process::exit(2);
    };
    let arches: Vec<String> = args.collect();
    if arches.is_empty() {
        eprintln!("name at least one architecture, e.g. compute_90");
        std::process::exit(2);
    }
    std::fs::create_dir_all(&out).expect("create the output folder");
    let mut failed = false;
    for arch in arches {
        let Some(&known) = sjkvarn::backend::cuda::KERNEL_ARCHES
            .iter()
            .find(|a| **a == arch)
        else {
            eprintln!(
                "{arch}: unknown; known: {:?}",
                sjkvarn::backend::cuda::KERNEL_ARCHES
            );
            failed = true;
            continue;
        };
        match sjkvarn::backend::cuda::compile_ptx(known) {
            Ok(ptx) => {
                let path = std::path::Path::new(&out).join(format!("sjkvarn-{arch}.ptx"));
                std::fs::write(&path, ptx).expect("write the PTX");
                println!("{arch}: {}", path.display());
            }
            Err(e) => {
                eprintln!("{e}");
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
