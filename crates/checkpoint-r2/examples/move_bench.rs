//! Move benchmark: checkpoint + restore of a ~190 MB, 20,000-file tree
//! between two local sandboxes through (a) the in-memory store and (b) the
//! S3 store, against the shell pipelines `tar czf - . | tar xzf -` and
//! `tar cf - . | zstd -1 -T0 | zstd -d | tar xf -` on the same tree, and,
//! for the S3 store, against what a user would script with the same S3
//! server: `tar cf - . | zstd -1 -T0 | rclone rcat …` then `rclone cat … |
//! zstd -d | tar xf -`, and the same with `aws s3 cp -` both ways (the
//! faster of the two is the anchor). Every run is printed, its ratios
//! taken within its round.
//!
//! ```text
//! HARNESS_S3_ENDPOINT=http://127.0.0.1:8333 \
//!   cargo run --release -p checkpoint-r2 --example move_bench [-- --files N --mb M] [--repeat R] [--no-tree | --tree-only]
//! ```
//!
//! Each store runs plain and encrypted (`<store>-encrypted`: the same
//! store under `checkpoint-crypt`, as `harness checkpoint` writes to S3/R2
//! by default), side by side.
//!
//! `MOVE_BENCH_PART_MIB` sets the S3 store's multipart part size (8 MiB by
//! default) to compare part sizes.
//!
//! The S3 row also says how much CPU the S3 server (a `weed` process on
//! this machine, SeaweedFS) used while it ran: on a small machine the
//! server shares the cores with the move.
//!
//! Each contender runs in its own child process so its peak memory is its
//! own: ours is the child's VmHWM, the shell pipelines' is the largest
//! process of the pipeline as `/usr/bin/time -v` reports it.
//!
//! Then, per store, incremental tree checkpoints (`harness_core::
//! tree_checkpoint`) against whole archives in the same process: a full
//! archive checkpoint, a first tree checkpoint, a re-checkpoint after a
//! one-file change (its time and upload against the full checkpoint's),
//! and the restore of that change onto the previous state against a full
//! restore.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use checkpoint_r2::{S3CheckpointStore, S3Config};
use harness_core::checkpoint::{CheckpointStore, MemoryCheckpointStore};
use harness_core::sandbox::{SandboxProvider, SandboxSpec};
use harness_testkit::trees::generate_tree as generate;
use sandbox_local::LocalProvider;

/// Flush dirty pages before a timed step: on a VM whose disk writes back
/// slowly, a step that follows one that wrote 20,000 files otherwise pays
/// for its predecessor's writeback (seen: the same restore 1 s or 12 s).
fn settle() {
    let _ = Command::new("sync").status();
}

fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn count_files(dir: &Path) -> (usize, u64) {
    let mut n = 0;
    let mut bytes = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let meta = entry.metadata().unwrap();
        if meta.is_dir() {
            let (a, b) = count_files(&entry.path());
            n += a;
            bytes += b;
        } else {
            n += 1;
            bytes += meta.len();
        }
    }
    (n, bytes)
}

/// Child mode: one checkpoint + restore through `store_kind`; prints
/// `RESULT <secs> <peak_kb> <files> <bytes> <stored_bytes>`.
async fn run_one(store_kind: &str, src: &Path, scratch: &Path) {
    let store = open_store(store_kind).await;
    let provider = LocalProvider::new(scratch.join("sandboxes"));
    let mut spec = SandboxSpec::new("/workspace");
    spec.wrap = Some(src.to_string_lossy().into_owned());
    let a = provider.create(&spec).await.unwrap();
    let b = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    settle();
    // Read before the clock starts: the first reading runs `getconf`.
    let cpu_before = cpu_secs(Path::new("/proc/self")).unwrap_or(0.0);
    let started = Instant::now();
    let info = harness_moves::checkpoint(
        a.as_ref(),
        a.workdir(),
        store.as_ref(),
        "bench/tree.tar.zst",
        None,
    )
    .await
    .unwrap();
    let mid = started.elapsed().as_secs_f64();
    harness_moves::restore(
        store.as_ref(),
        "bench/tree.tar.zst",
        b.as_ref(),
        b.workdir(),
        None,
    )
    .await
    .unwrap();
    let secs = started.elapsed().as_secs_f64();
    let cpu = cpu_secs(Path::new("/proc/self")).unwrap_or(0.0) - cpu_before;
    let (files, bytes) = count_files(Path::new(b.workdir()));
    println!(
        "RESULT {secs:.3} {} {files} {bytes} {} {mid:.3} {cpu:.2}",
        peak_rss_kb(),
        info.object.size
    );
    store.delete("bench/tree.tar.zst").await.unwrap();
    // `b` is not destroyed here: the scratch directory goes at the end. On
    // ext4 without a journal, creating files soon after 20,000 were deleted
    // is many times slower (the inode allocator skips recently deleted
    // inodes, `recently_deleted` in ialloc.c), which made the next
    // contender's restore 5-15x slower than the same restore on its own.
}

