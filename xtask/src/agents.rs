//! `cargo xtask agents`: the real Claude Code and Codex CLIs from npm.
//!
//! Each is installed with `npm install --prefix $HARNESS_CACHE/agents/<name>-<version>`;
//! what the tests use is the NATIVE executable inside the platform package
//! (`@anthropic-ai/claude-code-linux-x64/claude`,
//! `@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex`),
//! which runs without Node (inside a sandbox, bind-mounted read-only).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util::{self, run};

/// Pinned `@anthropic-ai/claude-code` version (override: `HARNESS_CLAUDE_VERSION`).
pub const CLAUDE_VERSION: &str = "2.1.332";
/// Pinned `@openai/codex` version (override: `HARNESS_CODEX_VERSION`).
pub const CODEX_VERSION: &str = "0.171.0";

#[derive(Debug)]
pub struct Agent {
    /// Directory name prefix under `$HARNESS_CACHE/agents/`.
    pub name: &'static str,
    pub npm_package: &'static str,
    pub default_version: &'static str,
    pub version_env: &'static str,
    /// The variable the tests read the binary path from.
    pub env_bin: &'static str,
    /// Scope directory under `node_modules/` holding the platform package.
    scope: &'static str,
    /// File name of the native executable.
    exe: &'static str,
    /// Preferred locations relative to `node_modules/<scope>/`.
    known_paths: &'static [&'static str],
}

pub const AGENTS: &[Agent] = &[
    Agent {
        name: "claude-code",
        npm_package: "@anthropic-ai/claude-code",
        default_version: CLAUDE_VERSION,
        version_env: "HARNESS_CLAUDE_VERSION",
        env_bin: "HARNESS_CLAUDE_BIN",
        scope: "@anthropic-ai",
        exe: "claude",
        known_paths: &["claude-code-linux-x64/claude"],
    },
    Agent {
        name: "codex",
        npm_package: "@openai/codex",
        default_version: CODEX_VERSION,
        version_env: "HARNESS_CODEX_VERSION",
        env_bin: "HARNESS_CODEX_BIN",
        scope: "@openai",
        exe: "codex",
        known_paths: &[
            "codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex",
            "codex/vendor/x86_64-unknown-linux-musl/codex/codex",
        ],
    },
];

impl Agent {
    pub fn version(&self) -> String {
        std::env::var(self.version_env)
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| self.default_version.to_string())
    }

    pub fn install_dir(&self) -> PathBuf {
        util::cache_dir()
            .join("agents")
            .join(format!("{}-{}", self.name, self.version()))
    }

    /// The native executable, if this version is installed.
    pub fn find_installed(&self) -> Option<PathBuf> {
        let scope = self.install_dir().join("node_modules").join(self.scope);
        for rel in self.known_paths {
            let p = scope.join(rel);
            if util::is_executable(&p) && util::is_elf(&p) {
                return Some(p);
            }
        }
        // Layouts change between releases: look for an x86-64 glibc/musl ELF
        // named `exe` anywhere in the scope, preferring non-musl packages.
        let mut found = Vec::new();
        find_elf(&scope, self.exe, 6, &mut found);
        found.retain(|p| {
            let s = p.to_string_lossy();
            (s.contains("x64") || s.contains("x86_64"))
                && !s.contains("arm64")
                && !s.contains("aarch64")
        });
        found.sort_by_key(|p| {
            (
                p.to_string_lossy().contains("-musl"),
                p.components().count(),
            )
        });
        found.into_iter().next()
    }

    pub fn install(&self) -> Result<PathBuf> {
        let version = self.version();
        if let Some(bin) = self.find_installed() {
            println!(
                "{}@{version}: cached at {}",
                self.npm_package,
                bin.display()
            );
            return self.verify(bin);
        }
        let dir = self.install_dir();
        std::fs::create_dir_all(&dir)?;
        // Note: npm installs the platform package through optionalDependencies;
        // install scripts are not needed (the native binary ships in it).
        run(Command::new("npm")
            .arg("install")
            .arg("--prefix")
            .arg(&dir)
            .args([
                "--no-audit",
                "--no-fund",
                "--no-update-notifier",
                "--loglevel=error",
            ])
            .arg(format!("{}@{version}", self.npm_package)))
        .with_context(|| {
            format!(
                "installing {}@{version} (is that version served? `npm view {} versions`)",
                self.npm_package, self.npm_package
            )
        })?;
        let Some(bin) = self.find_installed() else {
            bail!(
                "{}@{version} installed into {} but no native `{}` executable was found in node_modules/{}",
                self.npm_package,
                dir.display(),
                self.exe,
                self.scope
            );
        };
        self.verify(bin)
    }

    fn verify(&self, bin: PathBuf) -> Result<PathBuf> {
        let out = util::output(Command::new(&bin).arg("--version"))
            .with_context(|| format!("{} --version", bin.display()))?;
        let out = out.trim();
        if !out.contains(&self.version()) {
            bail!(
                "{} --version printed `{out}`, expected {}",
                bin.display(),
                self.version()
            );
        }
        println!("{}={}  ({out})", self.env_bin, bin.display());
        Ok(bin)
    }
}

fn find_elf(dir: &Path, name: &str, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() && depth > 0 {
            find_elf(&p, name, depth - 1, out);
        } else if ft.is_file()
            && p.file_name().is_some_and(|n| n == name)
            && util::is_executable(&p)
            && util::is_elf(&p)
        {
            out.push(p);
        }
    }
}

pub fn install_all() -> Result<Vec<PathBuf>> {
    AGENTS
        .iter()
        .map(|a| {
            util::timed(
                &format!("agents: {}@{}", a.npm_package, a.version()),
                || a.install(),
            )
        })
        .collect()
}
