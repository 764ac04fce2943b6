//! A whole agent session moved between sandboxes: turn 1 of the real
//! `claude` runs in a local sandbox A against the scripted model; the tree
//! and Claude's own state go through the S3 store with
//! `moves::checkpoint_session`; `moves::restore_session` puts them into
//! sandbox B (another local sandbox, or a Docker container — both with a
//! different workdir path, so the transcript directory must be relocated);
//! turn 2 runs in B with `--resume <agent session id>` and the scripted
//! model asserts it carries turn 1's conversation.

mod common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use common::sandboxes::{docker, listing, sh};
use harness_claude_code::{ClaudeCodeConfig, ClaudeCodeHarness};
use harness_core::bootstrap::BootstrapRecipe;
use harness_core::checkpoint::CheckpointStore;
use harness_core::harness::{AgentCommand, Harness, OutputParser, TurnContext};
use harness_core::part::StreamPart;
use harness_core::sandbox::{
    DetachedRequest, DetachedStatus, Sandbox, SandboxProvider, SandboxSpec,
};
use harness_core::slice::home_of;
use harness_core::turn::TurnState;
use harness_core::ErrorKind;
use harness_moves as moves;
use harness_testkit::model::*;
use sandbox_local::LocalProvider;

fn claude() -> Option<ClaudeCodeHarness> {
    match ClaudeCodeConfig::from_env() {
        Ok(c) => Some(ClaudeCodeHarness::new(c)),
        Err(e) => {
            common::skip_or_fail(&format!("claude binary: {e}"));
            None
        }
    }
}

/// A stable root, so the bootstrap template (the 400 MB binary) is built
/// once and shared with the adapter's own e2e tests.
fn local_provider() -> LocalProvider {
    let cache = std::env::var("HARNESS_CACHE").unwrap_or_else(|_| "/var/cache/harness".into());
    LocalProvider::new(format!("{cache}/e2e-local-sandboxes"))
}

/// Destroys the sandbox when dropped (also when a test fails).
struct Owned(Option<Box<dyn Sandbox>>);

