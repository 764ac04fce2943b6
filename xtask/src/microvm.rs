//! `cargo xtask microvm`: the guest of the `sandbox-microvm` provider, built
//! offline from Debian packages and cached in `$HARNESS_CACHE/microvm/`.
//!
//! - the kernel: `vmlinux` extracted from the Debian `linux-image-*-amd64`
//!   package's compressed `vmlinuz` (QEMU's microvm machine boots the
//!   uncompressed ELF through PVH), keyed by the package file;
//! - the initramfs: `busybox` (Debian `busybox-static`), the virtio, ext4
//!   and net modules of that kernel, the init script
//!   (`crates/sandbox-microvm/guest/init`) and the static guest agent
//!   (`harness-microvm-agent`, built here with `+crt-static`);
//! - the root disk: an ext4 image made (`mkfs.ext4 -d`) from the same
//!   debootstrapped rootfs tarball the Docker test image is imported from.
//!
//! `assets.json` in that directory names the three files; the provider's
//! tests find it through `HARNESS_MICROVM_ASSETS` (`cargo xtask env`).
//! Everything is keyed by its inputs, so an unchanged recipe is a no-op and
//! a changed agent rebuilds only the initramfs.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::util::{self, run};

/// Kernel modules loaded by the init script, in this order (each one's
/// dependencies come before it; checked when the initramfs is built).
pub const MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "failover",
    "net_failover",
    "virtio_net",
    "crc16",
    "mbcache",
    "jbd2",
    "crc32c_generic",
    "ext4",
];

/// Size of the (sparse) root disk.
const ROOT_DISK_BYTES: u64 = 8 << 30;

/// `$HARNESS_CACHE/microvm`.
pub fn dir() -> PathBuf {
    util::cache_dir().join("microvm")
}

/// The agent binary `cargo build` leaves for the static build.
fn agent_binary() -> PathBuf {
    util::cargo_target_dir().join("x86_64-unknown-linux-gnu/release/harness-microvm-agent")
}

/// Build the static guest agent (incremental: quick when unchanged).
pub fn build_agent() -> Result<PathBuf> {
    let mut cmd = util::cargo();
    cmd.args([
        "build",
        "--release",
        "-p",
        "harness-microvm-agent",
        "--target",
        "x86_64-unknown-linux-gnu",
    ])
    // With an explicit --target these flags reach only that target's
    // artifacts (not build scripts, not the host builds of the workspace).
    .env("RUSTFLAGS", "-C target-feature=+crt-static");
    run(&mut cmd).context("building the static guest agent")?;
    let bin = agent_binary();
    if !bin.exists() {
        bail!("cargo did not leave {}", bin.display());
    }
    Ok(bin)
}

/// `apt-get download` `package` into `debs` unless a file for it is there;
/// returns the .deb.
fn download_deb(debs: &Path, package: &str) -> Result<PathBuf> {
    let find = || -> Option<PathBuf> {
        let prefix = format!("{package}_");
        std::fs::read_dir(debs)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
            })
    };
    if let Some(p) = find() {
        return Ok(p);
    }
    run(Command::new("apt-get")
        .current_dir(debs)
        .args(["download", "-q", package]))
    .with_context(|| format!("apt-get download {package} (run `apt-get update`?)"))?;
    find().with_context(|| format!("apt-get download left no {package}_*.deb"))
}

/// The concrete kernel package `linux-image-amd64` depends on.
fn kernel_package() -> Result<String> {
    let out = util::output(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))?;
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
        .map(str::to_string)
        .context("apt-cache depends linux-image-amd64 names no linux-image-*-amd64")
}

fn find_xz(data: &[u8]) -> Option<usize> {
    const XZ: &[u8] = b"\xfd7zXZ\0";
    data.windows(XZ.len()).position(|w| w == XZ)
}

