//! The sealed local sandbox: a boundary made of Linux namespaces, an
//! unprivileged uid and cgroups, with the tree still a host directory
//! (`docs/sandbox-local.md`, *Sealed*; the threat model in
//! `docs/security.md`).
//!
//! A sealed sandbox has a **holder**: a `bwrap` (bubblewrap, Debian's
//! `bubblewrap` package) started once per sandbox, detached, that owns the
//! sandbox's user, mount, PID, IPC, UTS, network and cgroup namespaces and
//! sleeps. Every command joins the holder's namespaces with `nsenter` (as
//! the sandbox uid, `no_new_privs`, in the sandbox's cgroups) instead of
//! making namespaces of its own, so the sandbox outlives the process that
//! made it and any exec can come from any process: a resumed sandbox
//! finds its holder by the pid (and start time) in `sandbox.json`.
//!
//! Inside, the root is a fresh tmpfs with the host's `/usr` and `/etc`
//! read-only, a private `/proc` (the sandbox's processes only), `/dev`,
//! `/tmp`, and the sandbox's own entries (`work/`, `home/`, recipe files)
//! bound read-write at their host paths, so paths stay host paths. Nothing
//! else of the host is there: not the harness home, not other sandboxes,
//! not `sandbox.json` (a sealed command cannot rewrite its own policy).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use harness_core::sandbox::{HostForward, NetworkPolicy};
use harness_core::{Error, Result};
use serde::{Deserialize, Serialize};

/// Names the `bwrap` binary (else `bwrap` on `PATH`).
pub const BWRAP_ENV: &str = "HARNESS_BWRAP";
/// The host uid (and gid) sealed sandboxes run as when the harness runs as
/// root; when it does not, they run as the harness's own uid.
pub const UID_ENV: &str = "HARNESS_LOCAL_SANDBOX_UID";
/// [`UID_ENV`]'s default: above the system and login ranges, and owned by
/// no account, so no file of the host belongs to it.
pub const DEFAULT_UID: u32 = 100_000;
/// The directory in a sealed sandbox holding what only the host sees (the
/// holder's log, the sandbox's `resolv.conf`); never bound inside.
pub(crate) const SEAL_DIR: &str = ".seal";
/// How long the holder may take to set its namespaces up.
const HOLDER_START: Duration = Duration::from_secs(20);

/// What `sandbox.json` records of a sealed sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct SealMeta {
    /// Host uid and gid of every command.
    pub uid: u32,
    pub gid: u32,
    /// Host pid of the process at pid 1 of the sandbox's namespaces.
    pub holder: i32,
    /// Its start time (`/proc/<pid>/stat` field 22): a reused pid is not it.
    pub holder_start: u64,
    /// The `slirp4netns` giving `allow-all` its user-mode network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slirp: Option<i32>,
    /// The sandbox's cgroup directories (one on cgroup v2; the memory and
    /// cpu controllers' on v1); empty without limits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cgroups: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
}

/// The programs a sealed sandbox needs, found on this host.
#[derive(Debug, Clone)]
pub(crate) struct Tools {
    bwrap: PathBuf,
    nsenter: PathBuf,
    /// To drop from root to the sandbox uid (util-linux).
    setpriv: PathBuf,
    slirp: Option<PathBuf>,
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    })
}

impl Tools {
    /// Every tool `policy` needs, or `Unsupported` naming what is missing
    /// and how to get it: a sealed sandbox is never quietly a host one.
    pub(crate) fn find(policy: &NetworkPolicy) -> Result<Self> {
        let bwrap = std::env::var_os(BWRAP_ENV)
            .map(PathBuf::from)
            .or_else(|| on_path("bwrap"))
            .ok_or_else(|| {
                Error::unsupported(format!(
                    "the sealed local sandbox needs bubblewrap: install it (`apt install \
                     bubblewrap`) or name its bwrap in {BWRAP_ENV}"
                ))
            })?;
        let util = |name: &str| {
            on_path(name).ok_or_else(|| {
                Error::unsupported(format!(
                    "the sealed local sandbox needs {name} (util-linux) on PATH"
                ))
            })
        };
        let slirp = if matches!(policy, NetworkPolicy::AllowAll) {
            Some(on_path("slirp4netns").ok_or_else(|| {
                Error::unsupported(
                    "a sealed local sandbox under allow-all reaches the network through \
                     slirp4netns, which is not installed (`apt install slirp4netns`); use \
                     deny-all or custom, or install it",
                )
            })?)
        } else {
            None
        };
        Ok(Self {
            bwrap,
            nsenter: util("nsenter")?,
            setpriv: util("setpriv")?,
            slirp,
        })
    }
}

