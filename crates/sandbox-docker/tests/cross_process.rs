//! Resume and bootstrap across processes, through the `create_detach`
//! example binary.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{provider, sh_ok, Cleanup};
use harness_core::sandbox::{SandboxHandle, SandboxProvider};
use harness_core::stream::collect;

/// The example binary, built next to this test's binary (cargo and nextest
/// build examples with the tests); built on demand otherwise.
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().join("examples");
    let path = dir.join("create_detach");
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args([
                "build",
                "-p",
                "sandbox-docker",
                "--example",
                "create_detach",
            ])
            .status()
            .unwrap();
        assert!(
            status.success(),
            "building the create_detach example failed"
        );
    }
    path
}

/// Run the example and parse the handle it prints.
fn create_in_child(args: &[&str]) -> SandboxHandle {
    let out = Command::new(example())
        .args(args)
        .env("HARNESS_TEST_IMAGE", common::image())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "create_detach {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("bad handle {line:?}: {e}"))
}

fn container_running(id: &str) -> bool {
    let out = Command::new("docker")
        .args(["inspect", "-f", "{{.State.Running}}", id])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "true"
}

#[tokio::test]
async fn resume_a_running_sandbox_from_another_process() {
    let Some(p) = provider().await else { return };
    let handle = create_in_child(&["--write", "note.txt=from the other process"]);
    let _c = Cleanup(Some(handle.id.clone()));
    assert!(
        container_running(&handle.id),
        "detach must leave it running"
    );
    let sb = p.resume(&handle).await.unwrap();
    let got = collect(sb.read_file("note.txt").await.unwrap(), 1024)
        .await
        .unwrap();
    assert_eq!(&got[..], b"from the other process");
    assert_eq!(sh_ok(&*sb, "pwd").await, "/work\n");
    sb.destroy().await.unwrap();
}

#[tokio::test]
async fn resume_a_stopped_sandbox_from_another_process() {
    let Some(p) = provider().await else { return };
    let handle = create_in_child(&["--write", "/work/state=kept across stop", "--stop"]);
    let _c = Cleanup(Some(handle.id.clone()));
    assert!(
        !container_running(&handle.id),
        "stop must stop the container"
    );
    let sb = p.resume(&handle).await.unwrap();
    assert!(container_running(&handle.id), "resume must start it again");
    let got = collect(sb.read_file("/work/state").await.unwrap(), 1024)
        .await
        .unwrap();
    assert_eq!(&got[..], b"kept across stop");
    sb.destroy().await.unwrap();
}