/// The `depends=` list in a module's `.modinfo`.
fn module_depends(ko: &[u8]) -> Vec<String> {
    const KEY: &[u8] = b"depends=";
    let Some(at) = ko.windows(KEY.len()).position(|w| w == KEY) else {
        return Vec::new();
    };
    let rest = &ko[at + KEY.len()..];
    let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end])
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// A cpio "newc" archive writer (what the kernel unpacks as initramfs).
struct Cpio {
    out: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn new() -> Self {
        Cpio {
            out: Vec::new(),
            ino: 1,
        }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        );
        self.ino += 1;
        self.out.extend_from_slice(header.as_bytes());
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040755, b"");
    }

    fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry(name, 0o100000 | mode, data);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, b"");
        while !self.out.len().is_multiple_of(512) {
            self.out.push(0);
        }
        self.out
    }
}

fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(data)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Build (or find cached) kernel, initramfs and root disk; write
/// `assets.json`. Returns the directory.
pub fn build(force: bool) -> Result<PathBuf> {
    let start = Instant::now();
    let root = dir();
    let debs = root.join("debs");
    std::fs::create_dir_all(&debs)?;

    let kpkg = kernel_package()?;
    let kdeb = download_deb(&debs, &kpkg)?;
    let busybox_deb = download_deb(&debs, "busybox-static")?;
    let kkey = util::stable_hash(&format!(
        "{}",
        kdeb.file_name().unwrap_or_default().to_string_lossy()
    ));
    let kdir = root.join(format!("kernel-{kkey}"));
    let vmlinux = kernel(&root, &kdir, &kkey, &kdeb, &kpkg, force)?;
    let (rootfs, rkey) = root_disk(&root, force)?;
    let agent = build_agent()?;
    let agent_bytes = std::fs::read(&agent)?;
    let initramfs = initramfs(&root, &kdir, &kkey, &busybox_deb, &agent_bytes, force)?;

    // The same static binary on the host: QEMU runs `agent relay SOCKET`
    // for every guest connection to a host forward.
    let host_agent = root.join(format!("agent-{}", sha_like(&agent_bytes)));
    if !host_agent.exists() {
        let tmp = host_agent.with_extension("tmp");
        std::fs::copy(&agent, &tmp)?;
        std::fs::rename(&tmp, &host_agent)?;
    }
    let manifest = serde_json::json!({
        "agent": host_agent,
        "kernel": vmlinux,
        "initramfs": initramfs,
        "rootfs": rootfs,
        "rootfs_key": rkey,
    });
    write_atomic(
        &root.join("assets.json"),
        serde_json::to_string_pretty(&manifest)?.as_bytes(),
    )?;
    // Initramfs files and host agents of older builds add up: keep the
    // newest 3 of each.
    prune_old(&root, &initramfs, "initramfs-", ".cpio");
    prune_old(&root, &host_agent, "agent-", "");
    println!(
        "microvm: assets ready in {} ({})",
        util::fmt_duration(start.elapsed()),
        root.join("assets.json").display()
    );
    Ok(root)
}

/// The kernel of the package `kdeb` (`kpkg`), unpacked into `kdir` unless
/// it is there already (or `force`): `vmlinux`, and the modules
/// [`MODULES`] loads, flat. Returns the path of `vmlinux`.
fn kernel(
    root: &Path,
    kdir: &Path,
    kkey: &str,
    kdeb: &Path,
    kpkg: &str,
    force: bool,
) -> Result<PathBuf> {
    let vmlinux = kdir.join("vmlinux");
    if force || !vmlinux.exists() {
        let tmp = root.join(format!("kernel-{kkey}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        run(Command::new("dpkg-deb")
            .arg("-x")
            .arg(kdeb)
            .arg(tmp.join("x")))?;
        let boot = tmp.join("x/boot");
        let vmlinuz = std::fs::read_dir(&boot)?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
            })
            .context("no vmlinuz in the kernel package")?;
        std::fs::write(tmp.join("vmlinux"), unpack_vmlinuz(&vmlinuz)?)?;
        // The modules the init script loads, flat.
        copy_modules(&tmp.join("x/lib/modules"), &tmp.join("modules"))?;
        std::fs::remove_dir_all(tmp.join("x"))?;
        let _ = std::fs::remove_dir_all(kdir);
        std::fs::rename(&tmp, kdir)?;
        println!("microvm: kernel {kpkg} -> {}", vmlinux.display());
    } else {
        println!("microvm: kernel cached ({})", vmlinux.display());
    }
    Ok(vmlinux)
}

