//! The web page of `harness serve`, in a real headless Chromium (Debian's
//! `chromium` driven through `chromedriver` over WebDriver), against the
//! built `harness` binary with the real `claude` and the scripted model:
//! sign in, start a session, send a prompt and see the text stream in and
//! the tool call with its output; approve and deny permission requests by
//! clicking; abort a long turn; reload mid-turn and see the transcript
//! continue without duplicates; two windows on one session see the same
//! transcript; a wrong token and a client token's fork get clear messages.
//!
//! Screenshots of the main states go to `$HARNESS_CACHE/screenshots/web/`
//! (the cache directory CI keeps). Skips (prints "skipped: …") without
//! chromium/chromedriver or the claude binary; fails then under
//! `HARNESS_REQUIRE_REAL=1`.

mod common;

use std::time::{Duration, Instant};

use common::browser::*;
use common::server::*;
use fantoccini::{Client, Locator};
use harness_testkit::model::{
    any, last_is_tool_result_for, last_user_text_contains, Reply, Rule, Script, ScriptedModel,
    ToolCall,
};
use serde_json::json;

const CALL_A: &str = "toolu_web_a";
const CALL_B: &str = "toolu_web_b";
const CALL_WRITE: &str = "toolu_web_write";

/// Sign in with `token` (and a session id for a scoped token).
async fn sign_in(serve: &Serve, client: &Client, token: &str, session: Option<&str>) {
    client.goto(&serve.url("/")).await.unwrap();
    type_into(client, "#token", token).await;
    if let Some(session) = session {
        type_into(client, "#signin-session", session).await;
    }
    click(client, "#signin button[type=submit]").await;
}

/// Send a prompt from the composer.
async fn send_prompt(client: &Client, text: &str) {
    type_into(client, "#prompt", text).await;
    click(client, "#send").await;
}

fn claude() -> bool {
    Agent::Claude.available()
}

