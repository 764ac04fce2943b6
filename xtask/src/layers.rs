//! `cargo xtask layers`: the architecture's invariants about who may depend
//! on whom, checked on `cargo metadata` (no build). CI runs it as the
//! `layers` step; each rule here is one invariant of docs/ARCHITECTURE.md,
//! which names this check beside it.
//!
//! The rules (normal and build dependencies; dev-dependencies are free:
//! tests may use siblings as real parts):
//! - **the kernel is small**: `harness-core` has no cargo features, no
//!   tokio, and no crate with native code (`links`, or a `-sys` crate)
//!   among all it depends on, so it builds for wasm32 as it is;
//! - **backends are independent**: no backend (a sandbox provider, a store,
//!   a log, an engine, an agent adapter) depends on another backend;
//! - **the binary is thin**: `harness-cli` depends on the `harness` facade,
//!   the scripted model and third-party crates only;
//! - **test code stays in tests**: no crate depends on the test kit (or the
//!   agents' end-to-end plumbing) outside its dev-dependencies;
//! - **runtime-free crates stay runtime-free**: `session-api` and
//!   `durable-streams` (without `native`) have no tokio;
//! - **the kernel does no I/O**: no file, socket, process, thread or clock
//!   call in `harness-core`'s sources (outside its `#[cfg(test)]` code):
//!   time comes in as a `Clock`, storage and transport as traits;
//! - **functions stay readable**: none outside tests is longer than
//!   150 lines (`fn_length.rs`).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::util;

/// The backends: each implements core traits and nothing else.
pub const BACKENDS: &[&str] = &[
    "sandbox-local",
    "sandbox-docker",
    "sandbox-microvm",
    "sandbox-cloudflare",
    "checkpoint-fs",
    "checkpoint-r2",
    "session-log",
    "session-log-postgres",
    "durable-temporal",
    "durable-workflows",
    "harness-claude-code",
    "harness-codex",
];

/// What the binary may depend on within the workspace.
pub const CLI_ALLOWED: &[&str] = &["harness", "harness-scripted-model"];

/// Crates only tests may depend on.
pub const TEST_ONLY: &[&str] = &["harness-testkit", "harness-agent-e2e"];

/// Crates that must stay free of an async runtime (they build for wasm32
/// and are shared with the Worker). Their `native`-style features may add
/// one: only default-feature dependencies count.
pub const RUNTIME_FREE: &[&str] = &[
    "harness-core",
    "session-api",
    "durable-streams",
    "checkpoint-crypt",
    "harness-broker-proto",
];

/// Calls the kernel's sources must not make: files, sockets, processes,
/// threads, the wall clock, a runtime.
pub const KERNEL_FORBIDDEN: &[&str] = &[
    "std::fs",
    "std::net",
    "std::process",
    "std::thread",
    "SystemTime::now",
    "Instant::now",
    "tokio::",
];

/// The forbidden calls in one source file of the kernel, as
/// `path:line: call`; code after a `#[cfg(test)]` line (a file's test
/// module comes last) and comments are not read.
pub fn kernel_calls(path: &str, source: &str) -> Vec<String> {
    source
        .lines()
        .enumerate()
        .take_while(|(_, line)| line.trim() != "#[cfg(test)]")
        .filter(|(_, line)| !line.trim_start().starts_with("//"))
        .flat_map(|(i, line)| {
            KERNEL_FORBIDDEN
                .iter()
                .filter(move |call| line.contains(*call))
                .map(move |call| {
                    format!(
                        "{path}:{}: harness-core calls {call}: the kernel does no I/O",
                        i + 1
                    )
                })
        })
        .collect()
}

/// [`kernel_calls`] over every source file of `harness-core`.
fn kernel_sources() -> Result<Vec<String>> {
    scan_sources("crates/harness-core/src", kernel_calls)
}

/// `check(path, source)` over every Rust file under `dir` (relative to the
/// workspace root; paths shown relative to it too), the findings joined.
fn scan_sources(dir: &str, check: fn(&str, &str) -> Vec<String>) -> Result<Vec<String>> {
    let root = util::repo_root();
    let mut out = Vec::new();
    for path in util::rust_files(vec![root.join(dir)])? {
        let text = std::fs::read_to_string(&path)?;
        let shown = path.strip_prefix(&root).unwrap_or(&path);
        out.extend(check(&shown.display().to_string(), &text));
    }
    Ok(out)
}

