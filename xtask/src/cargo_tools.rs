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
//! a step that needs a tool waits for them and prints that log.
//!
//! `HARNESS_CI_TOOLS_AHEAD=0` installs them in their steps, as before.

use std::fs::File;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};

use crate::ci::Step;
use crate::util;

/// The installs of this run, running or done.
pub struct CargoTools {
    running: Option<Running>,
    /// Once waited for: `Err` with what failed.
    outcome: Option<Result<(), String>>,
}

struct Running {
    thread: JoinHandle<Result<()>>,
    names: String,
    log: PathBuf,
    started: Instant,
    /// The install running now, to stop with the run.
    current: Arc<Mutex<Option<u32>>>,
}

impl CargoTools {
    /// Start the installs `steps` will need and lack (none when the cache
    /// has them, or under `HARNESS_CI_TOOLS_AHEAD=0`).
    pub fn for_run(steps: &[Step]) -> CargoTools {
        let mut tools = CargoTools {
            running: None,
            outcome: None,
        };
        if std::env::var("HARNESS_CI_TOOLS_AHEAD").is_ok_and(|v| v == "0") {
            return tools;
        }
        let mut installs = Vec::new();
        if steps.contains(&Step::Worker) {
            match crate::worker::missing_cargo_tools() {
                Ok(missing) => installs.extend(missing),
                // The worker step runs the same check and says it again.
                Err(e) => println!("==> the Worker's tools are not built ahead: {e:#}"),
            }
        }
        if steps.contains(&Step::Mutants) {
            installs.extend(crate::mutants::install_command().map(|c| ("cargo-mutants", c)));
        }
        if installs.is_empty() {
            return tools;
        }
        match start(installs) {
            Ok(running) => {
                println!(
                    "==> cargo install {} started ahead of the steps that need them (output in {})",
                    running.names,
                    running.log.display()
                );
                tools.running = Some(running);
            }
            // Each step installs what it needs itself, as without this.
            Err(e) => println!("==> the cargo-built tools are not built ahead: {e:#}"),
        }
        tools
    }

    /// Wait for the installs started ahead (once; later calls return the
    /// same outcome) and print their output.
    pub fn wait(&mut self) -> Result<()> {
        if let Some(running) = self.running.take() {
            let waited = Instant::now();
            let result = running
                .thread
                .join()
                .unwrap_or_else(|_| Err(anyhow!("the thread installing them panicked")));
            let text = std::fs::read_to_string(&running.log).unwrap_or_default();
            println!(
                "==> cargo install {}, started ahead: {} in all, {} of it waited for here; output:",
                running.names,
                util::fmt_duration(running.started.elapsed()),
                util::fmt_duration(waited.elapsed())
            );
            for line in text.lines() {
                println!("  | {line}");
            }
            self.outcome = Some(result.map_err(|e| format!("{e:#}")));
        }
        match &self.outcome {
            Some(Err(e)) => bail!("installing the cargo-built tools failed: {e}"),
            _ => Ok(()),
        }
    }

    /// A run that ends early stops the install under way.
    pub fn abandon(&mut self) {
        if let Some(running) = self.running.take() {
            let pid = *running.current.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(pid) = pid {
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{pid}")])
                    .status();
            }
            println!(
                "==> stopped cargo install {} (output in {})",
                running.names,
                running.log.display()
            );
        }
    }
}

fn start(installs: Vec<(&'static str, Command)>) -> Result<Running> {
    let log = util::cargo_target_dir().join("ci-cargo-tools.log");
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let names = installs
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(", ");
    let current = Arc::new(Mutex::new(None));
    let thread = {
        let current = current.clone();
        std::thread::Builder::new()
            .name("cargo-tools".into())
            .spawn(move || -> Result<()> {
                for (name, mut cmd) in installs {
                    writeln!(out, "$ {}", util::display(&cmd))?;
                    let started = Instant::now();
                    // Its own process group, so `abandon` stops the rustc
                    // processes under it too.
                    let mut child = cmd
                        .process_group(0)
                        .stdin(Stdio::null())
                        .stdout(out.try_clone()?)
                        .stderr(out.try_clone()?)
                        .spawn()
                        .with_context(|| format!("starting {}", util::display(&cmd)))?;
                    *current.lock().unwrap_or_else(|e| e.into_inner()) = Some(child.id());
                    let status = child.wait()?;
                    *current.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    writeln!(
                        out,
                        "{name}: {status} after {}",
                        util::fmt_duration(started.elapsed())
                    )?;
                    if !status.success() {
                        bail!("`{}` failed ({status})", util::display(&cmd));
                    }
                }
                Ok(())
            })
            .context("starting the thread")?
    };
    Ok(Running {
        thread,
        names,
        log,
        started: Instant::now(),
        current,
    })
}
