//! `harness::open` on a machine with no agent binary says what to set (a
//! test binary of its own: it changes this process's environment).

#[tokio::test]
async fn open_without_any_agent_says_what_to_set() {
    let dir = tempfile::tempdir().unwrap();
    let empty = tempfile::tempdir().unwrap();
    // Nothing to find: no variables, an empty cache, an empty PATH.
    std::env::remove_var("HARNESS_CLAUDE_BIN");
    std::env::remove_var("HARNESS_CODEX_BIN");
    std::env::set_var("HARNESS_CACHE", empty.path());
    std::env::set_var("PATH", empty.path());
    let err = harness::open(dir.path()).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("set HARNESS_CLAUDE_BIN or HARNESS_CODEX_BIN"),
        "{err}"
    );
    // A variable naming a missing file is reported with its path.
    std::env::set_var("HARNESS_CLAUDE_BIN", "/nonexistent/claude");
    let err = harness::open(dir.path()).await.unwrap_err();
    assert!(err.to_string().contains("/nonexistent/claude"), "{err}");
}