/// The host uid and gid a sealed sandbox runs as (see [`UID_ENV`]).
pub(crate) fn sandbox_ids() -> Result<(u32, u32)> {
    let euid = nix::unistd::geteuid().as_raw();
    if euid != 0 {
        return Ok((euid, nix::unistd::getegid().as_raw()));
    }
    let uid = match std::env::var(UID_ENV) {
        Ok(v) => v
            .trim()
            .parse::<u32>()
            .map_err(|_| Error::invalid(format!("{UID_ENV}={v:?} is not a uid")))?,
        Err(_) => DEFAULT_UID,
    };
    if uid == 0 {
        return Err(Error::invalid(format!(
            "{UID_ENV}=0: a sealed sandbox never runs as root"
        )));
    }
    Ok((uid, uid))
}

/// What a holder is made of.
pub(crate) struct HolderPlan<'a> {
    pub dir: &'a Path,
    /// Host paths bound read-write at the same path inside.
    pub binds: Vec<PathBuf>,
    pub network: &'a NetworkPolicy,
    pub forwards: &'a [HostForward],
    pub gate: Option<&'a Path>,
    pub uid: u32,
    pub gid: u32,
    pub memory_mb: Option<u64>,
    pub cpus: Option<f64>,
}

/// Start the holder (and its network and cgroups); the record to keep.
pub(crate) fn start(tools: &Tools, plan: &HolderPlan<'_>) -> Result<SealMeta> {
    let seal_dir = plan.dir.join(SEAL_DIR);
    std::fs::create_dir_all(&seal_dir)?;
    // Searchable, not listable: bwrap (as the sandbox uid) opens the
    // resolv.conf here; nothing here is bound inside.
    std::fs::set_permissions(&seal_dir, std::fs::Permissions::from_mode(0o711))?;
    let cgroups = cgroups::create(plan.dir, plan.memory_mb, plan.cpus)?;
    let started = (|| {
        let (holder, holder_start) = spawn_holder(tools, plan, &seal_dir, &cgroups)?;
        let mut meta = SealMeta {
            uid: plan.uid,
            gid: plan.gid,
            holder,
            holder_start,
            slirp: None,
            cgroups: cgroups.iter().map(|p| p.display().to_string()).collect(),
            memory_mb: plan.memory_mb,
            cpus: plan.cpus,
        };
        let network = (|| {
            if let Some(slirp) = &tools.slirp {
                meta.slirp = Some(spawn_slirp(slirp, &meta, &seal_dir)?);
            }
            if !plan.forwards.is_empty() {
                let gate = plan.gate.ok_or_else(|| {
                    Error::unsupported(
                        "a sealed local sandbox with forwards needs harness-sandbox-gate",
                    )
                })?;
                start_forwards(tools, gate, holder, plan.forwards)?;
            }
            Ok::<(), Error>(())
        })();
        if let Err(e) = network {
            stop(&meta);
            return Err(e);
        }
        Ok(meta)
    })();
    if started.is_err() {
        for dir in &cgroups {
            let _ = std::fs::remove_dir(dir);
        }
    }
    started
}