/// The ELF kernel inside `vmlinuz`: its xz stream, decompressed.
fn unpack_vmlinuz(vmlinuz: &Path) -> Result<Vec<u8>> {
    let data = std::fs::read(vmlinuz)?;
    let at = find_xz(&data).context("vmlinuz holds no xz stream (not CONFIG_KERNEL_XZ?)")?;
    let mut xz = Command::new("xz")
        .args(["-dc", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("running xz")?;
    let mut stdin = xz.stdin.take().expect("piped");
    let payload = data[at..].to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&payload);
    });
    let out = xz.wait_with_output()?;
    let _ = feeder.join();
    if !out.stdout.starts_with(b"\x7fELF") {
        bail!(
            "the xz stream in {} is not an ELF kernel",
            vmlinuz.display()
        );
    }
    Ok(out.stdout)
}

/// Copy the [`MODULES`] out of the package's `lib` (`/lib/modules`) into
/// `mods`, flat, checking that each depends only on modules loaded before
/// it.
fn copy_modules(lib: &Path, mods: &Path) -> Result<()> {
    std::fs::create_dir_all(mods)?;
    let kver = std::fs::read_dir(lib)?
        .flatten()
        .next()
        .context("no /lib/modules in the kernel package")?
        .path();
    let mut loaded: Vec<&str> = Vec::new();
    for m in MODULES {
        let ko = find_module(&kver, m)?
            .with_context(|| format!("module {m} not in {}", kver.display()))?;
        let bytes = std::fs::read(&ko)?;
        for dep in module_depends(&bytes) {
            if !loaded.contains(&dep.as_str()) {
                bail!("module {m} depends on {dep}, which MODULES does not load before it");
            }
        }
        std::fs::write(mods.join(format!("{m}.ko")), &bytes)?;
        loaded.push(m);
    }
    Ok(())
}

/// The root disk, an ext4 image of the Docker test image's rootfs tarball,
/// made unless there. Returns its path and key.
fn root_disk(root: &Path, force: bool) -> Result<(PathBuf, String)> {
    let tarball = crate::image::rootfs_tarball(false)?;
    // A forced rebuild gets a new key: snapshots are qcow2 overlays on the
    // root disk by path, and `mkfs.ext4` never makes the same bytes twice,
    // so an image must never be replaced in place.
    let nonce = if force {
        format!(" {:?}", std::time::SystemTime::now())
    } else {
        String::new()
    };
    let rkey = util::stable_hash(&format!(
        "{} {ROOT_DISK_BYTES} v1{nonce}",
        tarball.file_name().unwrap_or_default().to_string_lossy()
    ));
    let rootfs = root.join(format!("rootfs-{rkey}.img"));
    if !rootfs.exists() {
        let t = Instant::now();
        let tree = root.join(format!("rootfs-{rkey}.tree"));
        let _ = std::fs::remove_dir_all(&tree);
        std::fs::create_dir_all(&tree)?;
        run(Command::new("tar")
            .arg("-C")
            .arg(&tree)
            .args(["--numeric-owner", "-xf"])
            .arg(&tarball))?;
        for d in ["workspace", "run", "proc", "sys", "dev", "tmp"] {
            std::fs::create_dir_all(tree.join(d))?;
        }
        let tmp = root.join(format!("rootfs-{rkey}.img.tmp"));
        let _ = std::fs::remove_file(&tmp);
        std::fs::File::create(&tmp)?.set_len(ROOT_DISK_BYTES)?;
        run(Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-L",
                "harness-root",
                "-E",
                "root_owner=0:0",
                "-d",
            ])
            .arg(&tree)
            .arg(&tmp))
        .context("mkfs.ext4 -d (e2fsprogs)")?;
        std::fs::remove_dir_all(&tree)?;
        std::fs::rename(&tmp, &rootfs)?;
        println!(
            "microvm: root disk {} in {}",
            rootfs.display(),
            util::fmt_duration(t.elapsed())
        );
    } else {
        println!("microvm: root disk cached ({})", rootfs.display());
    }
    Ok((rootfs, rkey))
}