impl Owned {
    fn get(&self) -> &dyn Sandbox {
        self.0.as_deref().expect("sandbox")
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        if let Some(sb) = self.0.take() {
            let h = sb.handle();
            if h.provider == "docker" {
                let _ = std::process::Command::new("docker")
                    .args(["rm", "-f", &h.id])
                    .output();
            } else if let Some(dir) = std::path::Path::new(sb.workdir()).parent() {
                // A local sandbox is the directory holding its workdir
                // (`<root>/<id>/work`); remove it synchronously, as the
                // runtime may be gone before a spawned destroy runs.
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}

async fn create(provider: &dyn SandboxProvider, recipe: BootstrapRecipe, id: &str) -> Owned {
    let mut spec = SandboxSpec::new("/workspace");
    spec.session_id = Some(id.to_string());
    spec.bootstrap = Some(recipe);
    Owned(Some(provider.create(&spec).await.expect("create sandbox")))
}

/// What one turn produced.
struct Turn {
    exit_code: i32,
    text: String,
    agent_session_id: Option<String>,
    stderr: String,
}

/// Run one turn of `harness` in `sandbox` to its end, parsing its output.
async fn run_turn(
    sandbox: &dyn Sandbox,
    harness: &dyn Harness,
    turn_id: &str,
    prompt: &str,
    resume: Option<&str>,
    env: &BTreeMap<String, String>,
) -> Turn {
    let home = home_of(sandbox).await.unwrap();
    let mut state = TurnState::new("session-move", turn_id, harness.name(), prompt);
    state.agent_session_id = resume.map(str::to_string);
    let AgentCommand { argv, env, cwd } = harness
        .turn_command(&TurnContext {
            state: &state,
            workdir: sandbox.workdir(),
            home: &home,
            env,
            model: None,
            system_prompt: None,
            relay_dir: None,
        })
        .unwrap();
    let process = sandbox
        .spawn_detached(DetachedRequest {
            argv,
            cwd: Some(cwd),
            env,
            spool_dir: format!("{home}/.harness/turns/{turn_id}"),
        })
        .await
        .unwrap();
    let started = Instant::now();
    let exit_code = loop {
        match sandbox.detached_status(&process).await.unwrap() {
            DetachedStatus::Exited { code } => break code,
            DetachedStatus::Lost => panic!("agent process lost"),
            DetachedStatus::Running => {}
        }
        assert!(started.elapsed() < Duration::from_secs(120), "turn hung");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let read = |path: String| async move {
        let bytes =
            harness_core::stream::collect(sandbox.read_file(&path).await.unwrap(), 16 << 20)
                .await
                .unwrap();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let stdout = read(process.stdout_path.clone()).await;
    let stderr = read(process.stderr_path.clone()).await;
    let mut parser = harness.parser();
    let mut text = String::new();
    for line in stdout.lines() {
        for part in parser.push_line(line) {
            if let StreamPart::TextDelta { delta, .. } = part {
                text.push_str(&delta);
            }
        }
    }
    Turn {
        exit_code,
        text,
        agent_session_id: parser.agent_session_id(),
        stderr: format!("{stderr}\n--- stdout ---\n{stdout}"),
    }
}

/// Turn 1 writes a note into the tree and answers; turn 2 must carry turn
/// 1's conversation (asserted by the model on its first request) and read
/// the note back from the moved tree.
fn script() -> Script {
    Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for("toolu_cat"),
                Reply::text("Second answer."),
            )
            .assert_tool_result_contains("toolu_cat", "alpha-note"),
        )
        .on(
            last_is_tool_result_for("toolu_note"),
            Reply::text("First answer alpha."),
        )
        .rule(
            Rule::new(
                last_user_text_contains("second question"),
                Reply::shell("toolu_cat", "cat notes.txt"),
            )
            .assert_user_texts_contain("first question")
            .assert_assistant_texts_contain("First answer alpha."),
        )
        .on(
            last_user_text_contains("first question"),
            Reply::shell("toolu_note", "echo alpha-note > notes.txt"),
        )
}

/// Turn 1 in `a`, move, turn 2 in `b`; `b_env` reaches the model from B.
async fn move_session_and_resume(
    h: &ClaudeCodeHarness,
    server: &ScriptedModel,
    a: &dyn Sandbox,
    b: &dyn Sandbox,
    b_env: &BTreeMap<String, String>,
    tag: &str,
) {
    let ep = common::endpoint().await.expect("checked by the caller");
    let store = common::store(&ep, tag).await;
    let a_env: BTreeMap<String, String> = server.claude_env().into_iter().collect();
    let t1 = run_turn(a, h, "t1", "first question", None, &a_env).await;
    assert_eq!(t1.exit_code, 0, "{}", t1.stderr);
    assert_eq!(t1.text, "First answer alpha.");
    let id = t1.agent_session_id.expect("agent session id");
    assert_ne!(a.workdir(), b.workdir(), "the move must change the workdir");

    let manifest = moves::checkpoint_session(a, h, Some(&id), &store, "sessions/s1/turn-1", None)
        .await
        .unwrap();
    assert_eq!(manifest.agent, "claude-code");
    assert_eq!(manifest.workdir, a.workdir());
    assert_eq!(manifest.state_dirs, [".claude"]);
    let restored = moves::restore_session(&store, "sessions/s1/turn-1", b, h, None)
        .await
        .unwrap();
    assert!(restored.relocated);
    assert_eq!(
        restored.manifest.agent_session_id.as_deref(),
        Some(id.as_str())
    );
    // The transcript now sits where Claude looks for B's workdir.
    let transcript = format!(
        "{}/.claude/projects/{}/{id}.jsonl",
        restored.home,
        harness_claude_code::project_dir_name(b.workdir())
    );
    sh(b, &format!("test -s '{transcript}'")).await;

    let t2 = run_turn(b, h, "t2", "second question", Some(&id), b_env).await;
    server.assert_no_failures();
    assert_eq!(t2.exit_code, 0, "{}", t2.stderr);
    assert_eq!(t2.text, "Second answer.");
    assert_eq!(t2.agent_session_id.as_deref(), Some(id.as_str()));
    // Turn 2 was appended to the relocated transcript; nothing is left
    // under A's cwd. Its `cwd` fields still name A's workdir for turn 1
    // (Claude did not need them rewritten) and B's for turn 2.
    let files = sh(b, "cd \"$HOME/.claude/projects\" && find . -name '*.jsonl'").await;
    assert_eq!(
        files.trim(),
        format!(
            "./{}/{id}.jsonl",
            harness_claude_code::project_dir_name(b.workdir())
        )
    );
    let cwds = sh(
        b,
        &format!("grep -o '\"cwd\":\"[^\"]*\"' -- '{transcript}' | sort -u"),
    )
    .await;
    assert!(
        cwds.contains(&format!("\"cwd\":\"{}\"", a.workdir())),
        "{cwds}"
    );
    assert!(
        cwds.contains(&format!("\"cwd\":\"{}\"", b.workdir())),
        "{cwds}"
    );
    let reqs = server.model_requests();
    // t1: prompt, tool result; t2: prompt, tool result.
    assert_eq!(reqs.len(), 4, "{reqs:#?}");
    assert!(reqs[2]
        .assistant_texts()
        .iter()
        .any(|t| t.contains("First answer alpha.")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_session_moves_to_another_local_sandbox_and_resumes() {
    let Some(h) = claude() else { return };
    if common::endpoint().await.is_none() {
        return;
    }
    let server = ScriptedModel::start(script()).await.unwrap();
    let p = local_provider();
    let recipe = h.bootstrap_recipe().unwrap();
    let a = create(&p, recipe.clone(), "move-a").await;
    let b = create(&p, recipe, "move-b").await;
    let env: BTreeMap<String, String> = server.claude_env().into_iter().collect();
    move_session_and_resume(&h, &server, a.get(), b.get(), &env, "sess-l2l").await;
}

/// An adapter that does not relocate its state, to observe what Claude does
/// with a transcript filed under another cwd.
#[derive(Debug)]
struct NoRelocation(ClaudeCodeHarness);

impl Harness for NoRelocation {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn bootstrap_recipe(&self) -> harness_core::Result<BootstrapRecipe> {
        self.0.bootstrap_recipe()
    }
    fn turn_command(&self, turn: &TurnContext<'_>) -> harness_core::Result<AgentCommand> {
        self.0.turn_command(turn)
    }
    fn parser(&self) -> Box<dyn OutputParser> {
        self.0.parser()
    }
    fn state_dirs(&self, home: &str) -> Vec<String> {
        self.0.state_dirs(home)
    }
}

/// Observed with 2.1.332: `--resume <id>` finds the transcript by id under
/// any project directory, and then keeps appending to that old-named
/// directory. So relocation is not what makes this version resume; it keeps
/// the state where Claude itself files B's sessions (what `--continue` and
/// the session list of B's cwd read, and what a version without the
/// by-id fallback needs). This test pins the observation: if it starts
/// failing, Claude's lookup changed and relocation became load-bearing (or
/// useless) — re-check `relocate_state_script`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrelocated_claude_state_resumes_by_id_but_stays_under_the_old_cwd() {
    let Some(h) = claude() else { return };
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let server = ScriptedModel::start(script()).await.unwrap();
    let store = common::store(&ep, "sess-norelo").await;
    let p = local_provider();
    let recipe = h.bootstrap_recipe().unwrap();
    let a = create(&p, recipe.clone(), "norelo-a").await;
    let b = create(&p, recipe, "norelo-b").await;
    let (a, b) = (a.get(), b.get());
    let env: BTreeMap<String, String> = server.claude_env().into_iter().collect();
    let t1 = run_turn(a, &h, "t1", "first question", None, &env).await;
    assert_eq!(t1.exit_code, 0, "{}", t1.stderr);
    let id = t1.agent_session_id.expect("agent session id");
    let nr = NoRelocation(h);
    moves::checkpoint_session(a, &nr, Some(&id), &store, "s/t1", None)
        .await
        .unwrap();
    let restored = moves::restore_session(&store, "s/t1", b, &nr, None)
        .await
        .unwrap();
    assert!(!restored.relocated);
    let t2 = run_turn(b, &nr, "t2", "second question", Some(&id), &env).await;
    server.assert_no_failures();
    assert_eq!(t2.exit_code, 0, "{}", t2.stderr);
    assert_eq!(t2.text, "Second answer.");
    let files = sh(
        b,
        "cd \"$HOME/.claude/projects\" && find . -name '*.jsonl' | sort",
    )
    .await;
    assert_eq!(
        files.trim(),
        format!(
            "./{}/{id}.jsonl",
            harness_claude_code::project_dir_name(a.workdir())
        ),
        "where turn 2 was recorded"
    );
}

/// Forward TCP connections from `listen` (reachable from containers) to the
/// scripted model on 127.0.0.1.
async fn forward(listen: Ipv4Addr, to: SocketAddr) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind((listen, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    addr
}

/// The container's default gateway: an address of this machine.
async fn gateway(sandbox: &dyn Sandbox) -> Ipv4Addr {
    let hex = sh(sandbox, "awk '$2==\"00000000\"{print $3}' /proc/net/route").await;
    let n = u32::from_str_radix(hex.trim(), 16).expect("default route");
    Ipv4Addr::from(n.to_le_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_session_moves_from_local_to_docker_and_resumes() {
    let Some(h) = claude() else { return };
    if common::endpoint().await.is_none() {
        return;
    }
    let Some(dp) = docker().await else { return };
    let server = ScriptedModel::start(script()).await.unwrap();
    let recipe = h.bootstrap_recipe().unwrap();
    let lp = local_provider();
    let a = create(&lp, recipe.clone(), "move-l").await;
    let b = create(&dp, recipe, "move-d").await;
    let proxy = forward(gateway(b.get()).await, server.addr()).await;
    let mut b_env: BTreeMap<String, String> = server.claude_env().into_iter().collect();
    b_env.insert("ANTHROPIC_BASE_URL".into(), format!("http://{proxy}"));
    move_session_and_resume(&h, &server, a.get(), b.get(), &b_env, "sess-l2d").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_checkpoint_of_another_agent_or_a_replaced_archive_is_refused() {
    let Some(h) = claude() else { return };
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let store = common::store(&ep, "sess-mismatch").await;
    let root = tempfile::tempdir().unwrap();
    let p = LocalProvider::new(root.path());
    let a = Owned(Some(
        p.create(&SandboxSpec::new("/workspace")).await.unwrap(),
    ));
    let b = Owned(Some(
        p.create(&SandboxSpec::new("/workspace")).await.unwrap(),
    ));
    let (a, b) = (a.get(), b.get());
    // Fake state: the adapter's state dir with a transcript in it.
    sh(a, "mkdir -p \"$HOME/.claude/projects/x\" && echo '{}' > \"$HOME/.claude/projects/x/s.jsonl\" && echo tree > \"$PWD/t.txt\"").await;
    let m = moves::checkpoint_session(a, &h, Some("s"), &store, "s/1", None)
        .await
        .unwrap();
    assert!(m.state.is_some());
    let before = common::sandboxes::listing(b, b.workdir()).await;

    // A manifest naming another agent.
    let mut other = m.clone();
    other.agent = "codex".into();
    store
        .put(
            "s/1/manifest.json",
            harness_core::stream::once(serde_json::to_vec(&other).unwrap()),
        )
        .await
        .unwrap();
    let err = moves::restore_session(&store, "s/1", b, &h, None)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");

    // The right manifest, but the tree replaced by a later checkpoint.
    store
        .put(
            "s/1/manifest.json",
            harness_core::stream::once(serde_json::to_vec(&m).unwrap()),
        )
        .await
        .unwrap();
    store
        .put(
            "s/1/work.tar.zst",
            harness_core::stream::once(vec![1u8, 2, 3]),
        )
        .await
        .unwrap();
    let err = moves::restore_session(&store, "s/1", b, &h, None)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert_eq!(common::sandboxes::listing(b, b.workdir()).await, before);
    let home_b = home_of(b).await.unwrap();
    sh(b, &format!("test ! -e '{home_b}/.claude'")).await;
}

/// Codex keeps its rollouts by date (`sessions/YYYY/MM/DD/rollout-…-<thread>.jsonl`),
/// not by cwd, but its SQLite thread index records absolute rollout paths
/// under the old home; without the adapter's relocation (dropping the index)
/// `exec resume` failed here with "no rollout found for thread id". Checked
/// by resuming, in a Docker sandbox with another workdir and another
/// `$HOME`, a thread started in a local sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_session_moves_from_local_to_docker_and_resumes() {
    let h = match harness_codex::CodexConfig::from_env() {
        Ok(c) => harness_codex::CodexHarness::new(c),
        Err(e) => {
            common::skip_or_fail(&format!("codex binary: {e}"));
            return;
        }
    };
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let Some(dp) = docker().await else { return };
    let server = ScriptedModel::start(script()).await.unwrap();
    let store = common::store(&ep, "sess-codex").await;
    let recipe = h.bootstrap_recipe().unwrap();
    let lp = local_provider();
    let a = create(&lp, recipe.clone(), "codex-l").await;
    let b = create(&dp, recipe, "codex-d").await;
    let (a, b) = (a.get(), b.get());
    let mut a_env: BTreeMap<String, String> = server.codex_env().into_iter().collect();
    a_env.insert("OPENAI_BASE_URL".into(), server.v1_url());
    let proxy = forward(gateway(b).await, server.addr()).await;
    let mut b_env = a_env.clone();
    b_env.insert("OPENAI_BASE_URL".into(), format!("http://{proxy}/v1"));

    let t1 = run_turn(a, &h, "t1", "first question", None, &a_env).await;
    assert_eq!(t1.exit_code, 0, "{}", t1.stderr);
    assert_eq!(t1.text, "First answer alpha.");
    let id = t1.agent_session_id.expect("thread id");
    let manifest = moves::checkpoint_session(a, &h, Some(&id), &store, "s/codex-1", None)
        .await
        .unwrap();
    assert_eq!(manifest.state_dirs, [".codex"]);
    let restored = moves::restore_session(&store, "s/codex-1", b, &h, None)
        .await
        .unwrap();
    assert!(
        restored.relocated,
        "the home changed: the thread index is dropped"
    );
    let t2 = run_turn(b, &h, "t2", "second question", Some(&id), &b_env).await;
    server.assert_no_failures();
    assert_eq!(t2.exit_code, 0, "{}", t2.stderr);
    assert_eq!(t2.text, "Second answer.");
    assert_eq!(t2.agent_session_id.as_deref(), Some(id.as_str()));
    let reqs = server.model_requests();
    assert_eq!(reqs.len(), 4, "{reqs:#?}");
}

/// A store the attacker controls: the state archive of a session checkpoint
/// replaced by one with escaping entries, and the manifest rewritten to
/// match it. Restoring into a Docker sandbox is refused before anything is
/// applied: neither the tree nor the home changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_state_archive_is_refused_by_a_docker_target_before_anything_is_applied() {
    let Some(h) = claude() else { return };
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let Some(dp) = docker().await else { return };
    let store = common::store(&ep, "sess-hostile").await;
    let root = tempfile::tempdir().unwrap();
    let lp = LocalProvider::new(root.path());
    let a = Owned(Some(
        lp.create(&SandboxSpec::new("/workspace")).await.unwrap(),
    ));
    let b = Owned(Some(
        dp.create(&SandboxSpec::new("/workspace")).await.unwrap(),
    ));
    let (a, b) = (a.get(), b.get());
    sh(a, "mkdir -p \"$HOME/.claude/projects/x\" && echo '{}' > \"$HOME/.claude/projects/x/s.jsonl\" && echo tree > \"$PWD/t.txt\"").await;
    let mut m = moves::checkpoint_session(a, &h, Some("s"), &store, "s/1", None)
        .await
        .unwrap();
    let home_b = home_of(b).await.unwrap();
    sh(b, "mkdir -p \"$HOME/.claude\" && echo mine > \"$HOME/.claude/keep\" && echo precious > /workspace/keep.txt").await;
    let tree_before = listing(b, b.workdir()).await;
    let home_before = listing(b, &home_b).await;
    let outside = "ls -1a / /etc /root | sha256sum";
    let outside_before = sh(b, outside).await;
    let hostile = [
        ("../../etc/harness-pwned", tar::EntryType::Regular, ""),
        (".claude/link", tar::EntryType::Symlink, "/etc"),
    ];
    for (name, kind, link) in hostile {
        let tar_bytes = common::sandboxes::raw_tar(&[
            (".claude/ok.txt", tar::EntryType::Regular, "", b"fine\n"),
            (name, kind, link, b"x\n"),
            (
                ".claude/link/harness-pwned",
                tar::EntryType::Regular,
                "",
                b"x\n",
            ),
        ]);
        let zst = zstd::encode_all(&tar_bytes[..], 3).unwrap();
        m.state = Some(
            store
                .put("s/1/state.tar.zst", harness_core::stream::once(zst))
                .await
                .unwrap(),
        );
        store
            .put(
                "s/1/manifest.json",
                harness_core::stream::once(serde_json::to_vec(&m).unwrap()),
            )
            .await
            .unwrap();
        let err = moves::restore_session(&store, "s/1", b, &h, None)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unsafe, "{name}: {err}");
        assert_eq!(
            listing(b, b.workdir()).await,
            tree_before,
            "{name}: tree changed"
        );
        assert_eq!(
            listing(b, &home_b).await,
            home_before,
            "{name}: home changed"
        );
        assert_eq!(
            sh(b, outside).await,
            outside_before,
            "{name}: outside changed"
        );
    }
    let probe = sh(
        b,
        "for f in /etc/harness-pwned /workspace/t.txt; do [ -e $f ] && echo $f; done; true",
    )
    .await;
    assert_eq!(probe.trim(), "");
}

/// The control for Codex's relocation: restored under another home without
/// it, `exec resume` cannot find the thread (the index points at the old
/// home). If this starts passing, Codex no longer needs the index dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrelocated_codex_state_cannot_resume_under_another_home() {
    let h = match harness_codex::CodexConfig::from_env() {
        Ok(c) => harness_codex::CodexHarness::new(c),
        Err(e) => {
            common::skip_or_fail(&format!("codex binary: {e}"));
            return;
        }
    };
    let Some(ep) = common::endpoint().await else {
        return;
    };
    let server = ScriptedModel::start(script()).await.unwrap();
    let store = common::store(&ep, "sess-codex-norelo").await;
    let recipe = h.bootstrap_recipe().unwrap();
    let lp = local_provider();
    let a_owned = create(&lp, recipe.clone(), "cx-norelo-a").await;
    let b = create(&lp, recipe, "cx-norelo-b").await;
    let (a, b) = (a_owned.get(), b.get());
    let mut env: BTreeMap<String, String> = server.codex_env().into_iter().collect();
    env.insert("OPENAI_BASE_URL".into(), server.v1_url());
    let t1 = run_turn(a, &h, "t1", "first question", None, &env).await;
    assert_eq!(t1.exit_code, 0, "{}", t1.stderr);
    let id = t1.agent_session_id.expect("thread id");
    let nr = CodexNoRelocation(h);
    moves::checkpoint_session(a, &nr, Some(&id), &store, "s/cx", None)
        .await
        .unwrap();
    // A is gone after a move. (While A exists, local sandboxes share the
    // host's file system and Codex in B would read — and append to — A's
    // rollout through the stale absolute path.)
    drop(a_owned);
    let restored = moves::restore_session(&store, "s/cx", b, &nr, None)
        .await
        .unwrap();
    assert!(!restored.relocated);
    assert_ne!(restored.home, restored.manifest.home);
    let t2 = run_turn(b, &nr, "t2", "second question", Some(&id), &env).await;
    assert_ne!(
        t2.exit_code, 0,
        "codex resumed without relocation: {}",
        t2.stderr
    );
    assert!(t2.stderr.contains("no rollout found"), "{}", t2.stderr);
    assert_eq!(server.model_requests().len(), 2);
}

/// Codex without its relocation script.
#[derive(Debug)]
struct CodexNoRelocation(harness_codex::CodexHarness);

impl Harness for CodexNoRelocation {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn bootstrap_recipe(&self) -> harness_core::Result<BootstrapRecipe> {
        self.0.bootstrap_recipe()
    }
    fn turn_command(&self, turn: &TurnContext<'_>) -> harness_core::Result<AgentCommand> {
        self.0.turn_command(turn)
    }
    fn parser(&self) -> Box<dyn OutputParser> {
        self.0.parser()
    }
    fn state_dirs(&self, home: &str) -> Vec<String> {
        self.0.state_dirs(home)
    }
}