/// The bwrap arguments that make the sandbox's world.
fn bwrap_args(plan: &HolderPlan<'_>, seal_dir: &Path) -> Vec<String> {
    let mut args: Vec<String> = [
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-net",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
        "--ro-bind",
        "/etc",
        "/etc",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    // Merged-/usr hosts make these symlinks into /usr; others have them as
    // directories of their own.
    for top in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"] {
        match std::fs::symlink_metadata(top) {
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(target) = std::fs::read_link(top) {
                    args.extend(["--symlink".into(), target.display().to_string(), top.into()]);
                }
            }
            Ok(m) if m.is_dir() => args.extend(["--ro-bind".into(), top.into(), top.into()]),
            _ => {}
        }
    }
    if matches!(plan.network, NetworkPolicy::AllowAll) {
        // slirp4netns answers DNS at 10.0.2.3; the host's resolver (often
        // on its own loopback) is out of reach.
        args.extend([
            "--ro-bind".into(),
            seal_dir.join("resolv.conf").display().to_string(),
            "/etc/resolv.conf".into(),
        ]);
    }
    // A /dev of the few devices a command needs, not `--dev`: that mounts a
    // devpts, for which bwrap nests a second user namespace, and the
    // network namespace would then belong to one no process is in
    // (slirp4netns joins the sandbox's through its holder's).
    args.extend(
        ["--proc", "/proc", "--tmpfs", "/dev"]
            .into_iter()
            .map(String::from),
    );
    for dev in ["null", "zero", "full", "random", "urandom", "tty"] {
        let dev = format!("/dev/{dev}");
        args.extend(["--dev-bind-try".into(), dev.clone(), dev]);
    }
    args.extend(
        [
            "--symlink",
            "/proc/self/fd",
            "/dev/fd",
            "--symlink",
            "/proc/self/fd/0",
            "/dev/stdin",
            "--symlink",
            "/proc/self/fd/1",
            "/dev/stdout",
            "--symlink",
            "/proc/self/fd/2",
            "/dev/stderr",
            "--tmpfs",
            "/dev/shm",
            "--tmpfs",
            "/run",
        ]
        .into_iter()
        .map(String::from),
    );
    let tmp = plan.dir.join("tmp").display().to_string();
    args.extend(["--bind".into(), tmp, "/tmp".into()]);
    for bind in &plan.binds {
        let p = bind.display().to_string();
        args.extend(["--bind".into(), p.clone(), p]);
    }
    args.extend(["--chdir".into(), "/".into(), "--".into()]);
    args.extend(["sleep".into(), "infinity".into()]);
    args
}

/// Spawn the holder, detached, and wait until its namespaces are set up.
fn spawn_holder(
    tools: &Tools,
    plan: &HolderPlan<'_>,
    seal_dir: &Path,
    cgroups: &[PathBuf],
) -> Result<(i32, u64)> {
    if matches!(plan.network, NetworkPolicy::AllowAll) {
        std::fs::write(seal_dir.join("resolv.conf"), "nameserver 10.0.2.3\n")?;
    }
    let log_path = seal_dir.join("holder.log");
    let log = std::fs::File::create(&log_path)?;
    let mut line = Vec::new();
    if nix::unistd::geteuid().is_root() {
        line.extend([
            tools.setpriv.display().to_string(),
            format!("--reuid={}", plan.uid),
            format!("--regid={}", plan.gid),
            "--clear-groups".into(),
            "--".into(),
        ]);
    }
    line.push(tools.bwrap.display().to_string());
    line.extend(bwrap_args(plan, seal_dir));
    let line = joined(cgroups, false, line);
    let mut cmd = Command::new(&line[0]);
    cmd.args(&line[1..]);
    let mut child = daemon(&mut cmd, log)?.spawn().map_err(|e| {
        Error::backend(format!(
            "cannot start the sealed sandbox's holder ({}): {e}",
            tools.bwrap.display()
        ))
    })?;
    let bwrap = child.id() as i32;
    // bwrap clones the sandbox's pid 1 (its init) once it made the
    // namespaces, and that init forks the holder's `sleep` once the mounts
    // are in place: the namespaces are ready when the init has a child.
    let deadline = std::time::Instant::now() + HOLDER_START;
    let init = loop {
        if let Some(init) = children(bwrap).first().copied() {
            if !children(init).is_empty() {
                break Some(init);
            }
        }
        if matches!(child.try_wait(), Ok(Some(_))) || std::time::Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let Some(init) = init else {
        let _ = child.kill();
        let _ = child.wait();
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        return Err(Error::unsupported(format!(
            "the sealed sandbox's holder did not start (bwrap: {}): the sealed local sandbox needs \
             unprivileged user namespaces (kernel.unprivileged_userns_clone, \
             user.max_user_namespaces), and the sandbox uid must be able to reach {} (every \
             parent directory searchable)",
            log.trim(),
            plan.dir.display()
        )));
    };
    // The holder is nobody's child once we return: reap bwrap's monitor on
    // a thread so it leaves no zombie behind in this process.
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    let start = start_time(init).ok_or_else(|| {
        Error::backend(format!(
            "the sealed sandbox's holder (pid {init}) exited at once"
        ))
    })?;
    Ok((init, start))
}

/// `cmd` as one of the sandbox's daemons: an environment of its own (the
/// holder's is readable inside, where it is pid 1: nothing of the
/// harness's goes in), output to `log`, and out of the harness's process
/// group (a ^C to the harness is not one to the sandbox).
fn daemon(cmd: &mut Command, log: std::fs::File) -> Result<&mut Command> {
    Ok(cmd
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0))
}

