//! QEMU processes: the command line, starting one daemonized, finding and
//! killing it by its pidfile, and the probe that decides KVM or TCG.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use harness_core::sandbox::{HostForward, NetworkPolicy};
use harness_core::{Error, Result};
use serde::{Deserialize, Serialize};

use crate::MicrovmConfig;

/// How QEMU runs the guest's CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualization (`-accel kvm -cpu host`).
    Kvm,
    /// Software emulation (`-accel tcg -cpu max`).
    Tcg,
}

impl Accel {
    /// `kvm` or `tcg`.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// What a VM is, kept as `vm.json` in its directory (and in the handle).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct VmMeta {
    pub id: String,
    pub workdir: String,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub network: NetworkPolicy,
    pub cpus: u32,
    pub memory_mb: u64,
    /// Sandbox port -> host port on 127.0.0.1 (user-mode networking).
    #[serde(default)]
    pub ports: BTreeMap<u16, u16>,
    pub accel: Accel,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// Host services on the guest's loopback (QEMU `guestfwd` rules run
    /// `agent relay SOCKET` per connection; the agent in the guest relays
    /// `127.0.0.1:<port>` to them).
    #[serde(default)]
    pub forwards: Vec<HostForward>,
    /// The host agent binary the forwards run.
    #[serde(default)]
    pub agent: Option<PathBuf>,
}

impl VmMeta {
    /// Whether the VM gets a NIC (user-mode networking): allow-all, or any
    /// policy with forwards (then restricted: nothing but the forwards).
    pub fn has_nic(&self) -> bool {
        self.network == NetworkPolicy::AllowAll || !self.forwards.is_empty()
    }
}

/// The files of one VM.
#[derive(Debug, Clone)]
pub(crate) struct VmDir(pub PathBuf);

impl VmDir {
    pub fn disk(&self) -> PathBuf {
        self.0.join("disk.qcow2")
    }
    pub fn socket(&self) -> PathBuf {
        self.0.join("agent.sock")
    }
    pub fn pidfile(&self) -> PathBuf {
        self.0.join("qemu.pid")
    }
    pub fn console(&self) -> PathBuf {
        self.0.join("console.log")
    }
    pub fn meta(&self) -> PathBuf {
        self.0.join("vm.json")
    }

    pub fn read_meta(&self) -> Result<VmMeta> {
        let text = std::fs::read_to_string(self.meta()).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::not_found(format!("no microVM at {}", self.0.display()))
            } else {
                e.into()
            }
        })?;
        serde_json::from_str(&text)
            .map_err(|e| Error::corrupt(format!("{}: {e}", self.meta().display())))
    }

    pub fn write_meta(&self, meta: &VmMeta) -> Result<()> {
        let tmp = self.0.join("vm.json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(meta).expect("meta serializes"),
        )?;
        std::fs::rename(tmp, self.meta())?;
        Ok(())
    }

    /// The QEMU process running this VM, if one is: the pidfile's pid, whose
    /// command line names this directory (a reused pid does not count).
    pub fn running_pid(&self) -> Option<i32> {
        let pid: i32 = std::fs::read_to_string(self.pidfile())
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let needle = self.socket().display().to_string();
        let text = String::from_utf8_lossy(&cmdline);
        if !text.contains(&needle) {
            return None;
        }
        // A zombie (QEMU exited, its parent not reaped yet) is not running.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let state = stat.rsplit_once(") ").map(|(_, r)| r.chars().next())?;
        (state != Some('Z')).then_some(pid)
    }

    /// The last lines of the guest console, for error messages.
    pub fn console_tail(&self) -> String {
        let text = std::fs::read_to_string(self.console()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }
}

/// The `-name` every VM of this provider runs with (how orphans are found).
pub(crate) const VM_NAME: &str = "harness-microvm";

/// Kill every QEMU of this provider whose VM directory is gone (its maker
/// removed the directory without destroying the VM, e.g. a test's temporary
/// directory after a panic): nothing can reach or resume it any more.
/// Returns how many were killed.
pub(crate) fn sweep_orphans() -> usize {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut killed = 0;
    for entry in rd.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.windows(2).any(|w| w[0] == "-name" && w[1] == VM_NAME) {
            continue;
        }
        let Some(pidfile) = args
            .windows(2)
            .find(|w| w[0] == "-pidfile")
            .map(|w| PathBuf::from(&w[1]))
        else {
            continue;
        };
        if pidfile.parent().is_some_and(|d| !d.exists()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            killed += 1;
        }
    }
    killed
}

/// Kill the VM's QEMU (SIGKILL) and wait until it is gone (up to 10 s).
pub(crate) async fn kill(dir: &VmDir) {
    if let Some(pid) = dir.running_pid() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    wait_gone(dir, Duration::from_secs(10)).await;
}