async fn open_store(store_kind: &str) -> Arc<dyn CheckpointStore> {
    // `<store>-encrypted`: the same store under `checkpoint-crypt`'s
    // encryption, as `harness checkpoint` writes to S3/R2 by default.
    if let Some(plain) = store_kind.strip_suffix("-encrypted") {
        let key = checkpoint_crypt::DeploymentKey::from_secret(&[0x5a; 32]).unwrap();
        return Arc::new(checkpoint_crypt::EncryptedStore::new(
            Box::pin(open_store(plain)).await,
            key.lineage("bench"),
        ));
    }
    match store_kind {
        "memory" => Arc::new(MemoryCheckpointStore::new()),
        "s3" => {
            let endpoint = std::env::var("HARNESS_S3_ENDPOINT").expect("HARNESS_S3_ENDPOINT");
            let store = S3CheckpointStore::new(
                S3Config::custom(
                    endpoint,
                    "us-east-1",
                    "bench",
                    "bench-secret",
                    "harness-move-bench",
                )
                .with_prefix(format!("bench-{}", std::process::id()))
                // MOVE_BENCH_PART_MIB: the multipart part size (default 8).
                .with_part_size(
                    std::env::var("MOVE_BENCH_PART_MIB")
                        .ok()
                        .and_then(|v| v.parse::<usize>().ok())
                        .map_or(checkpoint_r2::DEFAULT_PART_SIZE, |m| m << 20),
                ),
            )
            .unwrap();
            store.ensure_bucket().await.unwrap();
            Arc::new(store)
        }
        other => panic!("unknown store {other}"),
    }
}

