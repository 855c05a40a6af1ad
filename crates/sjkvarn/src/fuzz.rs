//! Fuzz targets: functions of arbitrary bytes that must return `Ok` (whatever the bytes) or an
//! `Err` describing a broken invariant, and never panic. Driven by the `sjkvarn-fuzz` binary
//! (mutational, time-bounded) and replayed over the committed corpus by `tests/fuzz_corpus.rs`.

use crate::attention::attend;
use crate::backend::cpu::snapshot::fnv1a64;
use crate::backend::Sequence;
use crate::codec::extension::body::{BodyCoding, BodySpec, TrellisAxis, BODY_BITS, GROUP};
use crate::codec::format::{decode_into, BlockFormat};
use crate::journal::{CacheConfig, LayerCoding, Staging};
use crate::rng::SplitMix64;
use std::sync::Arc;

/// Reads input bytes as a stream of small decisions; past the end it yields zeros.
struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Bytes<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self { data, at: 0 }
    }
    fn u8(&mut self) -> u8 {
        let v = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        v
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn pick<T: Copy>(&mut self, options: &[T]) -> T {
        options[self.u8() as usize % options.len()]
    }
    fn rest(&self) -> &'a [u8] {
        &self.data[self.at.min(self.data.len())..]
    }
    fn f32(&mut self) -> f32 {
        match self.u8() % 16 {
            0 => f32::NAN,
            1 => f32::INFINITY,
            2 => -1e30,
            3 => 70000.0,
            4 => 0.0,
            _ => (self.u16() as f32 - 32768.0) / 4096.0,
        }
    }
}

/// What a target call ended in (distinct outcomes guide which inputs are kept).
pub type Outcome = String;

/// A fuzz target: `Ok(outcome)` for any input, `Err` for a broken invariant.
pub type Target = fn(&[u8]) -> Result<Outcome, String>;

pub fn target_records(input: &[u8]) -> Result<Outcome, String> {
    let mut b = Bytes::new(input);
    let kind = b.u8() % 5;
    match kind {
        0 => {
            let formats = BlockFormat::all();
            let f = formats[b.u8() as usize % formats.len()];
            let values = (b.u16() as usize % 4096) + 1;
            let mut out = vec![0.0f32; values];
            Ok(match decode_into(f, b.rest(), &mut out, Some(1)) {
                Ok(()) => format!("flat {} ok", f.name()),
                Err(e) => format!("flat {} err {}", f.name(), variant(&e.to_string())),
            })
        }
        1..=3 => {
            let d = b.pick(&[64usize, 128, 256, 512]);
            let (kb, vb) = (b.pick(&BODY_BITS), b.pick(&BODY_BITS));
            let codings = [BodyCoding::Scalar, BodyCoding::Trellis(TrellisAxis::Token)];
            let (kc, vc) = (b.pick(&codings), b.pick(&codings));
            // Reference records wherever the reference defines the coding, extensions otherwise.
            let codec = match crate::codec::BodyCodec::for_layer(
                d,
                kb,
                vb,
                kc,
                vc,
                crate::BalanceConfig::default(),
            ) {
                Ok(c) => c,
                Err(e) => return Ok(format!("codec err {}", variant(&e.to_string()))),
            };
            let mut record = b.rest().to_vec();
            if kind != 3 {
                record.resize(codec.record_bytes(), 0x5a); // reach the decoders, not the length check
            }
            if let Err(e) = codec.halves(&record) {
                return Ok(format!("halves err {}", variant(&e.to_string())));
            }
            Ok(match codec.decode_model_frame(&record) {
                Ok(_) => format!("body {kc:?}/{vc:?} ok"),
                Err(e) => format!("body err {}", variant(&e.to_string())),
            })
        }
        _ => {
            // A tq6_0 staging row of the reference (any bytes decode to finite values or a
            // non-finite norm, never a panic).
            let d = b.pick(&[64usize, 128, 256, 512]);
            let bytes = b.rest();
            let need = crate::codec::tq6::row_bytes(d);
            if bytes.len() < need {
                return Ok("tq6 short".into());
            }
            let mut out = vec![0.0f32; d];
            crate::codec::tq6::decode_row(&bytes[..need], &mut out);
            Ok("tq6 ok".into())
        }
    }
}

