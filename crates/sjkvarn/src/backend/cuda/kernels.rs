//! Compiling the kernels (NVRTC, at first use, cached on disk and per device) and their handles.

use super::{CudaError, CudaResult};
use crate::kernel_abi::{kernel_source, KernelLayerView};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, DeviceRepr};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

// SAFETY: #[repr(C)] plain data mirroring the C struct the kernels take by value (size checked
// against the C compiler in the host tests).
unsafe impl DeviceRepr for KernelLayerView {}

/// Architectures CI compiles for and the runtime knows by name.
pub const KERNEL_ARCHES: [&str; 6] = [
    "compute_80",
    "compute_86",
    "compute_89",
    "compute_90",
    "compute_100",
    "compute_120",
];

/// NVRTC options. `--fmad=false`: the staging and seal kernels must round exactly as the CPU
/// reference, which never fuses a multiply and an add.
fn options() -> Vec<String> {
    vec!["-std=c++17".into(), "--fmad=false".into()]
}

/// The virtual architecture to compile for a device of compute capability `(major, minor)`:
/// its own when known, else the newest known one below it (PTX JIT-compiles forward).
pub fn arch_for(cc: (i32, i32)) -> &'static str {
    let want = cc.0 * 10 + cc.1;
    let mut best = KERNEL_ARCHES[0];
    for a in KERNEL_ARCHES {
        let n: i32 = a.trim_start_matches("compute_").parse().unwrap_or(0);
        if n <= want {
            best = a;
        }
    }
    best
}

/// Folder for compiled PTX: `$SJKVARN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/sjkvarn`, else
/// `~/.cache/sjkvarn`.
pub fn kernel_cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SJKVARN_KERNEL_CACHE") {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(p).join("sjkvarn"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("sjkvarn"))
}

fn fnv1a64(parts: &[&str]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for b in p.bytes().chain([0u8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Compiles the kernels to PTX for `arch` (e.g. `compute_90`), through the on-disk cache.
pub fn compile_ptx(arch: &'static str) -> CudaResult<String> {
    let src = kernel_source();
    let opts = options();
    let key = fnv1a64(&[&src, &opts.join(" "), arch]);
    let cached = kernel_cache_dir().map(|d| d.join(format!("sjkvarn-{arch}-{key:016x}.ptx")));
    if let Some(path) = &cached {
        if let Ok(text) = std::fs::read_to_string(path) {
            return Ok(text);
        }
    }
    // SAFETY: only probes for the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::Unavailable(
            "NVRTC (libnvrtc.so.13) was not found: install the `nvidia-cuda-nvrtc` wheel".into(),
        ));
    }
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(
        &src,
        CompileOptions {
            arch: Some(arch),
            options: opts,
            name: Some("sjkvarn.cu".into()),
            ..Default::default()
        },
    )
    .map_err(|e| CudaError::Compile {
        arch: arch.to_string(),
        log: match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => other.to_string(),
        },
    })?;
    let text = ptx.to_src();
    if let Some(path) = cached {
        // A cache that cannot be written only costs a recompile next time.
        let _ = write_atomically(&path, &text);
    }
    Ok(text)
}

fn write_atomically(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    crate::atomic_file::replace(path, text.as_bytes())
}

/// Query-group sizes with an attention kernel (`sj_attend_gs{N}`).
pub const GROUP_SIZES: [usize; 9] = [1, 2, 3, 4, 5, 6, 7, 8, 16];

/// The loaded module of one device.
pub struct Kernels {
    pub ctx: Arc<CudaContext>,
    _module: Arc<CudaModule>,
    pub append: CudaFunction,
    pub seal: CudaFunction,
    pub merge: CudaFunction,
    attend: Vec<(usize, CudaFunction)>,
}

impl Kernels {
    /// The kernels of device `ordinal`, compiled and loaded once per process.
    pub fn get(ordinal: usize) -> CudaResult<Arc<Kernels>> {
        static LOADED: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
        let map = LOADED.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = map.get(&ordinal) {
            return Ok(k.clone());
        }
        super::availability(ordinal)?;
        let ctx = CudaContext::new(ordinal)?;
        let arch = arch_for(ctx.compute_capability()?);
        let ptx = compile_ptx(arch)?;
        let module = ctx.load_module(Ptx::from_src(ptx))?;
        let attend = GROUP_SIZES
            .iter()
            .map(|&g| Ok((g, module.load_function(&format!("sj_attend_gs{g}"))?)))
            .collect::<CudaResult<Vec<_>>>()?;
        let k = Arc::new(Kernels {
            append: module.load_function("sj_append_stage")?,
            seal: module.load_function("sj_seal")?,
            merge: module.load_function("sj_attend_merge")?,
            attend,
            _module: module,
            ctx,
        });
        map.insert(ordinal, k.clone());
        Ok(k)
    }

    /// The attention kernel for query groups of `gs` heads.
    pub fn attend(&self, gs: usize) -> CudaResult<&CudaFunction> {
        self.attend
            .iter()
            .find(|(g, _)| *g == gs)
            .map(|(_, f)| f)
            .ok_or_else(|| {
                CudaError::Unsupported(format!(
                    "{gs} query heads per KV head (kernels exist for {GROUP_SIZES:?})"
                ))
            })
    }
}
