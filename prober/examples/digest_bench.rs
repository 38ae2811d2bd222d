//! Full-digest throughput against `sha256sum` on the same files, in one run, side by side.
//!
//! `prober/benches/digest.sh [FILES] [MIB_PER_FILE]` runs it in release mode. Files are
//! generated in a temporary directory and read once first, so both sides hash from the page
//! cache: this compares hashing, not the disk. Per core: one thread against one `sha256sum`
//! over every file. Across cores: N threads against N `sha256sum` processes over N slices.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use understudy_prober::parity::model::full_digests;

fn sha256sum(files: &[PathBuf], processes: usize) -> f64 {
    let started = Instant::now();
    let slices: Vec<Vec<PathBuf>> = (0..processes)
        .map(|p| files.iter().skip(p).step_by(processes).cloned().collect())
        .collect();
    let children: Vec<_> = slices
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| {
            Command::new("sha256sum")
                .args(s)
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("sha256sum")
        })
        .collect();
    for mut child in children {
        assert!(child.wait().unwrap().success());
    }
    started.elapsed().as_secs_f64()
}

fn ours(files: &[(PathBuf, u64)], threads: usize) -> f64 {
    let started = Instant::now();
    full_digests(files, threads, &AtomicU64::new(0)).unwrap();
    started.elapsed().as_secs_f64()
}

fn best_of(runs: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..runs).map(|_| f()).fold(f64::INFINITY, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let count: usize = args.first().map_or(8, |a| a.parse().expect("FILES"));
    let mib: usize = args.get(1).map_or(128, |a| a.parse().expect("MIB_PER_FILE"));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = tempfile::tempdir().unwrap();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut files = Vec::new();
    for i in 0..count {
        let path = dir.path().join(format!("model-{i:05}.safetensors"));
        let bytes: Vec<u8> = (0..mib << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        files.push((path, bytes.len() as u64));
    }
    let paths: Vec<PathBuf> = files.iter().map(|f| f.0.clone()).collect();
    let total_mib = (count * mib) as f64;
    ours(&files, cores); // warm the page cache
    println!("{count} files × {mib} MiB = {total_mib} MiB, page cache warm, {cores} cores, best of 3");
    println!(
        "{:<12} {:>14} {:>14} {:>8}",
        "", "ours MiB/s", "sha256sum MiB/s", "ratio"
    );
    for (label, n) in [("per core", 1), ("all cores", cores)] {
        let ours = total_mib / best_of(3, || ours(&files, n));
        let theirs = total_mib / best_of(3, || sha256sum(&paths, n));
        println!("{label:<12} {ours:>14.0} {theirs:>14.0} {:>8.2}", ours / theirs);
    }
}