/// Child mode: incremental tree checkpoints against whole archives.
async fn run_tree(store_kind: &str, src: &Path, scratch: &Path) {
    use harness_moves::tree as tc;
    let store = open_store(store_kind).await;
    let provider = LocalProvider::new(scratch.join("sandboxes-tree"));
    let mut spec = SandboxSpec::new("/workspace");
    spec.wrap = Some(src.to_string_lossy().into_owned());
    let a = provider.create(&spec).await.unwrap();
    let clock = harness_core::clock::FnClock(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    });
    let timed = Instant::now;
    // Whole archive: checkpoint, and restore into an empty sandbox.
    settle();
    let t = timed();
    let archive = harness_moves::checkpoint(
        a.as_ref(),
        a.workdir(),
        store.as_ref(),
        "bench/archive.tar.zst",
        None,
    )
    .await
    .unwrap();
    let archive_ckpt = t.elapsed().as_secs_f64();
    let c = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    settle();
    let t = timed();
    harness_moves::restore(
        store.as_ref(),
        "bench/archive.tar.zst",
        c.as_ref(),
        c.workdir(),
        None,
    )
    .await
    .unwrap();
    let archive_restore = t.elapsed().as_secs_f64();
    // Not destroyed before the end (see `run_one`).
    // Tree checkpoints: the first, then after a one-file change.
    settle();
    let t = timed();
    let first = tc::checkpoint_tree(
        a.as_ref(),
        a.workdir(),
        store.as_ref(),
        "bench/t1",
        None,
        &clock,
        None,
    )
    .await
    .unwrap();
    let tree_first = t.elapsed().as_secs_f64();
    let b = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    // The packs' indexes are read from the store, as a restore in another
    // process reads them (the manifest stays kept: the re-checkpoint below
    // builds on the one this process wrote).
    tc::forget_kept_pack_indexes();
    settle();
    let t = timed();
    tc::restore_tree(store.as_ref(), "bench/t1", b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    let tree_restore_full = t.elapsed().as_secs_f64();
    let victim = src.join("pkg000/mod00/file0.rs");
    let original = std::fs::read(&victim).unwrap();
    let mut changed = original.clone();
    changed.extend_from_slice(b"\n// one more line\n");
    std::fs::write(&victim, &changed).unwrap();
    settle();
    let t = timed();
    let second = tc::checkpoint_tree(
        a.as_ref(),
        a.workdir(),
        store.as_ref(),
        "bench/t2",
        Some("bench/t1"),
        &clock,
        None,
    )
    .await
    .unwrap();
    let tree_again = t.elapsed().as_secs_f64();
    settle();
    let t = timed();
    let delta = tc::restore_tree(store.as_ref(), "bench/t2", b.as_ref(), b.workdir(), None)
        .await
        .unwrap();
    let tree_restore_delta = t.elapsed().as_secs_f64();
    assert_eq!(
        std::fs::read(Path::new(b.workdir()).join("pkg000/mod00/file0.rs")).unwrap(),
        changed,
        "the change arrived"
    );
    std::fs::write(&victim, &original).unwrap();
    print_tree_report(
        store_kind,
        &TreeFigures {
            entries: first.entries,
            tree_bytes: first.tree_bytes,
            archive_bytes: archive.object.size,
            first_uploaded: first.bytes_uploaded,
            again_uploaded: second.bytes_uploaded,
            again_files_read: second.files_read,
            delta_written: delta.written,
            archive_ckpt,
            archive_restore,
            tree_first,
            tree_again,
            tree_restore_full,
            tree_restore_delta,
        },
    );
    println!("RESULT-TREE peak {} KiB", peak_rss_kb());
    // The trees stay until the scratch directory goes (see `run_one`).
    let _ = (a, b, c);
}

/// What `run_tree` measured: sizes from the checkpoints' own reports,
/// wall seconds from the bench.
struct TreeFigures {
    entries: u64,
    tree_bytes: u64,
    archive_bytes: u64,
    first_uploaded: u64,
    again_uploaded: u64,
    again_files_read: u64,
    delta_written: u64,
    archive_ckpt: f64,
    archive_restore: f64,
    tree_first: f64,
    tree_again: f64,
    tree_restore_full: f64,
    tree_restore_delta: f64,
}

/// The table and ratios `run_tree` prints: archive baselines beside the
/// incremental tree checkpoints of the same tree.
fn print_tree_report(store_kind: &str, f: &TreeFigures) {
    println!(
        "\nincremental tree checkpoints, {store_kind} store ({} entries, {:.1} MB):",
        f.entries,
        f.tree_bytes as f64 / 1e6
    );
    println!("{:<52} {:>8} {:>12}", "step", "wall s", "uploaded MB");
    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "{:<52} {:>8.3} {:>12.3}",
        "archive checkpoint (baseline)",
        f.archive_ckpt,
        mb(f.archive_bytes)
    );
    println!(
        "{:<52} {:>8.3} {:>12.3}",
        "tree checkpoint, first",
        f.tree_first,
        mb(f.first_uploaded)
    );
    println!(
        "{:<52} {:>8.3} {:>12.3}",
        format!(
            "tree re-checkpoint, 1 file changed ({} read)",
            f.again_files_read
        ),
        f.tree_again,
        mb(f.again_uploaded)
    );
    println!(
        "{:<52} {:>8.3}",
        "archive restore into an empty tree (baseline)", f.archive_restore
    );
    println!(
        "{:<52} {:>8.3}",
        "tree restore into an empty tree", f.tree_restore_full
    );
    println!(
        "{:<52} {:>8.3}",
        format!(
            "tree restore of the change onto t1 ({} written)",
            f.delta_written
        ),
        f.tree_restore_delta
    );
    println!(
        "ratios: re-checkpoint {:.1}x faster than an archive checkpoint; upload {:.4}% of the tree; \
         delta restore {:.1}x faster than an archive restore ({:.1}x than a full tree restore); \
         first tree checkpoint {:.2}x the archive's time",
        f.archive_ckpt / f.tree_again,
        100.0 * f.again_uploaded as f64 / f.tree_bytes as f64,
        f.archive_restore / f.tree_restore_delta,
        f.tree_restore_full / f.tree_restore_delta,
        f.tree_first / f.archive_ckpt,
    );
}

