//! A session's checkpoint rules on a real local sandbox: the `exclude`
//! patterns and the tree's `.gitignore` leave paths out of its turn-end
//! checkpoints — the first (the tree read whole) and the next (against the
//! parent) — so a sandbox made from them lacks exactly those paths. The
//! rules are applied by the tree checkpoint to what the provider lists or
//! exports, the same code for every provider.

use std::sync::Arc;

use harness_core::checkpoint::MemoryCheckpointStore;
use harness_core::clock::FnClock;
use harness_core::sandbox::{Sandbox, SandboxProvider, SandboxSpec};
use harness_core::session::{CheckpointRules, SandboxConfig};
use harness_core::turn::TurnState;
use harness_core::turn_checkpoint::TurnCheckpoints;
use harness_moves::turns::StoreTurnCheckpoints;
use harness_testkit::agent::{ScriptHarness, SCRIPT_AGENT};
use harness_testkit::trees::sh;
use sandbox_local::LocalProvider;

fn turn(n: u64, previous: Option<String>, rules: &CheckpointRules) -> TurnState {
    let mut s = TurnState::new("rules", format!("t{n}"), SCRIPT_AGENT, "p");
    s.checkpoint = previous;
    s.sandbox_config = Some(SandboxConfig {
        checkpoints: rules.clone(),
        ..SandboxConfig::default()
    });
    s
}

/// Every file under the new sandbox's workdir, relative, sorted.
async fn files(sandbox: &dyn Sandbox) -> Vec<String> {
    let out = sh(
        sandbox,
        &format!("cd {} && find . -type f | LC_ALL=C sort", sandbox.workdir()),
    )
    .await;
    out.lines()
        .map(|l| l.trim_start_matches("./").to_string())
        .collect()
}

#[tokio::test]
async fn excluded_and_gitignored_paths_stay_out_of_every_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(dir.path().join("sandboxes"));
    let checkpoints = StoreTurnCheckpoints::new(
        Arc::new(MemoryCheckpointStore::default()),
        Arc::new(FnClock(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64
        })),
    );
    let rules = CheckpointRules {
        exclude: vec!["node_modules/.cache".into()],
        gitignore: true,
        ..CheckpointRules::default()
    };
    let a = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    sh(
        a.as_ref(),
        "mkdir -p src node_modules/.cache/babel node_modules/pkg && \
         echo 'fn main() {}' > src/main.rs && echo cached > node_modules/.cache/babel/x.json && \
         echo 'module.exports = 1' > node_modules/pkg/index.js && echo trace > debug.log && \
         printf '*.log\\n# comment\\n/dist\\n' > .gitignore && mkdir dist && echo built > dist/app.js",
    )
    .await;
    let first = checkpoints
        .checkpoint(a.as_ref(), &ScriptHarness, &turn(1, None, &rules))
        .await
        .unwrap();
    // The next checkpoint, against the first: new files of both kinds.
    sh(
        a.as_ref(),
        "echo more > src/lib.rs && echo again > node_modules/.cache/babel/y.json && echo t2 > src/t2.log",
    )
    .await;
    let second = checkpoints
        .checkpoint(
            a.as_ref(),
            &ScriptHarness,
            &turn(2, Some(first.clone()), &rules),
        )
        .await
        .unwrap();
    let kept_first = [".gitignore", "node_modules/pkg/index.js", "src/main.rs"];
    for (key, want) in [
        (&first, kept_first.to_vec()),
        (&second, [&kept_first[..], &["src/lib.rs"]].concat()),
    ] {
        let b = provider
            .create(&SandboxSpec::new("/workspace"))
            .await
            .unwrap();
        checkpoints
            .restore(key, b.as_ref(), &ScriptHarness)
            .await
            .unwrap();
        let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
        want.sort();
        assert_eq!(files(b.as_ref()).await, want, "restored from {key}");
        b.destroy().await.unwrap();
    }
    // Without rules the same tree keeps everything.
    let all = checkpoints
        .checkpoint(
            a.as_ref(),
            &ScriptHarness,
            &turn(3, None, &CheckpointRules::default()),
        )
        .await
        .unwrap();
    let c = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    checkpoints
        .restore(&all, c.as_ref(), &ScriptHarness)
        .await
        .unwrap();
    let everything = files(c.as_ref()).await;
    for path in [
        "debug.log",
        "dist/app.js",
        "node_modules/.cache/babel/y.json",
        "src/t2.log",
    ] {
        assert!(
            everything.iter().any(|f| f == path),
            "{path} missing: {everything:?}"
        );
    }
}