/// Wait until no QEMU runs the VM.
pub(crate) async fn wait_gone(dir: &VmDir, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while dir.running_pid().is_some() {
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

/// The QEMU command line of `meta`'s VM in `dir`.
pub(crate) fn qemu_args(config: &MicrovmConfig, dir: &VmDir, meta: &VmMeta) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "-name".into(),
        VM_NAME.into(),
        "-M".into(),
        "microvm".into(),
        "-accel".into(),
        meta.accel.as_str().into(),
        "-cpu".into(),
        match meta.accel {
            Accel::Kvm => "host".into(),
            Accel::Tcg => "max".into(),
        },
        "-m".into(),
        meta.memory_mb.to_string(),
        "-smp".into(),
        meta.cpus.to_string(),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        "-daemonize".into(),
        "-pidfile".into(),
        dir.pidfile().display().to_string(),
        "-kernel".into(),
        meta.kernel.display().to_string(),
        "-initrd".into(),
        meta.initramfs.display().to_string(),
        "-append".into(),
        // No PIT/HPET to calibrate the TSC against on microvm under TCG:
        // without a given frequency the kernel waits forever for a timer.
        format!(
            "console=ttyS0 earlyprintk=serial panic=-1 quiet tsc_early_khz=2000000 harness.net={}{}",
            if meta.has_nic() { "user" } else { "none" },
            if meta.forwards.is_empty() {
                String::new()
            } else {
                format!(
                    " harness.fwd={}",
                    meta.forwards
                        .iter()
                        .map(|f| f.port.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                )
            }
        ),
        "-serial".into(),
        format!("file:{}", dir.console().display()),
        "-device".into(),
        "virtio-serial-device".into(),
        "-chardev".into(),
        format!(
            "socket,id=agent,path={},server=on,wait=off",
            dir.socket().display()
        ),
        "-device".into(),
        format!(
            "virtserialport,chardev=agent,name={}",
            harness_microvm_agent::PORT_NAME
        ),
        "-drive".into(),
        format!(
            "id=root,file={},format=qcow2,if=none,discard=unmap",
            dir.disk().display()
        ),
        "-device".into(),
        "virtio-blk-device,drive=root".into(),
    ];
    if meta.has_nic() {
        let mut netdev = "user,id=n0".to_string();
        if meta.network != NetworkPolicy::AllowAll {
            // The guest reaches neither the host nor the outside; the
            // forwarding rules below still apply.
            netdev.push_str(",restrict=on");
        }
        for (guest, host) in &meta.ports {
            netdev.push_str(&format!(",hostfwd=tcp:127.0.0.1:{host}-:{guest}"));
        }
        if let Some(agent) = &meta.agent {
            for f in &meta.forwards {
                netdev.push_str(&format!(
                    ",guestfwd=tcp:{}:{}-cmd:{} relay {}",
                    harness_microvm_agent::FORWARD_ADDR,
                    f.port,
                    agent.display(),
                    f.socket
                ));
            }
        }
        args.extend([
            "-netdev".into(),
            netdev,
            "-device".into(),
            "virtio-net-device,netdev=n0".into(),
        ]);
    }
    let _ = config;
    args
}

/// Start QEMU for the VM (daemonized: it outlives this process). Returns
/// once QEMU has set up its devices (the agent socket exists).
pub(crate) async fn start(config: &MicrovmConfig, dir: &VmDir, meta: &VmMeta) -> Result<()> {
    let _ = std::fs::remove_file(dir.socket());
    let _ = std::fs::remove_file(dir.pidfile());
    let errlog = dir.0.join("qemu.err");
    let err = std::fs::File::create(&errlog)?;
    let status = tokio::process::Command::new(&config.qemu)
        .args(qemu_args(config, dir, meta))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(err)
        .status()
        .await
        .map_err(|e| {
            Error::backend(format!(
                "cannot run {} (apt-get install qemu-system-x86): {e}",
                config.qemu.display()
            ))
        })?;
    if !status.success() {
        return Err(Error::backend(format!(
            "{} failed ({status}): {}",
            config.qemu.display(),
            std::fs::read_to_string(&errlog).unwrap_or_default().trim()
        )));
    }
    Ok(())
}

/// Make `disk` a qcow2 overlay on `backing`.
pub(crate) async fn overlay(config: &MicrovmConfig, backing: &Path, disk: &Path) -> Result<()> {
    let format = if backing.extension().is_some_and(|e| e == "qcow2") {
        "qcow2"
    } else {
        "raw"
    };
    let out = tokio::process::Command::new(&config.qemu_img)
        .args(["create", "-q", "-f", "qcow2", "-F", format, "-b"])
        .arg(backing)
        .arg(disk)
        .output()
        .await
        .map_err(|e| {
            Error::backend(format!(
                "cannot run {} (apt-get install qemu-utils): {e}",
                config.qemu_img.display()
            ))
        })?;
    if !out.status.success() {
        return Err(Error::backend(format!(
            "qemu-img create over {} failed: {}",
            backing.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// A free TCP port on 127.0.0.1 (for a `hostfwd`).
pub(crate) fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}