/// The initramfs: busybox (from `busybox_deb`), the kernel's modules (from
/// `kdir`) and their order, the init script and the agent, written unless
/// the same bytes are there. Returns its path.
fn initramfs(
    root: &Path,
    kdir: &Path,
    kkey: &str,
    busybox_deb: &Path,
    agent_bytes: &[u8],
    force: bool,
) -> Result<PathBuf> {
    let init = std::fs::read(util::repo_root().join("crates/sandbox-microvm/guest/init"))
        .context("reading crates/sandbox-microvm/guest/init")?;
    let bb_dir = root.join("busybox");
    let busybox = bb_dir.join("bin/busybox");
    if force || !busybox.exists() {
        let _ = std::fs::remove_dir_all(&bb_dir);
        run(Command::new("dpkg-deb")
            .arg("-x")
            .arg(busybox_deb)
            .arg(&bb_dir))?;
    }
    let busybox_bytes = std::fs::read(&busybox)?;
    let mut modules = Vec::new();
    for m in MODULES {
        modules.push((
            m,
            std::fs::read(kdir.join("modules").join(format!("{m}.ko")))?,
        ));
    }
    let mut cpio = Cpio::new();
    for d in ["bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"] {
        cpio.dir(d);
    }
    cpio.file("bin/busybox", 0o755, &busybox_bytes);
    cpio.file("init", 0o755, &init);
    cpio.file("harness-agent", 0o755, agent_bytes);
    cpio.file("lib/modules/order", 0o644, MODULES.join("\n").as_bytes());
    for (m, bytes) in &modules {
        cpio.file(&format!("lib/modules/{m}.ko"), 0o644, bytes);
    }
    let initramfs_bytes = cpio.finish();
    let ikey = util::stable_hash(&format!(
        "{kkey} {} {}",
        initramfs_bytes.len(),
        sha_like(&initramfs_bytes)
    ));
    let initramfs = root.join(format!("initramfs-{ikey}.cpio"));
    if !initramfs.exists() {
        write_atomic(&initramfs, &initramfs_bytes)?;
        println!("microvm: initramfs {}", initramfs.display());
    } else {
        println!("microvm: initramfs cached ({})", initramfs.display());
    }
    Ok(initramfs)
}

fn find_module(dir: &Path, name: &str) -> Result<Option<PathBuf>> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let p = entry.path();
        if entry.file_type()?.is_dir() {
            if let Some(found) = find_module(&p, name)? {
                return Ok(Some(found));
            }
        } else if p
            .file_name()
            .is_some_and(|n| n.to_string_lossy() == format!("{name}.ko"))
        {
            return Ok(Some(p));
        }
    }
    Ok(None)
}

/// A cheap content fingerprint (FNV-1a over the bytes).
fn sha_like(data: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn prune_old(root: &Path, keep: &Path, prefix: &str, suffix: &str) {
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    let mut old: Vec<(std::time::SystemTime, PathBuf)> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p != keep
                && p.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    n.starts_with(prefix) && n.ends_with(suffix) && !n.ends_with(".tmp")
                })
        })
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .collect();
    old.sort();
    old.reverse();
    for (_, p) in old.into_iter().skip(2) {
        let _ = std::fs::remove_file(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_depends_reads_modinfo() {
        let ko = b"\x7fELF....license=GPL\0depends=virtio,virtio_ring\0vermagic=6.1\0";
        assert_eq!(module_depends(ko), vec!["virtio", "virtio_ring"]);
        assert!(module_depends(b"depends=\0").is_empty());
    }

    #[test]
    fn cpio_is_newc_and_padded() {
        let mut c = Cpio::new();
        c.file("init", 0o755, b"#!/bin/sh\n");
        let out = c.finish();
        assert!(out.starts_with(b"070701"));
        assert_eq!(out.len() % 512, 0);
        assert!(out.windows(10).any(|w| w == b"TRAILER!!!"));
    }
}
