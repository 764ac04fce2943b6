//! The CI steps that run beside the tests: `matrix` and `fuzz`.
//!
//! While nextest runs, the two cores are not busy: the tests wait on
//! agents, Docker, timers and the scripted model's turns (a cold run's test
//! step left them 27 % idle, docs/CI.md). `matrix` and `fuzz` are pure
//! compile-and-compute and depend on nothing the tests do, so once the
//! test binaries are built (nextest prints `Starting N tests`, and cargo's
//! build lock is free again) `cargo xtask ci` starts them in a child
//! process under the idle scheduling class (`chrt --idle 0`, `ionice -c 3`;
//! inherited by every cargo, rustc and fuzzer they spawn): they take the
//! cycles the tests leave, and a test that wakes up preempts them at once.
//! What is left when the tests end then runs at full speed, and the step's
//! time in the summary is that remainder: what it added to the run.
//!
//! `HARNESS_CI_BESIDE=0` runs them after the tests, one by one, as before.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::ci::{closing_counts, Counts, Step};
use crate::util;

/// Set in the child, so it does not redo the parent's one-time work.
pub const CHILD_ENV: &str = "HARNESS_CI_BESIDE_CHILD";

/// Steps that may run beside the tests.
fn movable(step: Step) -> bool {
    matches!(step, Step::Matrix | Step::Fuzz)
}

/// The movable steps of this run, and their child once started.
pub struct Beside {
    steps: Vec<Step>,
    skip_services: bool,
    running: Option<Running>,
    /// Once waited for: `Err` with the child's failed step.
    outcome: Option<Result<(), String>>,
}

struct Running {
    child: Child,
    log: PathBuf,
    started: Instant,
}

impl Beside {
    /// The movable steps of a run's `steps`, when the run has tests to
    /// run them beside and `HARNESS_CI_BESIDE` is not `0`.
    pub fn for_run(steps: &[Step], skip_services: bool) -> Beside {
        let enabled = std::env::var("HARNESS_CI_BESIDE").map_or(true, |v| v != "0");
        let steps = if enabled && steps.contains(&Step::Test) {
            steps.iter().copied().filter(|s| movable(*s)).collect()
        } else {
            Vec::new()
        };
        Beside {
            steps,
            skip_services,
            running: None,
            outcome: None,
        }
    }

    /// Start the child (once; a failure to start leaves the steps to run
    /// after the tests, as usual).
    pub fn start(&mut self) {
        if self.steps.is_empty() || self.running.is_some() || self.outcome.is_some() {
            return;
        }
        match self.spawn() {
            Ok(running) => {
                println!(
                    "==> {} started beside the tests (idle priority; output in {})",
                    self.names(),
                    running.log.display()
                );
                self.running = Some(running);
            }
            Err(e) => println!(
                "==> {} could not start beside the tests ({e:#}); they run after them",
                self.names()
            ),
        }
    }

    fn names(&self) -> String {
        self.steps
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(" and ")
    }

    fn spawn(&self) -> Result<Running> {
        let exe = std::env::current_exe().context("finding the xtask binary")?;
        let log = util::cargo_target_dir().join("ci-beside.log");
        let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = util::idle_priority(Command::new(&exe));
        let only = self
            .steps
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(",");
        cmd.args(["ci", "--only", &only]);
        if self.skip_services {
            cmd.arg("--skip-services");
        }
        // Its own process group, so stopping it stops the cargo and rustc
        // processes under it too.
        cmd.process_group(0)
            .env(CHILD_ENV, "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", util::display(&cmd)))?;
        Ok(Running {
            child,
            log,
            started: Instant::now(),
        })
    }

    /// Whether `step` is this run's to finish (it was started beside).
    pub fn owns(&self, step: Step) -> bool {
        (self.running.is_some() || self.outcome.is_some()) && self.steps.contains(&step)
    }

    /// Wait for the child (the first movable step to come up in CI order
    /// does, and gets the counts of the tests it ran; later ones only
    /// report) and print its output.
    pub fn finish(&mut self, step: Step) -> Result<Option<Counts>> {
        let mut counts = None;
        if let Some(Running {
            mut child,
            log,
            started,
        }) = self.running.take()
        {
            let waited = Instant::now();
            let status = child
                .wait()
                .context("waiting for the steps beside the tests")?;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            println!(
                "==> {} ran beside the tests: {} in all, {} of it after them; their output:",
                self.names(),
                util::fmt_duration(started.elapsed()),
                util::fmt_duration(waited.elapsed())
            );
            println!("{}", indent(&text));
            counts = closing_counts(&text);
            self.outcome = Some(if status.success() {
                Ok(())
            } else {
                Err(last_failure(&text)
                    .unwrap_or("see its output above")
                    .to_string())
            });
        }
        match &self.outcome {
            None => bail!("`{}` was not started beside the tests", step.name()),
            Some(Err(failure)) => bail!("{} (beside the tests) failed: {failure}", self.names()),
            Some(Ok(())) => Ok(counts),
        }
    }

    /// A run that ends early (a failed step) stops the child: its result
    /// would come after the run's own.
    pub fn abandon(&mut self) {
        if let Some(mut running) = self.running.take() {
            util::kill_group(running.child.id());
            let _ = running.child.kill();
            let _ = running.child.wait();
            println!(
                "==> stopped {} beside the tests (output in {})",
                self.names(),
                running.log.display()
            );
        }
    }
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("  | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The child's `---- [i/n] step: FAILED …` line.
fn last_failure(text: &str) -> Option<&str> {
    text.lines()
        .rev()
        .find(|l| l.starts_with("---- ") && l.contains(": FAILED"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_childs_failed_step_is_named() {
        let text = "---- [1/2] matrix: ok (3s)\n---- [2/2] fuzz: FAILED (9s): crash\n";
        assert_eq!(
            last_failure(text),
            Some("---- [2/2] fuzz: FAILED (9s): crash")
        );
    }

    #[test]
    fn only_matrix_and_fuzz_move() {
        assert!(movable(Step::Matrix) && movable(Step::Fuzz));
        assert!(!movable(Step::Test) && !movable(Step::Mutants) && !movable(Step::Clippy));
    }
}