struct Row {
    name: String,
    secs: f64,
    peak_kb: Option<u64>,
    note: String,
}

/// CPU seconds (user + system, all threads) the process whose
/// `/proc/<pid>` is `proc_dir` has used so far.
fn cpu_secs(proc_dir: &Path) -> Option<f64> {
    static TICKS_PER_SEC: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    let ticks_per_sec = *TICKS_PER_SEC.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    });
    let stat = std::fs::read_to_string(proc_dir.join("stat")).ok()?;
    // Fields after the parenthesised name: utime and stime are the 12th
    // and 13th.
    let after_name = stat.rsplit_once(')')?.1;
    let ticks: u64 = after_name
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    Some(ticks as f64 / ticks_per_sec)
}

/// CPU seconds every process named `weed` has used so far; `None` when
/// there is none (the S3 server runs elsewhere).
fn s3_server_cpu_secs() -> Option<f64> {
    let mut total = None;
    for proc_dir in std::fs::read_dir("/proc").ok()?.flatten() {
        let comm = std::fs::read_to_string(proc_dir.path().join("comm")).unwrap_or_default();
        if comm.trim() == "weed" {
            *total.get_or_insert(0.0) += cpu_secs(&proc_dir.path()).unwrap_or(0.0);
        }
    }
    total
}