/// The one file allowed to read the compiled-in checkout path
/// (`harness_testkit::checkout`, which prefers the one cargo sets when the
/// test runs).
pub const CHECKOUT_READER: &str = "crates/harness-testkit/src/checkout.rs";

/// Lines of `source` that compile the checkout's path into a binary
/// (`env!("CARGO_MANIFEST_DIR")`), as `path:line: …`. A test binary built
/// in one clone is reused, unbuilt, by another clone sharing the target
/// directory: a compiled-in path then names the first clone (a README test
/// read another clone's README). Comments are not read.
pub fn compiled_paths(path: &str, source: &str) -> Vec<String> {
    const CALL: &str = concat!("env!(\"CARGO_", "MANIFEST_DIR\")");
    if path == CHECKOUT_READER {
        return Vec::new();
    }
    source
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim_start().starts_with("//") && line.contains(CALL))
        .map(|(i, _)| {
            format!(
                "{path}:{}: compiles in the checkout's path (env!(\"CARGO_MANIFEST_DIR\")): \
                 use harness_testkit::checkout, which reads the one cargo sets at run time",
                i + 1
            )
        })
        .collect()
}

/// [`compiled_paths`] over every source file under `crates/`.
fn compiled_path_sources() -> Result<Vec<String>> {
    scan_sources("crates", compiled_paths)
}

/// One dependency edge of a workspace crate, as declared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dep {
    pub name: String,
    /// `normal`, `build` or `dev`.
    pub kind: String,
    /// Only through a feature.
    pub optional: bool,
}

/// A workspace crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crate {
    pub name: String,
    pub deps: Vec<Dep>,
    pub features: BTreeSet<String>,
}

/// The graph the rules read: the workspace's crates as declared, and for
/// the kernel every crate it pulls in (normal edges, all platforms).
#[derive(Debug, Clone, Default)]
pub struct Graph {
    pub crates: Vec<Crate>,
    /// `harness-core`'s transitive normal dependencies: `(name, links)`.
    pub core_closure: Vec<(String, Option<String>)>,
}

