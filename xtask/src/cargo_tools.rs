//! The tools a CI run compiles from source, built ahead of the steps that
//! need them.
//!
//! `worker-build` and `wasm-bindgen-cli` (the `worker` step) and
//! `cargo-mutants` (the `mutants` step) come from crates.io as `cargo
//! install`s: on an empty cache, about four and a half minutes of the two
//! cores (1m56, 1m24 and 1m08 in a cold run, docs/CI.md). The steps before
//! `worker` — apt, PyPI and npm downloads, starting the services,
//! debootstrapping the microVM's root disk — mostly wait on the network and
//! the disk, and a cold run's vmstat showed the cores 30–60 % idle through
//! them. So `cargo xtask ci` starts the missing installs in a thread in its
//! first second, one after another (into their own target directory, so
//! they never hold the workspace's build lock), with their output in a log;
//! a step that needs a tool waits for that tool only, then prints the log
//! so far. cargo-mutants, needed by the last step, builds under the idle
//! scheduling class: it takes only the cycles the steps between leave.
//!
//! `HARNESS_CI_TOOLS_AHEAD=0` installs them in their steps, as before.

use std::fs::File;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::ci::Step;
use crate::util;

/// One `cargo install` and the step that needs it.
struct Install {
    name: &'static str,
    cmd: Command,
    step: Step,
}

/// The installs of this run, running or done.
pub struct CargoTools {
    shared: Option<Arc<Shared>>,
    log: PathBuf,
    started: Instant,
    /// How much of the log the steps have printed already.
    printed: usize,
}

/// What the thread has done so far, and the condition it signals.
#[derive(Default)]
struct Shared {
    progress: Mutex<Progress>,
    changed: Condvar,
}

#[derive(Default)]
struct Progress {
    /// The steps whose installs are all done.
    pending: Vec<Step>,
    /// The first install that failed, with why.
    failed: Option<String>,
    /// The install running now (its process group), to stop with the run.
    current: Option<u32>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CargoTools {
    /// Start the installs `steps` will need and lack (none when the cache
    /// has them, or under `HARNESS_CI_TOOLS_AHEAD=0`).
    pub fn for_run(steps: &[Step]) -> CargoTools {
        let mut tools = CargoTools {
            shared: None,
            log: util::cargo_target_dir().join("ci-cargo-tools.log"),
            started: Instant::now(),
            printed: 0,
        };
        if std::env::var("HARNESS_CI_TOOLS_AHEAD").is_ok_and(|v| v == "0") {
            return tools;
        }
        let mut installs = Vec::new();
        if steps.contains(&Step::Worker) {
            match crate::worker::missing_cargo_tools() {
                Ok(missing) => installs.extend(missing.into_iter().map(|(name, cmd)| Install {
                    name,
                    cmd,
                    step: Step::Worker,
                })),
                // The worker step runs the same check and says it again.
                Err(e) => println!("==> the Worker's tools are not built ahead: {e:#}"),
            }
        }
        if steps.contains(&Step::Mutants) {
            installs.extend(crate::mutants::install_command().map(|cmd| Install {
                name: "cargo-mutants",
                cmd: util::idle_priority(cmd),
                step: Step::Mutants,
            }));
        }
        if installs.is_empty() {
            return tools;
        }
        let names = installs.iter().map(|i| i.name).collect::<Vec<_>>();
        match start(&tools.log, installs) {
            Ok(shared) => {
                println!(
                    "==> cargo install {} started ahead of the steps that need them (output in {})",
                    names.join(", "),
                    tools.log.display()
                );
                tools.shared = Some(shared);
            }
            // Each step installs what it needs itself, as without this.
            Err(e) => println!("==> the cargo-built tools are not built ahead: {e:#}"),
        }
        tools
    }

    /// Wait until the installs `step` needs are done and print the log so
    /// far; an error if one of them (or one before them) failed.
    pub fn wait_for(&mut self, step: Step) -> Result<()> {
        let Some(shared) = self.shared.clone() else {
            return Ok(());
        };
        let waited = Instant::now();
        let failed = {
            let mut progress = shared.lock();
            while progress.pending.contains(&step) && progress.failed.is_none() {
                progress = shared
                    .changed
                    .wait(progress)
                    .unwrap_or_else(|e| e.into_inner());
            }
            progress.failed.clone()
        };
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        println!(
            "==> the cargo-built tools, started ahead {} ago: {} waited for here; their log so far:",
            util::fmt_duration(self.started.elapsed()),
            util::fmt_duration(waited.elapsed())
        );
        for line in text.get(self.printed..).unwrap_or_default().lines() {
            println!("  | {line}");
        }
        self.printed = text.len();
        match failed {
            Some(e) => bail!("installing the cargo-built tools failed: {e}"),
            None => Ok(()),
        }
    }

    /// A run that ends early stops the install under way (and the thread
    /// then stops at its failure).
    pub fn abandon(&mut self) {
        if let Some(shared) = self.shared.take() {
            if let Some(pid) = shared.lock().current {
                util::kill_group(pid);
                println!(
                    "==> stopped the cargo install under way (output in {})",
                    self.log.display()
                );
            }
        }
    }
}

fn start(log: &PathBuf, installs: Vec<Install>) -> Result<Arc<Shared>> {
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let shared = Arc::new(Shared::default());
    shared.lock().pending = installs.iter().map(|i| i.step).collect();
    let thread_shared = shared.clone();
    std::thread::Builder::new()
        .name("cargo-tools".into())
        .spawn(move || {
            let shared = thread_shared;
            for install in installs {
                let result = run_one(install.name, install.cmd, &mut out, &shared);
                let mut progress = shared.lock();
                progress.current = None;
                match result {
                    Ok(()) => {
                        // The step's entry goes with its last install.
                        if let Some(i) = progress.pending.iter().position(|s| *s == install.step) {
                            progress.pending.remove(i);
                        }
                    }
                    Err(e) => progress.failed = Some(format!("{}: {e:#}", install.name)),
                }
                let stop = progress.failed.is_some();
                drop(progress);
                shared.changed.notify_all();
                if stop {
                    return;
                }
            }
        })
        .context("starting the thread")?;
    Ok(shared)
}

fn run_one(name: &str, mut cmd: Command, out: &mut File, shared: &Shared) -> Result<()> {
    writeln!(out, "$ {}", util::display(&cmd))?;
    let started = Instant::now();
    // Its own process group, so `abandon` stops the rustc processes under
    // it too.
    let mut child = cmd
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out.try_clone()?)
        .spawn()
        .with_context(|| format!("starting {}", util::display(&cmd)))?;
    shared.lock().current = Some(child.id());
    let status = child.wait()?;
    writeln!(
        out,
        "{name}: {status} after {}",
        util::fmt_duration(started.elapsed())
    )?;
    if !status.success() {
        bail!("`{}` failed ({status})", util::display(&cmd));
    }
    Ok(())
}
