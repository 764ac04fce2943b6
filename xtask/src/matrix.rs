//! THE CI matrix: every extra `cargo check|build|nextest` combination CI runs.
//!
//! This is the one place CI rows live. To add one, append to [`MATRIX`], e.g.
//!
//! ```text
//! Row::check("harness").no_default_features().features("sandbox-docker"),
//! Row::build("harness-moves").no_default_features().features("zstd-rust").target(WASM),
//! Row::test("session-log").features("bundled"),
//! Row::check("harness").no_default_features().each_feature(),
//! ```
//!
//! A row whose package is not (yet) in the workspace, or that names a feature
//! the package does not have, is skipped with a printed note, so rows can be
//! added before the crate lands.
//!
//! [`EXTRA`] holds rows CI does not run (slow, optional engines): `cargo
//! xtask extra` runs them, `cargo xtask matrix` lists them after CI's.

/// The wasm target the sans-IO core (and the Cloudflare crates) build for.
pub const WASM: &str = "wasm32-unknown-unknown";

// Some variants and builders are unused until a row needs them.
#[allow(dead_code)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum What {
    /// `cargo check`
    Check,
    /// `cargo build`
    Build,
    /// `cargo nextest run` (host target only)
    Test,
}

#[derive(Debug, Clone, Copy)]
pub struct Row {
    pub package: &'static str,
    /// Comma-separated features; empty for none.
    pub features: &'static str,
    pub default_features: bool,
    /// Expand into one row per feature of the package (besides `default`),
    /// each alone on top of `features`.
    pub each_feature: bool,
    /// Features `each_feature` leaves out (unions of others, checked whole
    /// by another step).
    pub except: &'static [&'static str],
    /// `None`: the host.
    pub target: Option<&'static str>,
    /// Only this integration test (`--test NAME`) of a test row.
    pub test_binary: Option<&'static str>,
    /// `--all-targets` (tests and examples too) for a check or build row.
    pub all_targets: bool,
    pub what: What,
}

#[allow(dead_code)]
impl Row {
    const fn new(package: &'static str, what: What) -> Row {
        Row {
            package,
            features: "",
            default_features: true,
            each_feature: false,
            except: &[],
            target: None,
            test_binary: None,
            all_targets: false,
            what,
        }
    }
    pub const fn check(package: &'static str) -> Row {
        Row::new(package, What::Check)
    }
    pub const fn build(package: &'static str) -> Row {
        Row::new(package, What::Build)
    }
    pub const fn test(package: &'static str) -> Row {
        Row::new(package, What::Test)
    }
    pub const fn features(self, features: &'static str) -> Row {
        Row { features, ..self }
    }
    pub const fn no_default_features(self) -> Row {
        Row {
            default_features: false,
            ..self
        }
    }
    /// One run per feature of the package, each alone (with
    /// `no_default_features`, this proves every feature builds on its own).
    pub const fn each_feature(self) -> Row {
        Row {
            each_feature: true,
            ..self
        }
    }
    /// As [`Row::each_feature`], leaving out `features`.
    pub const fn except(self, features: &'static [&'static str]) -> Row {
        Row {
            except: features,
            ..self
        }
    }
    /// Run only the integration test `name` (`--test name`).
    pub const fn only_test(self, name: &'static str) -> Row {
        Row {
            test_binary: Some(name),
            ..self
        }
    }
    /// Check or build every target of the package (`--all-targets`).
    pub const fn all_targets(self) -> Row {
        Row {
            all_targets: true,
            ..self
        }
    }
    pub const fn target(self, target: &'static str) -> Row {
        Row {
            target: Some(target),
            ..self
        }
    }

    /// Human-readable label, e.g. `check harness --no-default-features --features docker`.
    pub fn label(&self) -> String {
        let mut s = format!(
            "{} {}",
            match self.what {
                What::Check => "check",
                What::Build => "build",
                What::Test => "test",
            },
            self.package
        );
        if !self.default_features {
            s.push_str(" --no-default-features");
        }
        if !self.features.is_empty() {
            s.push_str(&format!(" --features {}", self.features));
        }
        if self.each_feature {
            s.push_str(" (each feature alone)");
            if !self.except.is_empty() {
                s.push_str(&format!(" except {}", self.except.join(",")));
            }
        }
        if let Some(t) = self.target {
            s.push_str(&format!(" --target {t}"));
        }
        if let Some(t) = self.test_binary {
            s.push_str(&format!(" --test {t}"));
        }
        if self.all_targets {
            s.push_str(" --all-targets");
        }
        s
    }

    /// Features named by this row.
    pub fn feature_list(&self) -> impl Iterator<Item = &'static str> {
        self.features
            .split(',')
            .map(str::trim)
            .filter(|f| !f.is_empty())
    }
}

/// Every row CI runs, in order, after the workspace-wide steps.
pub const MATRIX: &[Row] = &[
    // The facade with nothing. Each backend feature alone is an extra row:
    // sixteen builds of the dependencies with other features, 12 m 16 s of
    // a cold run's two cores (docs/CI.md).
    Row::check("harness").no_default_features(),
    // The binary's default build (the test step builds it with every
    // feature) and its smallest one: each backend missing is a clear error,
    // not a build failure (docs/cli.md, "Features").
    Row::check("harness-cli"),
    Row::check("harness-cli").no_default_features(),
    // The crates that build for wasm32 are built by the `worker` step: its
    // two builds of the Worker compile each of them for wasm32 with these
    // rows' features (harness-moves with `zstd-rust` alone, sandbox-cloudflare
    // without its transport, durable-workflows, durable-streams), so as
    // checks here they cost a cold run 5 m 11 s for nothing more. They are
    // extra rows, for a run without the `worker` step (`--skip-services`).
];

/// Rows outside CI, run on demand by `cargo xtask extra`.
pub const EXTRA: &[Row] = &[
    // The move pipeline on pure-Rust zstd, for the Worker target. (Its
    // tests run natively in the test step, which enables `zstd-rust` beside
    // libzstd: `ci::CI_FEATURES`. The core has no features: the `wasm`
    // step builds it for wasm32 as it is.)
    Row::check("harness-moves")
        .no_default_features()
        .features("zstd-rust")
        .target(WASM),
    // The Cloudflare provider's logic without its reqwest/tokio transport
    // builds for the Worker target (a Worker supplies the transport).
    Row::check("sandbox-cloudflare")
        .no_default_features()
        .target(WASM),
    // The Worker (its Durable Object over core's ActorDriver) compiles for
    // the Worker target; on the host the crate is empty.
    Row::check("harness-worker").target(WASM),
    // The Workflows engine: its bindings and engine exist only on wasm32
    // (the turn loop is tested natively in its own tests).
    Row::check("durable-workflows").target(WASM),
    // The Durable Streams protocol without its native store: what the
    // Worker's streams object serves.
    Row::check("durable-streams").target(WASM),
    // The facade with each backend feature alone (not `full`: every other
    // feature at once, which clippy and the tests build). Run by hand before
    // a release and after changing a feature's gating.
    Row::check("harness")
        .no_default_features()
        .each_feature()
        .except(&["full"]),
    // The optional microsandbox engine of sandbox-microvm compiles (its SDK
    // adds ~230 crates and a few minutes of cold build; its test needs a KVM
    // that boots a guest, which CI machines lack: docs/sandbox-microvm.md).
    Row::check("sandbox-microvm")
        .features("microsandbox")
        .all_targets(),
];