fn snapshot_tags(nonce_identity_filter: &str) -> Vec<String> {
    let out = Command::new("docker")
        .args([
            "images",
            "--filter",
            &format!("label=dev.harness.identity={nonce_identity_filter}"),
            "--format",
            "{{.Repository}}:{{.Tag}}",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn bootstrap_runs_once_across_two_concurrent_processes() {
    let Some(p) = provider().await else { return };
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    // Two first sessions at once, in two processes.
    let a = std::thread::spawn({
        let nonce = nonce.clone();
        move || create_in_child(&["--bootstrap", &nonce])
    });
    let b = std::thread::spawn({
        let nonce = nonce.clone();
        move || create_in_child(&["--bootstrap", &nonce])
    });
    let (ha, hb) = (a.join().unwrap(), b.join().unwrap());
    let _ca = Cleanup(Some(ha.id.clone()));
    let _cb = Cleanup(Some(hb.id.clone()));
    let sa = p.resume(&ha).await.unwrap();
    let sb = p.resume(&hb).await.unwrap();
    let ran_a = sh_ok(&*sa, "cat /bootstrap-ran").await;
    let ran_b = sh_ok(&*sb, "cat /bootstrap-ran").await;
    assert!(!ran_a.trim().is_empty());
    assert_eq!(ran_a, ran_b, "the recipe ran twice");
    assert_eq!(sh_ok(&*sa, "cat /bootstrap-nonce").await.trim(), nonce);

    // One snapshot for that identity, listed by the provider.
    let image = ha.data["image"].as_str().unwrap().to_string();
    let identity = image.rsplit_once(':').unwrap().1.to_string();
    assert_eq!(snapshot_tags(&identity), vec![image.clone()]);
    let listed = p.list_snapshots().await.unwrap();
    assert!(listed
        .iter()
        .any(|s| s.identity == identity && s.reference == image));

    // A third (warm) session starts from the snapshot without rerunning it.
    let third = create_in_child(&["--bootstrap", &nonce]);
    let _c3 = Cleanup(Some(third.id.clone()));
    let s3 = p.resume(&third).await.unwrap();
    assert_eq!(sh_ok(&*s3, "cat /bootstrap-ran").await, ran_a);

    // Pruning keeps what is asked and what is in use, removes the rest.
    let kept = p
        .prune_snapshots(std::slice::from_ref(&identity))
        .await
        .unwrap();
    assert!(kept.iter().all(|s| s.identity != identity));
    assert_eq!(snapshot_tags(&identity).len(), 1);
    // Keep every snapshot but ours, as listed at the moment of pruning:
    // other tests (in other processes) make snapshots of their own meanwhile.
    let others = || async {
        p.list_snapshots()
            .await
            .unwrap()
            .into_iter()
            .map(|s| s.identity)
            .filter(|i| i != &identity)
            .collect::<Vec<String>>()
    };
    // While sessions use it, docker refuses to remove it: kept, not reported.
    let in_use = p.prune_snapshots(&others().await).await.unwrap();
    assert!(in_use.iter().all(|s| s.identity != identity), "{in_use:?}");
    assert_eq!(snapshot_tags(&identity).len(), 1);
    for s in [sa, sb, s3] {
        s.destroy().await.unwrap();
    }
    let removed = p.prune_snapshots(&others().await).await.unwrap();
    assert!(
        removed.iter().all(|s| s.identity == identity),
        "{removed:?}"
    );
    assert_eq!(removed.len(), 1, "{removed:?}");
    assert!(snapshot_tags(&identity).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_runs_once_across_two_concurrent_sessions_in_one_process() {
    use harness_core::bootstrap::BootstrapRecipe;
    use harness_core::sandbox::SandboxSpec;
    let Some(p) = provider().await else { return };
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    let mut spec = SandboxSpec::new("/work");
    spec.bootstrap = Some(BootstrapRecipe {
        files: vec![harness_core::bootstrap::RecipeFile {
            path: "/opt/recipe/hello.sh".into(),
            mode: 0o755,
            source: harness_core::bootstrap::FileSource::Inline {
                text: "#!/bin/sh\necho recipe-file\n".into(),
            },
        }],
        bootstrap_pre_commands: vec![format!("echo {nonce} > /bootstrap-nonce")],
        commands: vec!["sleep 1; date +%s%N > /bootstrap-ran".into()],
    });
    let (a, b) = tokio::join!(p.create(&spec), p.create(&spec));
    let (a, b) = (a.unwrap(), b.unwrap());
    let _ca = Cleanup(Some(a.handle().id));
    let _cb = Cleanup(Some(b.handle().id));
    assert_eq!(
        sh_ok(&*a, "cat /bootstrap-ran").await,
        sh_ok(&*b, "cat /bootstrap-ran").await,
        "the recipe ran twice"
    );
    assert_eq!(sh_ok(&*a, "/opt/recipe/hello.sh").await, "recipe-file\n");
    let image = a.handle().data["image"].as_str().unwrap().to_string();
    a.destroy().await.unwrap();
    b.destroy().await.unwrap();
    let _ = Command::new("docker").args(["rmi", &image]).output();
}

#[tokio::test]
async fn a_failing_recipe_leaves_no_snapshot_and_a_clear_error() {
    use harness_core::bootstrap::BootstrapRecipe;
    use harness_core::sandbox::SandboxSpec;
    let Some(p) = provider().await else { return };
    let mut spec = SandboxSpec::new("/work");
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    spec.bootstrap = Some(BootstrapRecipe {
        files: vec![],
        bootstrap_pre_commands: vec![format!("echo {nonce}; echo broken-step >&2; exit 4")],
        commands: vec![],
    });
    let identity = spec.bootstrap.as_ref().unwrap().identity(&common::image());
    let err = p
        .create(&spec)
        .await
        .expect_err("a failing recipe must fail create");
    assert!(err.message().contains("broken-step"), "{err}");
    assert!(snapshot_tags(&identity).is_empty());
    // No builder container is left behind.
    let out = Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=dev.harness.identity={identity}"),
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).trim().is_empty());
}

#[tokio::test]
async fn host_path_recipe_files_stream_in_and_are_verified() {
    use harness_core::bootstrap::{BootstrapRecipe, FileSource, RecipeFile};
    use harness_core::sandbox::SandboxSpec;
    use sha2::{Digest, Sha256};
    let Some(p) = provider().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("tool");
    // 3 MiB + a bit: several chunks and a partial tar block.
    let content: Vec<u8> = (0..3 * 1024 * 1024 + 77u32)
        .map(|i| (i % 253) as u8)
        .collect();
    std::fs::write(&host, &content).unwrap();
    let digest = hex::encode(Sha256::digest(&content));
    let recipe = |sha256: String| BootstrapRecipe {
        files: vec![RecipeFile {
            path: "/opt/tools/tool.bin".into(),
            mode: 0o750,
            source: FileSource::HostPath {
                path: host.to_string_lossy().into_owned(),
                sha256,
            },
        }],
        bootstrap_pre_commands: vec![format!("echo {}", uuid::Uuid::new_v4())],
        commands: vec![],
    };
    let mut spec = SandboxSpec::new("/work");
    spec.bootstrap = Some(recipe(digest.clone()));
    let sb = p.create(&spec).await.unwrap();
    let _c = Cleanup(Some(sb.handle().id));
    let got = sh_ok(
        &*sb,
        "stat -c %a /opt/tools/tool.bin; sha256sum /opt/tools/tool.bin",
    )
    .await;
    assert_eq!(got, format!("750\n{digest}  /opt/tools/tool.bin\n"));
    let image = sb.handle().data["image"].as_str().unwrap().to_string();
    sb.destroy().await.unwrap();
    let _ = Command::new("docker").args(["rmi", &image]).output();

    // A digest that does not match the host file fails the bootstrap.
    spec.bootstrap = Some(recipe("00".repeat(32)));
    let identity = spec.bootstrap.as_ref().unwrap().identity(&common::image());
    let err = p.create(&spec).await.expect_err("a wrong digest must fail");
    assert_eq!(err.kind(), harness_core::ErrorKind::Corrupt, "{err}");
    assert!(snapshot_tags(&identity).is_empty());
}