/// Every broken rule, one line each.
pub fn violations(graph: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    let workspace: BTreeSet<&str> = graph.crates.iter().map(|c| c.name.as_str()).collect();
    for krate in &graph.crates {
        let shipped = krate.deps.iter().filter(|d| d.kind != "dev");
        for dep in shipped {
            let name = dep.name.as_str();
            if BACKENDS.contains(&krate.name.as_str())
                && BACKENDS.contains(&name)
                && name != krate.name
            {
                out.push(format!(
                    "backend {} depends on backend {name}: backends are independent (compose them in the `harness` facade)",
                    krate.name
                ));
            }
            // (A test-only crate may build on another.)
            if TEST_ONLY.contains(&name) && !TEST_ONLY.contains(&krate.name.as_str()) {
                out.push(format!(
                    "{} depends on {name} outside dev-dependencies: test code stays in tests",
                    krate.name
                ));
            }
            if krate.name == "harness-cli"
                && workspace.contains(name)
                && !CLI_ALLOWED.contains(&name)
            {
                out.push(format!(
                    "harness-cli depends on {name}: the binary depends on the `harness` facade (and the scripted model) only"
                ));
            }
            if RUNTIME_FREE.contains(&krate.name.as_str()) && name == "tokio" && !dep.optional {
                out.push(format!(
                    "{} depends on tokio: it is runtime-free (it builds for wasm32 and the Worker shares it)",
                    krate.name
                ));
            }
        }
        if krate.name == "harness-core" && !krate.features.is_empty() {
            out.push(format!(
                "harness-core has cargo features ({}): the kernel builds for wasm32 as it is",
                krate
                    .features
                    .iter()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    for (name, links) in &graph.core_closure {
        if links.is_some() || name.ends_with("-sys") {
            out.push(format!(
                "harness-core pulls in {name}, which builds native code: the kernel has no C dependency"
            ));
        }
        if name == "tokio" {
            out.push("harness-core pulls in tokio: the kernel has no runtime".to_string());
        }
    }
    out
}

/// Read the graph from `cargo metadata` output.
pub fn graph_from_metadata(metadata: &Value) -> Result<Graph> {
    let packages = metadata["packages"]
        .as_array()
        .context("metadata has no packages")?;
    let members: BTreeSet<&str> = metadata["workspace_members"]
        .as_array()
        .context("metadata has no workspace members")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let by_id: BTreeMap<&str, &Value> = packages
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p)))
        .collect();
    let mut crates = Vec::new();
    for id in &members {
        let p = by_id
            .get(id)
            .context("a member is not among the packages")?;
        let deps = p["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| Dep {
                name: d["name"].as_str().unwrap_or_default().to_string(),
                kind: d["kind"].as_str().unwrap_or("normal").to_string(),
                optional: d["optional"].as_bool().unwrap_or(false),
            })
            .collect();
        let features = p["features"]
            .as_object()
            .map(|f| f.keys().cloned().collect())
            .unwrap_or_default();
        crates.push(Crate {
            name: p["name"].as_str().unwrap_or_default().to_string(),
            deps,
            features,
        });
    }
    // The kernel's closure through the resolve graph, normal edges only.
    let nodes: BTreeMap<&str, &Value> = metadata["resolve"]["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| Some((n["id"].as_str()?, n)))
        .collect();
    let core = by_id
        .iter()
        .find(|(id, p)| members.contains(*id) && p["name"] == "harness-core")
        .map(|(id, _)| *id)
        .context("no harness-core in the workspace")?;
    let mut seen = BTreeSet::new();
    let mut todo = vec![core];
    while let Some(id) = todo.pop() {
        let Some(node) = nodes.get(id) else { continue };
        for dep in node["deps"].as_array().into_iter().flatten() {
            let normal = dep["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| k["kind"].is_null());
            if let Some(pkg) = dep["pkg"].as_str() {
                if normal && seen.insert(pkg) {
                    todo.push(pkg);
                }
            }
        }
    }
    let core_closure = seen
        .into_iter()
        .filter_map(|id| {
            let p = by_id.get(id)?;
            Some((
                p["name"].as_str()?.to_string(),
                p["links"].as_str().map(str::to_string),
            ))
        })
        .collect();
    Ok(Graph {
        crates,
        core_closure,
    })
}

/// Run the check on this workspace.
pub fn check() -> Result<()> {
    let out = util::output(util::cargo().args(["metadata", "--format-version", "1"]))?;
    let metadata: Value = serde_json::from_str(&out).context("reading cargo metadata")?;
    let graph = graph_from_metadata(&metadata)?;
    let mut broken = violations(&graph);
    broken.extend(kernel_sources()?);
    broken.extend(compiled_path_sources()?);
    broken.extend(crate::fn_length::over_limit()?);
    println!(
        "layers: {} crates, harness-core pulls in {} crates",
        graph.crates.len(),
        graph.core_closure.len()
    );
    if broken.is_empty() {
        println!("layers: every rule holds (xtask/src/layers.rs)");
        Ok(())
    } else {
        bail!(
            "the architecture's layering is broken (docs/ARCHITECTURE.md, \"Invariants\"):\n  {}",
            broken.join("\n  ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn krate(name: &str, deps: &[(&str, &str)]) -> Crate {
        Crate {
            name: name.into(),
            deps: deps
                .iter()
                .map(|(n, k)| Dep {
                    name: n.to_string(),
                    kind: k.to_string(),
                    optional: false,
                })
                .collect(),
            features: BTreeSet::new(),
        }
    }

    fn clean() -> Graph {
        Graph {
            crates: vec![
                krate("harness-core", &[("serde", "normal"), ("tokio", "dev")]),
                krate(
                    "sandbox-local",
                    &[("harness-core", "normal"), ("sandbox-docker", "dev")],
                ),
                krate("sandbox-docker", &[("harness-core", "normal")]),
                krate(
                    "harness",
                    &[("sandbox-local", "normal"), ("sandbox-docker", "normal")],
                ),
                krate(
                    "harness-cli",
                    &[
                        ("harness", "normal"),
                        ("tokio", "normal"),
                        ("harness-testkit", "dev"),
                    ],
                ),
                krate("harness-testkit", &[("harness-core", "normal")]),
            ],
            core_closure: vec![("serde".into(), None)],
        }
    }

    #[test]
    fn the_clean_graph_passes() {
        assert_eq!(violations(&clean()), Vec::<String>::new());
    }

    /// Each planted violation is caught, and named.
    #[test]
    fn every_planted_violation_fails_the_check() {
        let plant = |f: &dyn Fn(&mut Graph), want: &str| {
            let mut g = clean();
            f(&mut g);
            let v = violations(&g);
            assert!(
                v.iter().any(|line| line.contains(want)),
                "planted `{want}`, got {v:?}"
            );
        };
        plant(
            &|g| {
                g.crates[1].deps.push(Dep {
                    name: "sandbox-docker".into(),
                    kind: "normal".into(),
                    optional: false,
                })
            },
            "backend sandbox-local depends on backend sandbox-docker",
        );
        plant(
            &|g| {
                g.crates[4].deps.push(Dep {
                    name: "sandbox-local".into(),
                    kind: "normal".into(),
                    optional: false,
                })
            },
            "harness-cli depends on sandbox-local",
        );
        plant(
            &|g| {
                g.crates[4].deps.push(Dep {
                    name: "harness-testkit".into(),
                    kind: "normal".into(),
                    optional: false,
                })
            },
            "harness-cli depends on harness-testkit outside dev-dependencies",
        );
        plant(
            &|g| {
                g.crates[0].deps.push(Dep {
                    name: "tokio".into(),
                    kind: "normal".into(),
                    optional: false,
                })
            },
            "harness-core depends on tokio",
        );
        plant(
            &|g| {
                g.crates[0].features.insert("zstd".into());
            },
            "harness-core has cargo features (zstd)",
        );
        plant(
            &|g| {
                g.core_closure
                    .push(("zstd-sys".into(), Some("zstd".into())))
            },
            "harness-core pulls in zstd-sys",
        );
    }

    #[test]
    fn a_clock_or_file_call_in_the_kernel_is_caught() {
        let source = "use std::sync::Arc;\n// std::fs in a comment\nfn f() { let _ = std::time::Instant::now(); }\n\
                      #[cfg(test)]\nmod tests { fn g() { std::fs::read(\"x\"); } }\n";
        assert_eq!(
            kernel_calls("core/x.rs", source),
            vec!["core/x.rs:3: harness-core calls Instant::now: the kernel does no I/O"]
        );
        assert!(kernel_calls("core/y.rs", "fn f(clock: &dyn Clock) {}\n").is_empty());
    }

    #[test]
    fn a_compiled_in_checkout_path_is_caught_outside_the_checkout_reader() {
        let call = concat!("env!(\"CARGO_", "MANIFEST_DIR\")");
        let source = format!("// {call} in a comment\nfn f() {{ let _ = {call}; }}\n");
        let found = compiled_paths("crates/x/tests/readme.rs", &source);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("crates/x/tests/readme.rs:2: compiles in"));
        assert!(compiled_paths(CHECKOUT_READER, &source).is_empty());
    }

    /// The real workspace's metadata reads into the graph the rules need
    /// (run `cargo metadata` here: no build).
    #[test]
    fn this_workspace_passes() {
        let out = util::output(util::cargo().args(["metadata", "--format-version", "1"])).unwrap();
        let graph = graph_from_metadata(&serde_json::from_str(&out).unwrap()).unwrap();
        assert!(graph.crates.iter().any(|c| c.name == "harness-core"));
        assert!(graph.core_closure.iter().any(|(n, _)| n == "serde"));
        assert_eq!(violations(&graph), Vec::<String>::new());
        assert_eq!(kernel_sources().unwrap(), Vec::<String>::new());
        assert_eq!(compiled_path_sources().unwrap(), Vec::<String>::new());
        assert_eq!(
            crate::fn_length::over_limit().unwrap(),
            Vec::<String>::new()
        );
    }
}
