//! The audit layer over a real local sandbox: every command the harness
//! runs through it is recorded with how it ended, the agent's launch as
//! detached, environment names without their values, and a command whose
//! output was not read to the end as `unfinished`.

use std::collections::BTreeMap;

use harness_core::audit::{AuditLog, AuditRecord, AuditedSandbox};
use harness_core::sandbox::{
    collect_exec, DetachedRequest, ExecRequest, Sandbox, SandboxProvider, SandboxSpec,
};
use sandbox_local::LocalProvider;

#[tokio::test]
async fn every_command_is_recorded_with_how_it_ended() {
    let dir = tempfile::tempdir().unwrap();
    let provider = LocalProvider::new(dir.path().join("sandboxes"));
    let inner = provider
        .create(&SandboxSpec::new("/workspace"))
        .await
        .unwrap();
    let log = AuditLog::default();
    let sandbox = AuditedSandbox::audited(inner, log.clone());

    let ok = collect_exec(sandbox.exec(ExecRequest::new(["true"])).await.unwrap())
        .await
        .unwrap();
    assert!(ok.status.success());
    let secret = "hsb1_not-for-the-log";
    let failed = collect_exec(
        sandbox
            .exec(
                ExecRequest::shell("exit 3")
                    .env("SESSION_TOKEN", secret)
                    .cwd("/"),
            )
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(failed.status.code, Some(3));
    // Started, its output never read: dropped.
    drop(sandbox.exec(ExecRequest::shell("sleep 0.1")).await.unwrap());
    // The agent's launch.
    let process = sandbox
        .spawn_detached(DetachedRequest {
            argv: vec!["sh".into(), "-c".into(), "echo agent".into()],
            cwd: None,
            env: BTreeMap::from([("ANTHROPIC_BASE_URL".to_string(), "http://x".to_string())]),
            spool_dir: format!("{}/.spool", sandbox.workdir()),
        })
        .await
        .unwrap();
    // Reads go through unrecorded (they are no commands).
    sandbox.detached_status(&process).await.unwrap();

    let records = log.take();
    assert_eq!(records.len(), 4, "{records:#?}");
    let exec = |r: &AuditRecord| match r {
        AuditRecord::Exec {
            argv,
            cwd,
            env,
            detached,
            exit_code,
            ended,
            ..
        } => (
            argv.clone(),
            cwd.clone(),
            env.clone(),
            *detached,
            *exit_code,
            ended.clone(),
        ),
        other => panic!("not an exec: {other:?}"),
    };
    assert_eq!(
        exec(&records[0]),
        (
            vec!["true".into()],
            None,
            vec![],
            false,
            Some(0),
            Some("exited".into())
        )
    );
    assert_eq!(
        exec(&records[1]),
        (
            vec!["sh".into(), "-c".into(), "exit 3".into()],
            Some("/".into()),
            vec!["SESSION_TOKEN".into()],
            false,
            Some(3),
            Some("exited".into())
        )
    );
    assert_eq!(exec(&records[2]).5, Some("unfinished".into()));
    let (argv, _, env, detached, exit_code, _) = exec(&records[3]);
    assert_eq!(
        (argv[2].as_str(), detached, exit_code),
        ("echo agent", true, None)
    );
    assert_eq!(env, ["ANTHROPIC_BASE_URL"]);
    let text = serde_json::to_string(&records).unwrap();
    assert!(
        !text.contains(secret) && !text.contains("http://x"),
        "{text}"
    );
    sandbox.destroy().await.unwrap();
}