fn run_child(store_kind: &str, src: &Path, scratch: &Path) -> Row {
    let server_before = store_kind
        .starts_with("s3")
        .then(s3_server_cpu_secs)
        .flatten();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--child", store_kind])
        .arg(src)
        .arg(scratch)
        .output()
        .unwrap();
    let server = server_before
        .zip(s3_server_cpu_secs())
        .map(|(before, after)| format!("; S3 server (weed) CPU {:.2}s", after - before))
        .unwrap_or_default();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .unwrap_or_else(|| {
            panic!(
                "{store_kind} run failed: {}\n{}",
                stdout,
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let f: Vec<&str> = line.split_whitespace().collect();
    let peak_kb: Option<u64> = f[2].parse().ok();
    let stored: u64 = f[5].parse().unwrap();
    // The memory store holds the whole checkpoint: what the move itself
    // costs is the peak beside it.
    let beside = match (store_kind, peak_kb) {
        ("memory" | "memory-encrypted", Some(kb)) => format!(
            "; peak beside the stored object {:.1} MiB",
            (kb as f64 * 1024.0 - stored as f64) / (1 << 20) as f64
        ),
        _ => String::new(),
    };
    Row {
        name: format!("harness moves, {store_kind} store"),
        secs: f[1].parse().unwrap(),
        peak_kb,
        note: format!(
            "{} files / {} MB restored; CPU {}s; checkpoint {:.1} MB; checkpoint phase {}s{beside}{server}",
            f[3],
            f[4].parse::<u64>().unwrap() / 1_000_000,
            f[7],
            stored as f64 / 1e6,
            f[6]
        ),
    }
}

fn run_shell(name: &str, pipeline: &str, src: &Path, dst: &Path) -> Row {
    run_shell_with(name, pipeline, src, dst, &[])
}

fn run_shell_with(
    name: &str,
    pipeline: &str,
    src: &Path,
    dst: &Path,
    envs: &[(String, String)],
) -> Row {
    std::fs::create_dir_all(dst).unwrap();
    let script = pipeline
        .replace("{src}", &src.to_string_lossy())
        .replace("{dst}", &dst.to_string_lossy());
    let has_time = Path::new("/usr/bin/time").exists();
    settle();
    let started = Instant::now();
    let mut cmd = if has_time {
        let mut time = Command::new("/usr/bin/time");
        time.args(["-v", "sh"]);
        time
    } else {
        Command::new("sh")
    };
    let out = cmd
        .args(["-c", &script])
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let secs = started.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "{name} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = String::from_utf8_lossy(&out.stderr);
    let field = |name: &str| {
        report
            .lines()
            .find(|l| l.contains(name))
            .and_then(|l| l.rsplit(':').next())
            .map(|v| v.trim().to_string())
    };
    let peak_kb = field("Maximum resident set size").and_then(|v| v.parse().ok());
    // Every process of the pipeline (time -v counts the children it waited
    // for, and sh waits for all of them).
    let cpu = field("User time (seconds)")
        .zip(field("System time (seconds)"))
        .and_then(|(u, s)| Some(u.parse::<f64>().ok()? + s.parse::<f64>().ok()?))
        .map(|c| format!("; CPU {c:.2}s"))
        .unwrap_or_default();
    let (files, bytes) = count_files(dst);
    Row {
        name: name.to_string(),
        secs,
        peak_kb,
        note: format!("{files} files / {} MB restored{cpu}", bytes / 1_000_000),
    }
}

/// The bucket every S3 row writes to (ours under a per-process prefix).
const BUCKET: &str = "harness-move-bench";

/// A command-line S3 client a user would pipe an archive through.
#[derive(Clone, Copy, Debug, PartialEq)]
enum S3Cli {
    /// `rclone rcat` / `rclone cat` (Debian's rclone), multipart parts of
    /// 8 MiB (ours: `checkpoint_r2::DEFAULT_PART_SIZE`), its other
    /// settings at their defaults.
    Rclone,
    /// `aws s3 cp -` both ways (PyPI's awscli; its multipart chunk is
    /// 8 MiB by default).
    Aws,
}

impl S3Cli {
    fn name(self) -> &'static str {
        match self {
            S3Cli::Rclone => "rclone",
            S3Cli::Aws => "aws",
        }
    }

    /// The binary: `$MOVE_BENCH_RCLONE` / `$MOVE_BENCH_AWS` (set by `cargo
    /// xtask bench moves`, which installs them), else on `PATH`.
    fn binary(self) -> Option<String> {
        let (var, name) = match self {
            S3Cli::Rclone => ("MOVE_BENCH_RCLONE", "rclone"),
            S3Cli::Aws => ("MOVE_BENCH_AWS", "aws"),
        };
        std::env::var(var)
            .ok()
            .filter(|v| !v.is_empty())
            .or_else(|| {
                Command::new("sh")
                    .args(["-c", &format!("command -v {name}")])
                    .output()
                    .ok()
                    .filter(|o| o.status.success())
                    .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            })
    }

    /// The environment that points it at the S3 server with the
    /// credentials our store uses.
    fn env(self, endpoint: &str) -> Vec<(String, String)> {
        let pairs: Vec<(&str, &str)> = match self {
            S3Cli::Rclone => vec![
                ("RCLONE_CONFIG_BENCH_TYPE", "s3"),
                ("RCLONE_CONFIG_BENCH_PROVIDER", "Other"),
                ("RCLONE_CONFIG_BENCH_ACCESS_KEY_ID", "bench"),
                ("RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY", "bench-secret"),
                ("RCLONE_CONFIG_BENCH_REGION", "us-east-1"),
                ("RCLONE_CONFIG_BENCH_ENDPOINT", endpoint),
                ("RCLONE_S3_CHUNK_SIZE", "8M"),
                ("RCLONE_CONFIG", "/dev/null"),
                // Debian's rclone (1.60) cannot start its S3 backend with
                // `AWS_CA_BUNDLE` set ("LoadCustomCABundleError: …
                // unsupported transport"); empty is unset to the AWS SDK
                // under it, and the server is plain HTTP on loopback.
                ("AWS_CA_BUNDLE", ""),
            ],
            S3Cli::Aws => vec![
                ("AWS_ACCESS_KEY_ID", "bench"),
                ("AWS_SECRET_ACCESS_KEY", "bench-secret"),
                ("AWS_DEFAULT_REGION", "us-east-1"),
                ("AWS_ENDPOINT_URL", endpoint),
            ],
        };
        pairs
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// `tar | zstd | upload` then `download | zstd -d | tar x`, one shell
    /// line, the object named `key`.
    fn pipeline(self, bin: &str, key: &str) -> String {
        let (up, down) = match self {
            S3Cli::Rclone => (
                format!("{bin} rcat bench:{BUCKET}/{key}"),
                format!("{bin} cat bench:{BUCKET}/{key}"),
            ),
            S3Cli::Aws => (
                format!("{bin} s3 cp --only-show-errors - s3://{BUCKET}/{key}"),
                format!("{bin} s3 cp --only-show-errors s3://{BUCKET}/{key} -"),
            ),
        };
        format!(
            "cd {{src}} && tar cf - . | zstd -q -1 -T0 | {up} && {down} | zstd -q -d | tar xf - -C {{dst}}"
        )
    }

    /// Remove what `pipeline` stored (untimed).
    fn remove(self, bin: &str, key: &str, endpoint: &str) {
        self.run_untimed(
            match self {
                S3Cli::Rclone => format!("{bin} deletefile bench:{BUCKET}/{key}"),
                S3Cli::Aws => format!("{bin} s3 rm --only-show-errors s3://{BUCKET}/{key}"),
            },
            endpoint,
        );
    }

    /// Make the bucket (our store makes it too, but the anchors may run
    /// first).
    fn make_bucket(self, bin: &str, endpoint: &str) {
        self.run_untimed(
            match self {
                S3Cli::Rclone => format!("{bin} mkdir bench:{BUCKET}"),
                S3Cli::Aws => format!("{bin} s3 mb s3://{BUCKET} 2>/dev/null || true"),
            },
            endpoint,
        );
    }

    /// A housekeeping command line of this client, outside any timing;
    /// its failure shows in the timed run that follows.
    fn run_untimed(self, line: String, endpoint: &str) {
        let _ = Command::new("sh")
            .args(["-c", &line])
            .envs(self.env(endpoint))
            .status();
    }
}

/// One run of `cli`'s pipeline against the S3 server, with the server's
/// CPU beside it as for our S3 rows.
fn run_s3_cli(cli: S3Cli, bin: &str, endpoint: &str, src: &Path, dst: &Path, round: u64) -> Row {
    let key = format!(
        "anchor/{}-{}-{round}.tar.zst",
        cli.name(),
        std::process::id()
    );
    let server_before = s3_server_cpu_secs();
    let mut row = run_shell_with(
        &format!("tar | zstd -1 -T0 | {} (S3)", cli.name()),
        &cli.pipeline(bin, &key),
        src,
        dst,
        &cli.env(endpoint),
    );
    if let Some((before, after)) = server_before.zip(s3_server_cpu_secs()) {
        row.note
            .push_str(&format!("; S3 server (weed) CPU {:.2}s", after - before));
    }
    cli.remove(bin, &key, endpoint);
    row
}

/// One round's rows and the ratios taken within it.
fn print_round(round: u64, rows: &[Row]) {
    let find = |name: &str| rows.iter().find(|r| r.name == name);
    let zstd = find(ZSTD_ANCHOR).expect("the zstd pipeline ran");
    let s3_anchor = rows
        .iter()
        .filter(|r| r.name.ends_with("(S3)"))
        .min_by(|a, b| a.secs.total_cmp(&b.secs));
    println!(
        "\nround {}: {:<44} {:>8} {:>10} {:>10}  notes",
        round + 1,
        "pipeline",
        "wall s",
        "peak MiB",
        "x anchor"
    );
    for r in rows {
        let peak = r
            .peak_kb
            .map(|k| format!("{:.1}", k as f64 / 1024.0))
            .unwrap_or_else(|| "n/a".into());
        // Ours against its anchor: the S3 store against the faster S3
        // pipeline, everything else against the local zstd pipeline.
        let anchor = if r.name.contains("s3") {
            s3_anchor.map(|a| a.secs)
        } else if r.name.starts_with("harness") {
            Some(zstd.secs)
        } else {
            None
        };
        let ratio = anchor.map_or("".into(), |a| format!("{:.2}", r.secs / a));
        println!(
            "{:<53} {:>8.2} {:>10} {:>10}  {}",
            r.name, r.secs, peak, ratio, r.note
        );
    }
}

/// The local anchor every non-S3 row is compared with.
const ZSTD_ANCHOR: &str = "tar | zstd -1 -T0 | zstd -d | tar x";
/// The anchor's tools, the archive written whole before it is read back.
const ZSTD_TWO_STEPS: &str = "tar | zstd -1 -T0 > f; zstd -d < f | tar x";

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        run_one(&args[2], Path::new(&args[3]), Path::new(&args[4])).await;
        return;
    }
    if args.get(1).map(String::as_str) == Some("--child-tree") {
        run_tree(&args[2], Path::new(&args[3]), Path::new(&args[4])).await;
        return;
    }
    let arg = |name: &str, default: u64| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let files = arg("--files", 20_000) as usize;
    let mb = arg("--mb", 190);

    // `MOVE_BENCH_DIR=/dev/shm` takes the disk out of the comparison: on
    // this machine, creating files soon after many were deleted grows
    // tenfold in kernel CPU (ext4's `recently_deleted`), for anchor and
    // contender alike, and swamps what differs between them.
    let base = std::env::var("MOVE_BENCH_DIR")
        .or_else(|_| std::env::var("HARNESS_CACHE"))
        .map(PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir());
    std::fs::create_dir_all(&base).unwrap();
    let scratch = tempfile::Builder::new()
        .prefix("move-bench-")
        .tempdir_in(&base)
        .unwrap();
    let src = scratch.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let t = Instant::now();
    let (n, bytes) = generate(&src, files, mb);
    println!(
        "tree: {n} files, {:.1} MB, generated in {:.1}s under {}",
        bytes as f64 / 1e6,
        t.elapsed().as_secs_f64(),
        src.display()
    );

    // Each contender runs `repeat` times, in turns (gzip, zstd, the S3
    // pipelines, memory, s3, gzip, …) so a noisy moment of the machine hits
    // all alike; every run is printed, each ratio taken within its round.
    let repeat = arg("--repeat", 1).max(1);
    let endpoint = std::env::var("HARNESS_S3_ENDPOINT")
        .ok()
        .filter(|v| !v.is_empty());
    if endpoint.is_none() {
        println!("skipped the S3 store and the S3 pipelines: HARNESS_S3_ENDPOINT is not set");
    }
    let clis: Vec<(S3Cli, String)> = match &endpoint {
        None => Vec::new(),
        Some(_) => [S3Cli::Rclone, S3Cli::Aws]
            .into_iter()
            .filter_map(|cli| match cli.binary() {
                Some(bin) => Some((cli, bin)),
                None => {
                    println!(
                        "skipped the {} pipeline: no `{}` (cargo xtask bench moves installs it)",
                        cli.name(),
                        cli.name()
                    );
                    None
                }
            })
            .collect(),
    };
    if let Some(endpoint) = &endpoint {
        for (cli, bin) in &clis {
            cli.make_bucket(bin, endpoint);
        }
    }
    // `--tree-only`: only the incremental tree checkpoints below.
    if !args.iter().any(|a| a == "--tree-only") {
        let mut rounds: Vec<Vec<Row>> = Vec::new();
        for round in 0..repeat {
            let dst = |name: &str| scratch.path().join(format!("{name}-{round}"));
            let mut runs = vec![
                run_shell(
                    "tar czf | tar xzf (gzip)",
                    "cd {src} && tar czf - . | tar xzf - -C {dst}",
                    &src,
                    &dst("dst-gz"),
                ),
                run_shell(
                    ZSTD_ANCHOR,
                    "cd {src} && tar cf - . | zstd -q -1 -T0 | zstd -q -d | tar xf - -C {dst}",
                    &src,
                    &dst("dst-zstd"),
                ),
                // The same tools in the shape of a checkpoint: the archive
                // is whole (and could be hashed) before the restore starts,
                // so the two halves cannot overlap as the piped anchor's do.
                run_shell(
                    ZSTD_TWO_STEPS,
                    "cd {src} && tar cf - . | zstd -q -1 -T0 > {dst}.tar.zst && zstd -q -d < {dst}.tar.zst | tar xf - -C {dst}",
                    &src,
                    &dst("dst-zstd2"),
                ),
            ];
            if let Some(endpoint) = &endpoint {
                for (cli, bin) in &clis {
                    runs.push(run_s3_cli(
                        *cli,
                        bin,
                        endpoint,
                        &src,
                        &dst(&format!("dst-{}", cli.name())),
                        round,
                    ));
                }
            }
            runs.push(run_child("memory", &src, scratch.path()));
            runs.push(run_child("memory-encrypted", &src, scratch.path()));
            if endpoint.is_some() {
                runs.push(run_child("s3", &src, scratch.path()));
                runs.push(run_child("s3-encrypted", &src, scratch.path()));
            }
            print_round(round, &runs);
            rounds.push(runs);
            // A round's restored trees are ~1.5 GB: five rounds of them
            // filled this machine's disk once. The next round starts with
            // the source alone.
            for entry in std::fs::read_dir(scratch.path()).unwrap().flatten() {
                if entry.path() != src {
                    let _ = std::fs::remove_dir_all(entry.path())
                        .or_else(|_| std::fs::remove_file(entry.path()));
                }
            }
        }
        // The goals, run by run: the memory store against the local
        // pipeline, the S3 store against the faster S3 pipeline.
        let ratios = |ours: &str, anchor: &dyn Fn(&[Row]) -> Option<f64>| -> String {
            rounds
                .iter()
                .filter_map(|rows| {
                    let mine = rows.iter().find(|r| r.name == ours)?;
                    Some(format!("{:.2}", mine.secs / anchor(rows)?))
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let secs_of = |name: &'static str| {
            move |rows: &[Row]| rows.iter().find(|r| r.name == name).map(|r| r.secs)
        };
        let zstd = secs_of(ZSTD_ANCHOR);
        let s3_anchor = |rows: &[Row]| {
            rows.iter()
                .filter(|r| r.name.ends_with("(S3)"))
                .map(|r| r.secs)
                .min_by(f64::total_cmp)
        };
        println!("\nevery run, ours / anchor (goal: <= 1.00 in every run):");
        println!(
            "  memory store / zstd pipeline:           {}",
            ratios("harness moves, memory store", &zstd)
        );
        println!(
            "  memory store, encrypted / zstd pipeline: {}",
            ratios("harness moves, memory-encrypted store", &zstd)
        );
        let two_steps = secs_of(ZSTD_TWO_STEPS);
        println!(
            "  memory store / the same, in two steps:  {}",
            ratios("harness moves, memory store", &two_steps)
        );
        if endpoint.is_some() {
            println!(
                "  S3 store / faster S3 pipeline:          {}",
                ratios("harness moves, s3 store", &s3_anchor)
            );
            println!(
                "  S3 store, encrypted / faster S3 pipeline: {}",
                ratios("harness moves, s3-encrypted store", &s3_anchor)
            );
        }
        println!("shell peak = largest single process of the pipeline (time -v); ours = the child process's VmHWM; CPU = user + system of every process of the pipeline, or of our child");
    }

    if args.iter().any(|a| a == "--no-tree") {
        return;
    }
    let mut stores = vec!["memory", "memory-encrypted"];
    if std::env::var("HARNESS_S3_ENDPOINT").is_ok_and(|v| !v.is_empty()) {
        stores.extend(["s3", "s3-encrypted"]);
    }
    // `--repeat R` runs the tree comparison R times per store, too.
    for store_kind in stores
        .iter()
        .flat_map(|s| std::iter::repeat_n(*s, repeat as usize))
    {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--child-tree", store_kind])
            .arg(&src)
            .arg(scratch.path())
            .output()
            .unwrap();
        print!("{}", String::from_utf8_lossy(&out.stdout));
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
        // Its four trees (~0.8 GB) go with it: twenty runs' worth filled
        // this machine's disk once.
        let _ = std::fs::remove_dir_all(scratch.path().join("sandboxes-tree"));
        assert!(
            out.status.success(),
            "tree run ({store_kind}) failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