/// The children of `pid` (`/proc/<pid>/task/<pid>/children`).
fn children(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// `line` run inside `cgroups` (a shell writes itself into each, then
/// `exec`s: every process the command makes is born there), with
/// `no_new_privs` when asked (`setpriv`, util-linux).
fn joined(cgroups: &[PathBuf], no_new_privs: bool, line: Vec<String>) -> Vec<String> {
    let mut line = line;
    if no_new_privs {
        let mut with = vec!["setpriv".to_string(), "--no-new-privs".into(), "--".into()];
        with.append(&mut line);
        line = with;
    }
    if cgroups.is_empty() {
        return line;
    }
    let mut script = String::new();
    for dir in cgroups {
        script.push_str(&format!(
            "echo 0 > {} && ",
            harness_core::sandbox::shell_quote(&dir.join("cgroup.procs").display().to_string())
        ));
    }
    script.push_str("exec \"$@\"");
    let mut with = vec![
        "/bin/sh".to_string(),
        "-c".into(),
        script,
        "harness-join".into(),
    ];
    with.append(&mut line);
    with
}

/// Give the holder's network namespace a user-mode network (`allow-all`),
/// with the host's loopback out of reach. slirp4netns runs as the
/// harness's user (root needs no readable `/dev/net/tun`), in its own
/// sandbox and seccomp filter.
fn spawn_slirp(slirp: &Path, meta: &SealMeta, seal_dir: &Path) -> Result<i32> {
    let log = std::fs::File::create(seal_dir.join("slirp.log"))?;
    let mut cmd = Command::new(slirp);
    cmd.args([
        "--configure",
        "--mtu=65520",
        "--disable-host-loopback",
        "--enable-sandbox",
        "--enable-seccomp",
        &meta.holder.to_string(),
        "tap0",
    ]);
    let mut child = daemon(&mut cmd, log)?
        .spawn()
        .map_err(|e| Error::backend(format!("cannot start {}: {e}", slirp.display())))?;
    let pid = child.id() as i32;
    // Ready when the tap device is up inside (bounded).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(seal_dir.join("slirp.log")).unwrap_or_default();
            return Err(Error::backend(format!(
                "slirp4netns exited ({status}): {}",
                log.trim()
            )));
        }
        let tap = std::fs::read_to_string(format!("/proc/{}/net/dev", meta.holder))
            .map(|t| t.contains("tap0"))
            .unwrap_or(false);
        if tap {
            break;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            return Err(Error::backend(
                "slirp4netns did not bring the sandbox's network up within 10 s",
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    Ok(pid)
}

/// Serve the forwards inside the holder's network namespace: the gate's
/// daemon, joined to that namespace only (it reaches the host sockets from
/// the host's file system), living while anything is left in it.
fn start_forwards(tools: &Tools, gate: &Path, holder: i32, forwards: &[HostForward]) -> Result<()> {
    let wire: Vec<harness_sandbox_gate::Forward> = forwards
        .iter()
        .map(|f| harness_sandbox_gate::Forward::new(f.port, f.socket.clone()))
        .collect();
    let line = harness_sandbox_gate::command_line(
        &gate.display().to_string(),
        false,
        &wire,
        &["true".into()],
    );
    let out = Command::new(&tools.nsenter)
        .arg(format!("--target={holder}"))
        .arg("--net")
        .arg("--")
        .args(&line)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::backend(format!("starting the sandbox's forwards: {e}")))?;
    if !out.status.success() {
        return Err(Error::backend(format!(
            "starting the sandbox's forwards failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// `/proc/<pid>/stat`'s start time, `None` when there is no such process
/// (or it is a zombie).
pub(crate) fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3, start time field 22.
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Whether the holder `meta` names still runs.
pub(crate) fn alive(meta: &SealMeta) -> bool {
    start_time(meta.holder) == Some(meta.holder_start)
}

/// Take the sandbox's processes down: the holder is pid 1 of its PID
/// namespace, and the kernel kills every process there with it.
pub(crate) fn stop(meta: &SealMeta) {
    if alive(meta) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(meta.holder),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    if let Some(slirp) = meta.slirp {
        // Only if it is still slirp4netns (its pid may have been reused).
        let comm = std::fs::read_to_string(format!("/proc/{slirp}/comm")).unwrap_or_default();
        if comm.trim() == "slirp4netns" {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(slirp),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    for _ in 0..100 {
        if !alive(meta) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for dir in &meta.cgroups {
        // A cgroup goes once its last process is gone (the kernel may take
        // a moment to finish the kills).
        for _ in 0..100 {
            match std::fs::remove_dir(dir) {
                Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EBUSY as i32) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => break,
            }
        }
    }
}

/// `argv` as a sealed command: in the sandbox's cgroups, `no_new_privs`,
/// `nsenter` into the holder's namespaces as the sandbox uid, in `cwd`.
pub(crate) fn command(nsenter: &Path, meta: &SealMeta, cwd: &Path, argv: &[String]) -> Vec<String> {
    let mut line = vec![
        nsenter.display().to_string(),
        format!("--target={}", meta.holder),
        "--user".into(),
        "--mount".into(),
        "--pid".into(),
        "--ipc".into(),
        "--uts".into(),
        "--net".into(),
        "--cgroup".into(),
        format!("--setuid={}", meta.uid),
        format!("--setgid={}", meta.gid),
        // The holder's root: bwrap pivoted away from the namespace's own,
        // which is all `setns` would give. (`--wd=DIR` opens DIR before
        // entering, on the host's side of the bind: `env -C` changes
        // directory inside instead.)
        "--root".into(),
        "--wd".into(),
        "--".into(),
        "env".into(),
        "-C".into(),
        cwd.display().to_string(),
    ];
    line.extend(argv.iter().cloned());
    let cgroups: Vec<PathBuf> = meta.cgroups.iter().map(PathBuf::from).collect();
    joined(&cgroups, true, line)
}

/// `nsenter` on this host (for commands of a resumed sandbox).
pub(crate) fn nsenter() -> Result<PathBuf> {
    on_path("nsenter").ok_or_else(|| {
        Error::unsupported("the sealed local sandbox needs nsenter (util-linux) on PATH")
    })
}

/// Hand what the harness wrote under `path` to the sandbox uid, so its
/// commands can change it (only when the harness runs as root: otherwise
/// both are the same user). Entries already theirs are left alone.
pub(crate) fn own(path: &Path, uid: u32, gid: u32) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let meta = match std::fs::symlink_metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e.into()),
        };
        if meta.uid() != uid || meta.gid() != gid {
            std::os::unix::fs::lchown(&p, Some(uid), Some(gid))?;
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&p)? {
                stack.push(entry?.path());
            }
        }
    }
    Ok(())
}

/// [`own`] for one entry, not what is under it.
pub(crate) fn own_one(path: &Path, uid: u32, gid: u32) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.uid() == uid && m.gid() == gid => Ok(()),
        Ok(_) => Ok(std::os::unix::fs::lchown(path, Some(uid), Some(gid))?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The count of processes the kernel killed for the sandbox's memory
/// limit so far (`None` without a memory cgroup).
pub(crate) fn oom_kills(meta: &SealMeta) -> Option<u64> {
    meta.cgroups.iter().find_map(|dir| {
        let dir = Path::new(dir);
        ["memory.events", "memory.oom_control"]
            .iter()
            .find_map(|f| std::fs::read_to_string(dir.join(f)).ok())
            .and_then(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix("oom_kill "))
                    .and_then(|n| n.trim().parse().ok())
            })
    })
}

mod cgroups {
    //! The sandbox's cgroups: limits that hold every process of the
    //! sandbox, detached ones included (they are all in the cgroup).

    use std::path::{Path, PathBuf};

    use harness_core::{Error, Result};

    const ROOT: &str = "/sys/fs/cgroup";
    /// The CFS period the CPU quota is a share of.
    const PERIOD_US: u64 = 100_000;

    fn write(dir: &Path, file: &str, value: &str) -> Result<()> {
        std::fs::write(dir.join(file), value).map_err(|e| {
            Error::backend(format!(
                "setting {} to {value}: {e}",
                dir.join(file).display()
            ))
        })
    }

    fn name_of(sandbox_dir: &Path) -> String {
        sandbox_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "sandbox".into())
    }

    /// The cgroups for these limits (none without limits).
    pub(super) fn create(
        sandbox_dir: &Path,
        memory_mb: Option<u64>,
        cpus: Option<f64>,
    ) -> Result<Vec<PathBuf>> {
        if memory_mb.is_none() && cpus.is_none() {
            return Ok(Vec::new());
        }
        if !nix::unistd::geteuid().is_root() {
            return Err(Error::unsupported(
                "cpu and memory limits of a sealed local sandbox are cgroup limits, which need \
                 the harness to run as root here; drop the limits or use the docker backend",
            ));
        }
        let name = name_of(sandbox_dir);
        let root = Path::new(ROOT);
        let mut dirs = Vec::new();
        let made = (|| {
            if root.join("cgroup.controllers").exists() {
                // cgroup v2: one directory, the controllers enabled above it.
                let base = root.join("harness");
                std::fs::create_dir_all(&base)?;
                let _ = std::fs::write(root.join("cgroup.subtree_control"), "+memory +cpu");
                write(&base, "cgroup.subtree_control", "+memory +cpu")?;
                let dir = base.join(&name);
                std::fs::create_dir_all(&dir)?;
                dirs.push(dir.clone());
                if let Some(mb) = memory_mb {
                    write(&dir, "memory.max", &(mb * 1024 * 1024).to_string())?;
                    let _ = std::fs::write(dir.join("memory.swap.max"), "0");
                }
                if let Some(c) = cpus {
                    write(&dir, "cpu.max", &format!("{} {PERIOD_US}", quota(c)))?;
                }
            } else {
                // cgroup v1: a directory per controller.
                if let Some(mb) = memory_mb {
                    let dir = root.join("memory/harness").join(&name);
                    std::fs::create_dir_all(&dir)?;
                    dirs.push(dir.clone());
                    let bytes = (mb * 1024 * 1024).to_string();
                    write(&dir, "memory.limit_in_bytes", &bytes)?;
                    // Swap counts too, where the kernel accounts it.
                    if dir.join("memory.memsw.limit_in_bytes").exists() {
                        write(&dir, "memory.memsw.limit_in_bytes", &bytes)?;
                    }
                }
                if let Some(c) = cpus {
                    let dir = root.join("cpu/harness").join(&name);
                    std::fs::create_dir_all(&dir)?;
                    dirs.push(dir.clone());
                    write(&dir, "cpu.cfs_period_us", &PERIOD_US.to_string())?;
                    write(&dir, "cpu.cfs_quota_us", &quota(c).to_string())?;
                }
            }
            Ok::<(), Error>(())
        })();
        match made {
            Ok(()) => Ok(dirs),
            Err(e) => {
                for d in &dirs {
                    let _ = std::fs::remove_dir(d);
                }
                Err(Error::unsupported(format!(
                    "the sealed sandbox's cgroup limits could not be set: {}",
                    e.message()
                )))
            }
        }
    }

    fn quota(cpus: f64) -> u64 {
        ((cpus.max(0.01)) * PERIOD_US as f64).round() as u64
    }
}