pub fn target_snapshot(input: &[u8]) -> Result<Outcome, String> {
    let mut bytes = input.to_vec();
    // Half the inputs get a valid checksum so the parser behind it is exercised.
    if bytes.len() >= 28 && bytes[0] & 1 == 1 {
        let n = bytes.len() - 8;
        let sum = fnv1a64(&bytes[..n]);
        bytes[n..].copy_from_slice(&sum.to_le_bytes());
    }
    Ok(match Sequence::from_snapshot(&bytes, None, None) {
        Ok(seq) => {
            // A restored sequence must round-trip byte for byte.
            let again = seq
                .snapshot_bytes()
                .map_err(|e| format!("a loaded snapshot cannot be saved: {e}"))?;
            if Sequence::from_snapshot(&again, None, None)
                .map(|s| s.snapshot_bytes().ok() != Some(again.clone()))
                .unwrap_or(true)
            {
                return Err("a loaded snapshot does not round-trip".into());
            }
            "snapshot ok".into()
        }
        Err(e) => format!("snapshot err {}", variant(&e.to_string())),
    })
}

/// An error message with its numbers blanked: its kind and where it arose, not the values.
fn variant(msg: &str) -> String {
    msg.chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .collect::<String>()
        .split("##")
        .collect::<Vec<_>>()
        .join("#")
}

