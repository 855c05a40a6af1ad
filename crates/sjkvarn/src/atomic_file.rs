//! Whole-file replacement that never exposes a half-written or foreign file.
//!
//! A write goes to a temporary file of its own in the target's directory, created exclusively
//! (`O_EXCL`) under a name no other writer can pick: `.<name>.<pid>-<counter>-<nanos>.sjkvarn-tmp`.
//! The file is synced, renamed over the target, and the directory is synced, so after a
//! successful return the new contents survive a power cut and before it the old file is
//! untouched. Concurrent writers of one target never share a temporary: each rename is atomic,
//! the last one wins and the file is always one writer's whole bytes. A process killed
//! mid-write leaves its temporary behind; the next write to the same target removes the
//! temporaries of processes that no longer run (Linux), and they are always safe to delete.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Suffix of every temporary this module creates.
pub const TEMP_SUFFIX: &str = ".sjkvarn-tmp";

static COUNTER: AtomicU64 = AtomicU64::new(0);

fn file_name(path: &Path) -> io::Result<String> {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "the path names no file (it ends in '..' or '/')",
            )
        })
}

fn directory(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Prefix of the temporaries of `name` written by process `pid`.
fn temp_prefix(name: &str, pid: u32) -> String {
    format!(".{name}.{pid}-")
}

/// Creates a fresh temporary next to `path` that no other writer can open.
fn create_temp(dir: &Path, name: &str) -> io::Result<(File, PathBuf)> {
    loop {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(
            "{}{n}-{nanos}{TEMP_SUFFIX}",
            temp_prefix(name, std::process::id())
        ));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((f, tmp)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Syncs the directory entry of a rename (a no-op where directories cannot be opened).
fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

/// Whether process `pid` may still be running (always true where this cannot be told).
fn process_alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

/// Removes the temporaries of `path` left by processes that no longer run; returns how many.
pub fn remove_orphans(path: &Path) -> usize {
    let (Ok(name), dir) = (file_name(path), directory(path)) else {
        return 0;
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return 0;
    };
    let head = format!(".{name}.");
    let mut removed = 0;
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = file
            .strip_prefix(&head)
            .and_then(|r| r.strip_suffix(TEMP_SUFFIX))
        else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id()
            && !process_alive(pid)
            && std::fs::remove_file(entry.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// Replaces `path` with what `fill` writes, atomically and durably (see the module docs).
/// On any error the target is as it was and the temporary is removed.
pub fn replace_with(path: &Path, fill: impl FnOnce(&mut File) -> io::Result<()>) -> io::Result<()> {
    let name = file_name(path)?;
    let dir = directory(path);
    remove_orphans(path);
    let (mut file, tmp) = create_temp(&dir, &name)?;
    let result = (|| {
        fill(&mut file)?;
        file.flush()?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, path)?;
        sync_dir(&dir)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Replaces `path` with `bytes`; see [`replace_with`] (the CUDA backend's PTX cache).
#[cfg(any(feature = "cuda", test))]
pub fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace_with(path, |f| f.write_all(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sjkvarn-atomic-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn paths_sharing_a_stem_never_share_a_temporary() {
        let dir = scratch("stem");
        let payload = |i: usize| vec![i as u8; 4096 + i];
        std::thread::scope(|s| {
            for i in 0..8 {
                let path = dir.join(format!("s.{i}"));
                s.spawn(move || {
                    for _ in 0..20 {
                        replace(&path, &payload(i)).unwrap();
                    }
                });
            }
        });
        for i in 0..8 {
            assert_eq!(
                std::fs::read(dir.join(format!("s.{i}"))).unwrap(),
                payload(i)
            );
        }
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 8, "leftovers: {names:?}");
    }

    #[test]
    fn concurrent_writers_of_one_path_all_succeed_and_one_wins_whole() {
        let dir = scratch("same");
        let path = dir.join("one.snap");
        std::thread::scope(|s| {
            for i in 0..6u8 {
                let path = path.clone();
                s.spawn(move || {
                    for _ in 0..20 {
                        replace(&path, &[i; 10_000]).unwrap();
                    }
                });
            }
        });
        let got = std::fs::read(&path).unwrap();
        assert_eq!(got.len(), 10_000);
        assert!(got.iter().all(|&b| b == got[0]));
    }

    #[test]
    fn a_failed_fill_leaves_the_old_file_and_no_temporary() {
        let dir = scratch("fail");
        let path = dir.join("keep");
        replace(&path, b"old").unwrap();
        let err = replace_with(&path, |f| {
            f.write_all(b"partial")?;
            Err(io::Error::other("stopped"))
        });
        assert!(err.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    }

    #[test]
    fn orphans_of_dead_processes_are_removed_and_live_ones_kept() {
        let dir = scratch("orphans");
        let path = dir.join("x.bin");
        // pid 0 is never a user process, so /proc/0 does not exist.
        let dead = dir.join(format!(".x.bin.0-1-2{TEMP_SUFFIX}"));
        let mine = dir.join(format!(
            "{}9-9{TEMP_SUFFIX}",
            temp_prefix("x.bin", std::process::id())
        ));
        let other = dir.join(format!(".y.bin.0-1-2{TEMP_SUFFIX}"));
        for p in [&dead, &mine, &other] {
            std::fs::write(p, b"junk").unwrap();
        }
        replace(&path, b"new").unwrap();
        assert_eq!(dead.exists(), !cfg!(target_os = "linux"));
        assert!(mine.exists(), "a live process's temporary was removed");
        assert!(other.exists(), "another target's temporary was removed");
    }

    #[test]
    fn a_path_without_a_file_name_is_refused() {
        assert_eq!(
            replace(Path::new("/"), b"x").unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