/// Sign in, start a session from the form, send a prompt: the text streams
/// in, the tool call shows its command and output, the turn ends finished.
/// Also the session list, and the page at a phone's width.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_streams_its_text_and_tool_call_into_the_page() {
    if !claude() {
        return;
    }
    let Some(b) = browser(1100, 900).await else {
        return;
    };
    let notes = tempfile::tempdir().unwrap();
    let notes_path = notes.path().join("notes.md").display().to_string();
    let script = Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(CALL_A),
                Reply::text_chunks(["The file ", "says ", "hello ", "web."]).with_delay(300),
            )
            .assert_tool_result_contains(CALL_A, "hello-web"),
        )
        .on(
            last_is_tool_result_for(CALL_WRITE),
            Reply::shell(CALL_A, "echo hello-web > web.txt && cat web.txt"),
        )
        // A file the agent writes with its own tool (not a command): the
        // page shows it as a diff. Absolute, outside the sandbox's tree, so
        // the test can read it back.
        .on(
            any(),
            Reply::tool(ToolCall::named(
                CALL_WRITE,
                "Write",
                json!({"file_path": notes_path, "content": "first line\nsecond line"}),
            )),
        );
    let model = ScriptedModel::start(script).await.unwrap();
    let home = ServeHome::new();
    let serve = Serve::start(home.path(), &model, &[]);
    let c = &b.client;
    sign_in(&serve, c, HOST, None).await;
    wait_text(&serve, c, "#sessions caption", "Sessions on this server").await;
    c.find(Locator::Css("#new-agent"))
        .await
        .unwrap()
        .select_by_value("claude-code")
        .await
        .unwrap();
    click(c, "#new-session button[type=submit]").await;
    wait_text(&serve, c, "#session-meta", "claude-code in a local sandbox").await;
    send_prompt(c, "write the web file").await;
    let output = wait_text(&serve, c, ".entry.tool.shell pre.output", "hello-web").await;
    assert_eq!(output.trim(), "hello-web");
    let command = text_of(c, ".entry.tool.shell pre.input").await;
    assert!(command.contains("echo hello-web"), "{command}");
    // The Write call, as a diff: its path, then every line added.
    let diff = text_of(c, ".entry.tool pre.input.diff").await;
    assert_eq!(
        diff.lines().collect::<Vec<_>>(),
        [notes_path.as_str(), "+ first line", "+ second line"],
        "{diff}"
    );
    assert_eq!(
        std::fs::read_to_string(&notes_path).unwrap(),
        "first line\nsecond line"
    );
    wait_text(&serve, c, ".entry.status.finished", "finished").await;
    let answer = text_of(c, ".entry.assistant p").await;
    assert_eq!(answer, "The file says hello web.");
    // The usage line: the brokered calls, the same sums as the session's
    // info (`meta.usage`, folded from the log's audit records).
    let usage = wait_text(&serve, c, "#session-usage", "model call").await;
    let id = text_of(c, "#session-id").await;
    let info = get_json(&serve, &format!("/v1/sessions/{id}")).await;
    let meta = &info["meta"]["usage"];
    let calls = meta["modelCalls"].as_u64().unwrap_or(0);
    assert!(calls >= 2, "{info:#}");
    let fmt = |v: &serde_json::Value| {
        let n = v.as_u64().unwrap_or(0).to_string();
        // en-US grouping, as the page prints it.
        let mut out = String::new();
        for (i, ch) in n.chars().enumerate() {
            if i > 0 && (n.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(ch);
        }
        out
    };
    assert_eq!(
        usage.trim(),
        format!(
            "usage: {calls} model calls · {} in / {} out tokens",
            fmt(&meta["inputTokens"]),
            fmt(&meta["outputTokens"])
        ),
        "{info:#}"
    );
    assert_eq!(count(c, ".entry.user").await, 1);
    assert_eq!(count(c, ".entry.assistant").await, 1);
    assert!(c.find(Locator::Css("#abort[disabled]")).await.is_ok());
    model.assert_no_failures();
    screenshot(c, "transcript").await;
    // The session list shows it, finished.
    c.goto(&serve.url("/#/")).await.unwrap();
    wait_text(&serve, c, "#sessions tbody", "t1 finished").await;
    screenshot(c, "sessions").await;
    // A phone's width: the same transcript, one column.
    let Some(phone) = browser(390, 844).await else {
        return;
    };
    let id = text_of(c, "#sessions tbody a").await;
    sign_in(&serve, &phone.client, HOST, Some(&id)).await;
    wait_text(&serve, &phone.client, ".entry.status.finished", "finished").await;
    screenshot(&phone.client, "phone").await;
    // Fork here, on the prompt: a new session holding the prompt and
    // nothing the agent did after it.
    c.goto(&serve.url(&format!("/#/s/{id}"))).await.unwrap();
    wait_text(&serve, c, ".entry.status.finished", "finished").await;
    click(c, ".entry.user .actions button").await;
    let started = Instant::now();
    let fork = loop {
        let url = c.current_url().await.unwrap();
        let hash = url.fragment().unwrap_or_default().to_string();
        if hash.starts_with("/s/") && !hash.ends_with(&id) {
            break hash.trim_start_matches("/s/").to_string();
        }
        assert!(
            started.elapsed() < WAIT,
            "the page did not open a fork: {url}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    wait_text(&serve, c, "#session-title", &fork).await;
    wait_text(&serve, c, ".entry.user p", "write the web file").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(count(c, ".entry.user").await, 1);
    assert_eq!(
        count(c, ".entry.tool").await,
        0,
        "the fork ends at the prompt"
    );
    assert_eq!(count(c, ".entry.assistant").await, 0);
    // The cut turn is closed in the fork: nothing runs, a prompt may follow.
    let closed = wait_text(&serve, c, ".entry.status.failed", "forked from").await;
    assert!(closed.contains(&id), "{closed}");
    assert!(c.find(Locator::Css("#abort[disabled]")).await.is_ok());
    screenshot(c, "fork").await;
}

/// Approve one permission request and deny another by clicking: the
/// approved command runs, the denied one does not and the agent is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_and_deny_by_clicking() {
    if !claude() || approval_server().is_none() {
        return;
    }
    let Some(b) = browser(1100, 900).await else {
        return;
    };
    let script = Script::new()
        .rule(
            Rule::new(last_is_tool_result_for(CALL_A), Reply::text("All done."))
                .assert_tool_result_contains(CALL_A, "wrote-it"),
        )
        .rule(
            Rule::new(
                last_is_tool_result_for(CALL_B),
                Reply::text("Understood, I did not run it."),
            )
            .assert_tool_result_contains(CALL_B, "denied in the web page"),
        )
        .on(
            last_user_text_contains("make another file"),
            Reply::shell(CALL_B, "echo ran > denied.txt && echo should-not-run"),
        )
        .on(
            last_user_text_contains("make the file"),
            Reply::shell(CALL_A, "echo ran > approved.txt && echo wrote-it"),
        );
    let model = ScriptedModel::start(script).await.unwrap();
    let home = ServeHome::new();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(
        &serve,
        json!({"agent": "claude-code", "sandbox": "local", "approvals": true}),
    )
    .await;
    let c = &b.client;
    sign_in(&serve, c, HOST, Some(&id)).await;
    wait_text(&serve, c, "#session-meta", "asks before tools run").await;
    send_prompt(c, "please make the file").await;
    wait_text(
        &serve,
        c,
        ".entry.approval h3",
        "Permission requested: Bash",
    )
    .await;
    screenshot(c, "approval").await;
    click(c, ".entry.approval button[aria-label='Approve Bash']").await;
    wait_text(&serve, c, ".entry.approval .answered", "Approved").await;
    wait_text(&serve, c, ".entry.tool pre.output", "wrote-it").await;
    wait_text(&serve, c, ".entry.status.finished", "finished").await;
    // The second request: deny it.
    send_prompt(c, "please make another file").await;
    let started = Instant::now();
    while count(c, ".entry.approval .answer button").await < 2 {
        assert!(started.elapsed() < WAIT, "no second approval request");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    click(c, ".entry.approval .answer button[aria-label='Deny Bash']").await;
    let started = Instant::now();
    while count(c, ".entry.status.finished").await < 2 {
        assert!(
            started.elapsed() < WAIT,
            "the denied turn did not finish:\n{}",
            text_of(c, "body").await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let page = text_of(c, "#transcript").await;
    assert!(page.contains("Denied: denied in the web page"), "{page}");
    assert!(page.contains("Understood, I did not run it."), "{page}");
    // The denied call's card shows the refusal as its output, not the
    // command's.
    let outputs = c
        .find_all(Locator::Css(".entry.tool pre.output"))
        .await
        .unwrap();
    assert_eq!(outputs.len(), 2);
    let denied = outputs[1].text().await.unwrap();
    assert!(denied.contains("denied in the web page"), "{denied}");
    assert!(!denied.contains("should-not-run"), "{denied}");
    model.assert_no_failures();
    let workdir = std::fs::read_dir(home.path().join("sandboxes"))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path().join("work"))
        .find(|p| p.is_dir())
        .expect("the session's sandbox");
    assert!(
        workdir.join("approved.txt").exists(),
        "the approved command ran"
    );
    assert!(
        !workdir.join("denied.txt").exists(),
        "the denied command did not"
    );
}

/// The Abort button ends a long turn `failed` with `aborted: …`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_a_long_turn_from_the_page() {
    if !claude() {
        return;
    }
    let Some(b) = browser(1100, 900).await else {
        return;
    };
    let script = Script::new().on(
        any(),
        Reply::shell(
            CALL_A,
            "timeout 120 tail -f /dev/null; echo should-never-print",
        ),
    );
    let model = ScriptedModel::start(script).await.unwrap();
    let home = ServeHome::new();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    let c = &b.client;
    sign_in(&serve, c, CLIENT, Some(&id)).await;
    send_prompt(c, "run the long command").await;
    wait_text(&serve, c, ".entry.tool pre.input", "tail -f").await;
    wait_text(&serve, c, "#turn-state", "running").await;
    click(c, "#abort").await;
    let status = wait_text(&serve, c, ".entry.status.failed", "aborted").await;
    assert!(
        status.contains("aborted: stopped in the web page"),
        "{status}"
    );
    screenshot(c, "aborted").await;
}

/// A reload in the middle of a turn: the transcript is rebuilt from the
/// log and continues live; every entry once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_mid_turn_continues_without_duplicates() {
    if !claude() {
        return;
    }
    let Some(b) = browser(1100, 900).await else {
        return;
    };
    let chunks = ["The slow ", "task ", "is ", "done ", "and ", "verified."];
    let script = Script::new()
        .rule(Rule::new(
            last_is_tool_result_for(CALL_A),
            Reply::text_chunks(chunks).with_delay(500),
        ))
        .on(any(), Reply::shell(CALL_A, "sleep 3; echo slow-done"));
    let model = ScriptedModel::start(script).await.unwrap();
    let home = ServeHome::new();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    let c = &b.client;
    sign_in(&serve, c, HOST, Some(&id)).await;
    send_prompt(c, "do the slow thing").await;
    wait_text(&serve, c, ".entry.tool pre.output", "slow-done").await;
    // Reload while the answer streams.
    wait_text(&serve, c, ".entry.assistant p", "The slow").await;
    c.refresh().await.unwrap();
    wait_text(&serve, c, ".entry.status.finished", "finished").await;
    assert_eq!(count(c, ".entry.user").await, 1);
    assert_eq!(count(c, ".entry.tool").await, 1);
    assert_eq!(count(c, ".entry.assistant").await, 1);
    assert_eq!(count(c, ".entry.status").await, 1);
    assert_eq!(text_of(c, ".entry.assistant p").await, chunks.concat());
    model.assert_no_failures();
}

/// Two windows on one session see the same transcript.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_windows_see_the_same_transcript() {
    if !claude() {
        return;
    }
    let Some(one) = browser(1000, 800).await else {
        return;
    };
    let Some(two) = browser(1000, 800).await else {
        return;
    };
    let script = Script::bash_each_turn("echo both-windows", "Both see this.");
    let model = ScriptedModel::start(script).await.unwrap();
    let home = ServeHome::new();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    sign_in(&serve, &one.client, HOST, Some(&id)).await;
    sign_in(&serve, &two.client, CLIENT, Some(&id)).await;
    wait_text(&serve, &two.client, "#session-meta", "claude-code").await;
    send_prompt(&one.client, "first").await;
    wait_text(&serve, &one.client, ".entry.status.finished", "finished").await;
    wait_text(&serve, &two.client, ".entry.status.finished", "finished").await;
    // The second window sends the next prompt; the first sees it too.
    send_prompt(&two.client, "second").await;
    for c in [&one.client, &two.client] {
        let started = Instant::now();
        while count(c, ".entry.status.finished").await < 2 {
            assert!(started.elapsed() < WAIT, "{}", text_of(c, "body").await);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let a = text_of(&one.client, "#transcript").await;
    let b = text_of(&two.client, "#transcript").await;
    assert_eq!(a, b, "the same transcript in both windows");
    assert_eq!(a.matches("Both see this.").count(), 2, "{a}");
}

/// A wrong token gets a clear message; a client token may not fork.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tokens_and_forbidden_actions_get_clear_messages() {
    let Some(b) = browser(1000, 800).await else {
        return;
    };
    let model = ScriptedModel::start(Script::text("unused")).await.unwrap();
    let home = ServeHome::new();
    let serve = Serve::start(home.path(), &model, &[]);
    let c = &b.client;
    sign_in(&serve, c, "not-a-token-0123456789", None).await;
    let message = wait_text(&serve, c, "#status", "refused this token").await;
    assert!(message.contains("401"), "{message}");
    assert!(c
        .find(Locator::Css("#signin-view:not([hidden])"))
        .await
        .is_ok());
    screenshot(c, "wrong-token").await;
    // A client token scoped to a session: it may prompt, not fork.
    let id = create(&serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    let (status, _) = post(
        &serve.url(&format!("/v1/sessions/{id}/messages")),
        CLIENT,
        json!({"type": "prompt", "text": "something to fork at"}),
    )
    .await;
    assert_eq!(status, 200);
    sign_in(&serve, c, CLIENT, Some(&id)).await;
    wait_text(&serve, c, ".entry.user p", "something to fork at").await;
    click(c, ".entry.user .actions button").await;
    let message = wait_text(&serve, c, "#status", "may not do that").await;
    assert!(message.contains("403"), "{message}");
}

/// A host-tool call shows as a line when the session records it and one
/// with its outcome; the agent's answer carries the host's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_tool_call_and_its_outcome_show_in_the_transcript() {
    if !claude() {
        return;
    }
    let Some(b) = browser(1100, 900).await else {
        return;
    };
    const CALL_HOST: &str = "toolu_web_host";
    let script = Script::new()
        .rule(
            Rule::new(
                last_is_tool_result_for(CALL_HOST),
                Reply::text("The host found order 4711."),
            )
            .assert_tool_result_contains(CALL_HOST, "order 4711 found"),
        )
        .on(
            any(),
            Reply::tool(ToolCall::named(
                CALL_HOST,
                "mcp__host__lookup",
                json!({"q": "4711"}),
            )),
        );
    let model = ScriptedModel::start(script).await.unwrap();
    let home = ServeHome::new();
    let host_dir = tempfile::tempdir().unwrap();
    let tools = host_dir.path().join("tools.toml");
    std::fs::write(
        &tools,
        "[[tool]]\nname = \"lookup\"\ndescription = \"Look up an order\"\ncommand = [\"sh\", \"-c\", \"cat >/dev/null; echo order 4711 found\"]\n",
    )
    .unwrap();
    let serve = Serve::start(home.path(), &model, &[]);
    let id = create(&serve, json!({"agent": "claude-code", "sandbox": "local"})).await;
    let _host = RelayHost::start(&serve, &id, &tools, &[]);
    let c = &b.client;
    sign_in(&serve, c, CLIENT, Some(&id)).await;
    send_prompt(c, "look up order 4711").await;
    wait_text(&serve, c, ".entry.note", "Host tool lookup called").await;
    let outcome = wait_text(&serve, c, ".entry.host-completed", "completed").await;
    assert!(outcome.contains("Host tool call"), "{outcome}");
    wait_text(&serve, c, ".entry.status.finished", "finished").await;
    wait_text(&serve, c, "body", "The host found order 4711.").await;
    model.assert_no_failures();
    screenshot(c, "host-tool").await;
}

/// The search box: words typed on the sessions page find the frame in
/// another session; clicking the hit opens that session at that frame,
/// marked and offering "Fork here"; words found nowhere say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_search_hit_opens_the_session_at_its_frame() {
    if !claude() {
        return;
    }
    let Some(b) = browser(1100, 900).await else {
        return;
    };
    let model = ScriptedModel::start(Script::new().on(any(), Reply::text("Noted.")))
        .await
        .unwrap();
    let home = ServeHome::new();
    let serve = Serve::start(home.path(), &model, &[]);
    let mut target = None;
    for (i, words) in [
        "tidy the changelog",
        "rename the walrus parser",
        "bump the version",
    ]
    .into_iter()
    .enumerate()
    {
        let id = create(
            &serve,
            json!({"id": format!("find-{i}"), "agent": "claude-code"}),
        )
        .await;
        prompt(&serve, &id, words).await;
        if words.contains("walrus") {
            target = Some(id);
        }
    }
    let target = target.unwrap();
    // The prompt's seq, as the log holds it.
    let frames = export(&serve, &target).await;
    let seq = frames
        .iter()
        .find(|f| f["body"]["type"] == "user-message")
        .and_then(|f| f["seq"].as_u64())
        .expect("the prompt is stored");
    // Searchable within a second of its append (docs/search.md).
    let started = Instant::now();
    while get_json_as(&serve, "/v1/search?q=walrus", HOST)
        .await
        .as_array()
        .is_none_or(|hits| hits.is_empty())
    {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the prompt never became searchable"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = &b.client;
    sign_in(&serve, c, HOST, None).await;
    wait_text(&serve, c, "#sessions caption", "Sessions on this server").await;
    type_into(c, "#search-q", "walrus").await;
    click(c, "#search button[type=submit]").await;
    let hit = wait_text(&serve, c, "#search-results li a", &target).await;
    assert!(hit.contains(&format!("#{seq}")), "{hit}");
    assert!(hit.contains("prompt"), "{hit}");
    assert_eq!(count(c, "#search-results li").await, 1, "{hit}");
    assert_eq!(text_of(c, "#search-results mark").await, "walrus");
    screenshot_to(c, "web", "search-results").await;
    click(c, "#search-results li a").await;
    wait_text(&serve, c, "#session-id", &target).await;
    let found = wait_text(&serve, c, "#transcript .found", "walrus").await;
    assert!(found.contains("rename the walrus parser"), "{found}");
    let marked = c
        .find(Locator::Css("#transcript .found"))
        .await
        .unwrap()
        .attr("data-seq")
        .await
        .unwrap();
    assert_eq!(marked.as_deref(), Some(seq.to_string().as_str()));
    assert_eq!(
        count(c, "#transcript .found button").await,
        2,
        "Fork here and Export"
    );
    screenshot_to(c, "web", "search-opened").await;
    // Words found nowhere: said so.
    c.goto(&serve.url("/#/")).await.unwrap();
    wait_text(&serve, c, "#sessions caption", "Sessions on this server").await;
    type_into(c, "#search-q", "narwhal").await;
    click(c, "#search button[type=submit]").await;
    wait_text(
        &serve,
        c,
        "#search-results li",
        "No frame holds all of: narwhal",
    )
    .await;
}