pub fn target_api(input: &[u8]) -> Result<Outcome, String> {
    let mut b = Bytes::new(input);
    let kv = 1 + b.u8() as usize % 3;
    let q = kv * (1 + b.u8() as usize % 3);
    let d = b.pick(&[64usize, 128, 96, 0]);
    let layers = b.u8() as usize % 3;
    let (kb, vb) = (b.pick(&[2u32, 3, 4, 7, 8]), b.pick(&[2u32, 3, 4, 1]));
    let coding = b.pick(&[BodyCoding::Scalar, BodyCoding::Trellis(TrellisAxis::Token)]);
    let mut config = CacheConfig::uniform(layers, q, kv, d, LayerCoding::scalar(kb, vb), 4096);
    for lc in config.layer_coding.iter_mut() {
        lc.k_coding = coding;
    }
    config.min_tail = b.pick(&[0usize, 128, 256, 300]);
    config.max_tail = b.pick(&[128usize, 256, 512, 100]);
    config.max_chunk = b.pick(&[1usize, 64, 128, 0]);
    config.max_tokens = b.pick(&[0usize, 200, 1500, 4096]);
    config.k_staging = b.pick(&[Staging::Tq6, Staging::Q8_0, Staging::F16]);
    config.v_staging = b.pick(&[Staging::Tq6, Staging::Q8_0, Staging::F16]);
    config.balance.passes = b.pick(&[0u32, 2, 16, 5000]);
    config.centre_keys = b.u8().is_multiple_of(2);
    config.exact_recent = b.pick(&[0usize, 0, 5, 128]);
    if let Err(e) = config.validate() {
        return Ok(format!("config err {}", variant(&e.to_string())));
    }
    let config = Arc::new(config);
    let mut seq = match Sequence::new(config.clone(), Sequence::pool_for(&config, 1)) {
        Ok(s) => s,
        Err(e) => return Ok(format!("new err {}", variant(&e.to_string()))),
    };
    let mut outcome = String::from("api");
    for _ in 0..12 {
        let images =
            |s: &Sequence| -> Vec<_> { (0..layers).map(|l| s.layer_image(l).ok()).collect() };
        let before = images(&seq);
        let op = b.u8() % 6;
        let layer = b.u8() as usize % (layers + 1);
        let res: Result<(), String> = match op {
            0 | 1 => {
                let n = b.u16() as usize % 700;
                let width = kv * d + b.u8().is_multiple_of(8) as usize;
                let fill = b.f32();
                let mut rng = SplitMix64::new(b.u16() as u64);
                let k: Vec<f32> = (0..n * width)
                    .map(|i| {
                        if i % 97 == 5 {
                            fill
                        } else {
                            rng.gaussian() as f32
                        }
                    })
                    .collect();
                let v = rng.gaussians(n * width);
                seq.append(layer, &k, &v).map_err(|e| e.to_string())
            }
            2 => {
                let rows = b.u8() as usize % 5;
                let fill = b.f32();
                let mut qv = vec![0.5f32; rows * q * d];
                if let Some(x) = qv.get_mut(3) {
                    *x = fill;
                }
                let scale = if b.u8().is_multiple_of(7) {
                    Some(b.f32())
                } else {
                    None
                };
                attend(&seq, layer, &qv, scale)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
            3 => seq
                .truncate(b.u16() as usize % 2000)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            4 => seq.seal_idle(0).map_err(|e| e.to_string()),
            _ => {
                let child = seq.fork();
                // Layers that hold different lengths cannot be saved (refused, not an error).
                match child.snapshot_bytes() {
                    Err(_) => Ok(()),
                    Ok(bytes) => match Sequence::from_snapshot(&bytes, None, None) {
                        Ok(back) if back.snapshot_bytes().ok() == Some(bytes.clone()) => Ok(()),
                        Ok(_) => return Err("fork snapshot does not round-trip".into()),
                        Err(e) => return Err(format!("fork snapshot refused: {e}")),
                    },
                }
            }
        };
        match res {
            Ok(()) => outcome.push_str(&format!(" {op}ok")),
            Err(e) => {
                if op != 3 && images(&seq) != before {
                    return Err(format!("op {op} failed ({e}) but changed the sequence"));
                }
                outcome.push_str(&format!(" {op}err:{}", variant(&e)));
            }
        }
    }
    Ok(outcome)
}

/// Concurrent saves and loads of snapshot files. Two to four writers, each with its own
/// sequence of an input-chosen length, save at once either to paths sharing a stem (`s.0`,
/// `s.1`, ...) or all to one path, while a reader loads the files being replaced. Every file must
/// end up holding one writer's whole snapshot (its own writer's where paths differ), every
/// concurrent load must see an old or a new whole snapshot, and no temporary may remain.
pub fn target_files(input: &[u8]) -> Result<Outcome, String> {
    static RUN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut b = Bytes::new(input);
    let writers = 2 + b.u8() as usize % 3;
    let one_path = b.u8() % 2 == 1;
    let mut config = CacheConfig::uniform(1, 2, 1, 64, LayerCoding::scalar(4, 4), 1024);
    (config.min_tail, config.max_tail, config.max_chunk) = (128, 256, 64);
    let config = Arc::new(config);
    let mut rng = SplitMix64::new(b.u16() as u64);
    let mut seqs = Vec::with_capacity(writers);
    for _ in 0..writers {
        let n = 1 + b.u16() as usize % 700;
        let mut seq = Sequence::new(config.clone(), Sequence::pool_for(&config, 1))
            .map_err(|e| e.to_string())?;
        for at in (0..n).step_by(64) {
            let m = 64.min(n - at);
            seq.append(0, &rng.gaussians(m * 64), &rng.gaussians(m * 64))
                .map_err(|e| e.to_string())?;
        }
        seqs.push(seq);
    }
    let snaps: Vec<Vec<u8>> = seqs
        .iter()
        .map(|s| s.snapshot_bytes().map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let run = RUN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("sjkvarn-fuzz-files-{}-{run}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let path = |i: usize| {
        dir.join(if one_path {
            "s.snap".into()
        } else {
            format!("s.{i}")
        })
    };
    // An older snapshot at every path first, so a load during the saves has something to read.
    let old = Sequence::new(config.clone(), Sequence::pool_for(&config, 1))
        .and_then(|s| s.snapshot_bytes())
        .map_err(|e| e.to_string())?;
    for i in 0..writers {
        std::fs::write(path(i), &old).map_err(|e| e.to_string())?;
    }
    let checked = std::thread::scope(|scope| -> Result<(), String> {
        let handles: Vec<_> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let p = path(i);
                scope.spawn(move || s.save(&p).map_err(|e| format!("save {i}: {e}")))
            })
            .collect();
        for round in 0..4 {
            let p = path(round % writers);
            let got = std::fs::read(&p).map_err(|e| format!("concurrent read: {e}"))?;
            if got != old && !snaps.contains(&got) {
                return Err("a concurrent load saw a file that is no whole snapshot".into());
            }
            Sequence::from_snapshot(&got, None, None)
                .map_err(|e| format!("a concurrent load failed: {e}"))?;
        }
        for h in handles {
            h.join().map_err(|_| "a save panicked".to_string())??;
        }
        Ok(())
    });
    let verdict = checked.and_then(|()| {
        for i in 0..writers {
            let got = std::fs::read(path(i)).map_err(|e| e.to_string())?;
            let fine = if one_path {
                snaps.contains(&got)
            } else {
                got == snaps[i]
            };
            if !fine {
                return Err(format!("file {i} does not hold its writer's snapshot"));
            }
        }
        let names: Vec<String> = std::fs::read_dir(&dir)
            .map_err(|e| e.to_string())?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        if names
            .iter()
            .any(|n| n.ends_with(crate::atomic_file::TEMP_SUFFIX))
        {
            return Err(format!("temporaries left behind: {names:?}"));
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    verdict?;
    Ok(format!("files {writers} one_path={one_path}"))
}

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    match name {
        "records" => Some(target_records),
        "snapshot" => Some(target_snapshot),
        "api" => Some(target_api),
        "files" => Some(target_files),
        _ => None,
    }
}

/// Seed inputs: real encoded data for every decoder, real snapshots, API scripts.
pub fn seed_corpus(target: &str) -> Vec<Vec<u8>> {
    let mut rng = SplitMix64::new(7);
    match target {
        "records" => {
            let mut out = Vec::new();
            for (i, f) in BlockFormat::all().iter().enumerate() {
                let vals = rng.gaussians(256);
                let enc = crate::codec::format::encode(*f, &vals, Some(1)).expect("encode");
                let mut input = vec![0u8, i as u8, 255, 0];
                input.extend(enc);
                out.push(input);
            }
            let spec = BodySpec::new(64, 3, 2).expect("spec");
            let (k, v) = (rng.gaussians(GROUP * 64), rng.gaussians(GROUP * 64));
            let mut rec = vec![0u8; spec.record_bytes()];
            spec.encode(&k, &v, &Default::default(), &mut rec)
                .expect("record");
            let mut input = vec![3u8, 0, 1, 0, 0, 0];
            input.extend(rec);
            out.push(input);
            out
        }
        "snapshot" => {
            let mut config = CacheConfig::uniform(2, 4, 2, 64, LayerCoding::scalar(3, 2), 2048);
            config.min_tail = 128;
            config.max_tail = 256;
            config.max_chunk = 64;
            let config = Arc::new(config);
            let mut seq =
                Sequence::new(config.clone(), Sequence::pool_for(&config, 1)).expect("seq");
            let mut out = vec![seq.snapshot_bytes().expect("snapshot")];
            for n in [100usize, 300] {
                for layer in 0..2 {
                    seq.append(layer, &rng.gaussians(n * 128), &rng.gaussians(n * 128))
                        .expect("append");
                }
                out.push(seq.snapshot_bytes().expect("snapshot"));
            }
            out
        }
        _ => (0..8u64)
            .map(|i| {
                let mut r = SplitMix64::new(i);
                (0..96).map(|_| r.next_u64() as u8).collect()
            })
            .collect(),
    }
}
