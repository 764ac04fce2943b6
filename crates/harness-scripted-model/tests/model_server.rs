//! Tests of the scripted model servers over real HTTP (reqwest).

use std::time::{Duration, Instant};

use futures::StreamExt;
use harness_core::sse::SseReader;
use harness_scripted_model::*;
use serde_json::{json, Value};

/// `(event name, data JSON)` of every event of an SSE body, read with
/// core's SSE reader (what the agents' clients would see): an event
/// without a name is named after `data.type`, and data that is not JSON
/// (`[DONE]`) is a JSON string.
fn parse_sse(body: &str) -> Vec<(String, Value)> {
    let mut reader = SseReader::new();
    let events = reader.push(body.as_bytes()).expect("an SSE body");
    assert!(
        !reader.has_partial(),
        "the body ends inside an event: {body:?}"
    );
    events
        .into_iter()
        .map(|event| {
            let data = serde_json::from_str(&event.data).unwrap_or(Value::String(event.data));
            let name = match (event.event.as_str(), data["type"].as_str()) {
                ("message", Some(kind)) => kind.to_string(),
                (name, _) => name.to_string(),
            };
            (name, data)
        })
        .collect()
}

fn anthropic_prompt(text: &str) -> Value {
    json!({
        "model": "claude-test",
        "max_tokens": 100,
        "stream": true,
        "system": [{"type": "text", "text": "You are scripted."}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>ignore</system-reminder>"},
                {"type": "text", "text": text}
            ]},
            // Claude Code 2.1.x puts environment info in a system-role message.
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}
        ]
    })
}

fn anthropic_tool_result(prompt: &str, call_id: &str, output: &str) -> Value {
    json!({
        "model": "claude-test",
        "max_tokens": 100,
        "stream": true,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": prompt}]},
            {"role": "system", "content": "# Environment"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": call_id, "name": "Bash", "input": {"command": "x"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call_id, "content": output, "is_error": false}
            ]}
        ]
    })
}

fn openai_prompt(text: &str) -> Value {
    json!({
        "model": "gpt-test",
        "stream": true,
        "instructions": "You are scripted.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context/>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        ]
    })
}

fn openai_tool_result(prompt: &str, call_id: &str, output: &str) -> Value {
    json!({
        "model": "gpt-test",
        "stream": true,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]},
            {"type": "function_call", "call_id": call_id, "name": "exec_command", "arguments": "{\"cmd\":\"x\"}"},
            {"type": "function_call_output", "call_id": call_id, "output": output}
        ]
    })
}

async fn post_sse(url: String, body: &Value) -> Vec<(String, Value)> {
    let resp = reqwest::Client::new()
        .post(url)
        .header("x-api-key", "test")
        .json(body)
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    parse_sse(&resp.text().await.expect("body"))
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

/// Text of an Anthropic SSE answer (text deltas concatenated).
fn anthropic_text(events: &[(String, Value)]) -> String {
    events
        .iter()
        .filter(|(n, d)| n == "content_block_delta" && d["delta"]["type"] == "text_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_string())
        .collect()
}

fn anthropic_stop_reason(events: &[(String, Value)]) -> String {
    let (_, d) = events
        .iter()
        .find(|(n, _)| n == "message_delta")
        .expect("message_delta");
    d["delta"]["stop_reason"].as_str().unwrap().to_string()
}

/// Text of an OpenAI SSE answer (output_text deltas concatenated).
fn openai_text(events: &[(String, Value)]) -> String {
    events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect()
}

fn openai_done_items(events: &[(String, Value)]) -> Vec<Value> {
    events
        .iter()
        .filter(|(n, _)| n == "response.output_item.done")
        .map(|(_, d)| d["item"].clone())
        .collect()
}

#[tokio::test]
async fn anthropic_text_event_sequence() {
    let server = ScriptedModel::anthropic(Script::text("Hello, world"))
        .await
        .unwrap();
    let url = format!("{}/v1/messages?beta=true", server.base_url());
    let ev = post_sse(url, &anthropic_prompt("hi")).await;
    assert_eq!(
        names(&ev),
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    for (n, d) in &ev {
        assert_eq!(d["type"], n.as_str(), "event name equals data.type");
    }
    assert_eq!(ev[0].1["message"]["model"], "claude-test");
    assert_eq!(ev[0].1["message"]["role"], "assistant");
    assert_eq!(
        ev[2].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert_eq!(anthropic_text(&ev), "Hello, world");
    assert_eq!(anthropic_stop_reason(&ev), "end_turn");
    assert!(ev[7].1["usage"]["output_tokens"].as_u64().unwrap() > 0);
    server.assert_no_failures();

    let reqs = server.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].method, "POST");
    assert_eq!(reqs[0].path, "/v1/messages");
    assert_eq!(reqs[0].query.as_deref(), Some("beta=true"));
    assert_eq!(reqs[0].header("X-Api-Key"), Some("test"));
    assert_eq!(reqs[0].api, Some(Api::Anthropic));
    assert_eq!(reqs[0].rule, Some(0));
    assert_eq!(reqs[0].body["model"], "claude-test");
}

#[tokio::test]
async fn anthropic_tool_use_then_text() {
    let server = ScriptedModel::anthropic(Script::bash_then_text("echo hi", "Done."))
        .await
        .unwrap();
    let url = format!("{}/v1/messages", server.base_url());
    let ev = post_sse(url.clone(), &anthropic_prompt("make hi.txt")).await;
    let (_, start) = ev
        .iter()
        .find(|(n, d)| n == "content_block_start" && d["content_block"]["type"] == "tool_use")
        .expect("tool_use block");
    let index = start["index"].clone();
    assert_eq!(start["content_block"]["name"], "Bash");
    assert_eq!(start["content_block"]["id"], BASH_CALL_ID);
    assert_eq!(start["content_block"]["input"], json!({}));
    let partial: String = ev
        .iter()
        .filter(|(n, d)| n == "content_block_delta" && d["index"] == index)
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "input_json_delta");
            d["delta"]["partial_json"].as_str().unwrap().to_string()
        })
        .collect();
    let input: Value = serde_json::from_str(&partial).unwrap();
    assert_eq!(input["command"], "echo hi");
    assert!(input["description"].is_string());
    assert_eq!(anthropic_stop_reason(&ev), "tool_use");

    let ev = post_sse(
        url,
        &anthropic_tool_result("make hi.txt", BASH_CALL_ID, "hi"),
    )
    .await;
    assert_eq!(anthropic_text(&ev), "Done.");
    assert_eq!(anthropic_stop_reason(&ev), "end_turn");
    server.assert_no_failures();
}

#[tokio::test]
async fn openai_text_event_sequence() {
    let server = ScriptedModel::openai(Script::text("Hello, world"))
        .await
        .unwrap();
    let ev = post_sse(
        format!("{}/responses", server.v1_url()),
        &openai_prompt("hi"),
    )
    .await;
    assert_eq!(
        names(&ev),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (n, d)) in ev.iter().enumerate() {
        assert_eq!(d["type"], n.as_str());
        assert_eq!(d["sequence_number"], i);
    }
    assert_eq!(openai_text(&ev), "Hello, world");
    let items = openai_done_items(&ev);
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["type"], "message");
    assert_eq!(items[0]["role"], "assistant");
    assert_eq!(
        items[0]["content"],
        json!([{"type": "output_text", "text": "Hello, world", "annotations": []}])
    );
    let completed = &ev.last().unwrap().1["response"];
    assert_eq!(completed["status"], "completed");
    assert_eq!(completed["model"], "gpt-test");
    let usage = &completed["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap()
    );
    server.assert_no_failures();
    assert_eq!(server.requests()[0].api, Some(Api::OpenAi));
}

#[tokio::test]
async fn openai_function_call_then_text() {
    let server = ScriptedModel::openai(Script::bash_then_text("echo hi", "Done."))
        .await
        .unwrap();
    let url = format!("{}/responses", server.v1_url());
    let ev = post_sse(url.clone(), &openai_prompt("make hi.txt")).await;
    let items = openai_done_items(&ev);
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["type"], "function_call");
    assert_eq!(items[0]["name"], "exec_command");
    assert_eq!(items[0]["call_id"], BASH_CALL_ID);
    let args: Value = serde_json::from_str(items[0]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"cmd": "echo hi"}));
    let deltas: String = ev
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(deltas, items[0]["arguments"].as_str().unwrap());

    let ev = post_sse(
        url,
        &openai_tool_result("make hi.txt", BASH_CALL_ID, "hi\n"),
    )
    .await;
    assert_eq!(openai_text(&ev), "Done.");
    server.assert_no_failures();
}

/// A server that picked replies by a request counter would answer the first
/// request with the tool call and the second with the final text. This one
/// must look at each request: a resumed turn whose first request already ends
/// in a tool result gets the final text, and a repeated prompt gets the tool
/// call again.
#[tokio::test]
async fn rule_selection_uses_the_request_not_a_counter() {
    let server = ScriptedModel::start(Script::bash_then_text("echo hi", "Done."))
        .await
        .unwrap();
    let a = format!("{}/v1/messages", server.base_url());
    let o = format!("{}/responses", server.v1_url());

    // First request ever is a tool result: final text, not the tool call.
    let ev = post_sse(a.clone(), &anthropic_tool_result("p", BASH_CALL_ID, "hi")).await;
    assert_eq!(anthropic_text(&ev), "Done.");
    // The same request again: the same answer.
    let ev = post_sse(a.clone(), &anthropic_tool_result("p", BASH_CALL_ID, "hi")).await;
    assert_eq!(anthropic_text(&ev), "Done.");
    // A fresh prompt, twice: the tool call both times.
    for _ in 0..2 {
        let ev = post_sse(a.clone(), &anthropic_prompt("p")).await;
        assert_eq!(anthropic_stop_reason(&ev), "tool_use");
    }
    // A tool result for some OTHER call id is not ours: tool call again.
    let ev = post_sse(a.clone(), &anthropic_tool_result("p", "toolu_other", "x")).await;
    assert_eq!(anthropic_stop_reason(&ev), "tool_use");

    // Same on the OpenAI side, interleaved.
    let ev = post_sse(o.clone(), &openai_tool_result("p", BASH_CALL_ID, "hi")).await;
    assert_eq!(openai_text(&ev), "Done.");
    let ev = post_sse(o.clone(), &openai_prompt("p")).await;
    assert_eq!(openai_done_items(&ev)[0]["type"], "function_call");
    let ev = post_sse(o, &openai_tool_result("p", BASH_CALL_ID, "hi")).await;
    assert_eq!(openai_text(&ev), "Done.");

    let rules: Vec<_> = server.requests().iter().map(|r| r.rule).collect();
    assert_eq!(
        rules,
        [
            Some(0),
            Some(0),
            Some(1),
            Some(1),
            Some(1),
            Some(0),
            Some(1),
            Some(0)
        ]
    );
    server.assert_no_failures();
}

#[tokio::test]
async fn first_matching_rule_wins_and_text_matchers_see_the_prompt() {
    let script = Script::new()
        .on(last_user_text_contains("weather"), Reply::text("sunny"))
        .on(
            all([api(Api::OpenAi), last_user_text_contains("hello")]),
            Reply::text("hi from openai"),
        )
        .on(
            last_user_text_contains("hello"),
            Reply::text("hi from anyone"),
        )
        .on(system_contains("# Environment"), Reply::text("saw env"));
    let server = ScriptedModel::start(script).await.unwrap();
    let a = format!("{}/v1/messages", server.base_url());
    let o = format!("{}/responses", server.v1_url());
    assert_eq!(
        anthropic_text(&post_sse(a.clone(), &anthropic_prompt("the weather?")).await),
        "sunny"
    );
    assert_eq!(
        anthropic_text(&post_sse(a.clone(), &anthropic_prompt("hello")).await),
        "hi from anyone"
    );
    assert_eq!(
        openai_text(&post_sse(o.clone(), &openai_prompt("hello")).await),
        "hi from openai"
    );
    // Trailing system-role messages are not the user's text; system_contains sees them.
    assert_eq!(
        anthropic_text(&post_sse(a, &anthropic_prompt("other")).await),
        "saw env"
    );
    // OpenAI: no rule matches "other" (no "# Environment" there).
    assert_eq!(
        openai_text(&post_sse(o, &openai_prompt("other")).await),
        NO_MATCH_TEXT
    );
    assert_eq!(server.failures().len(), 1);
    assert!(server.failures()[0].contains(NO_MATCH_TEXT));
}

#[tokio::test]
async fn failed_assertion_is_recorded_and_answered() {
    let server = ScriptedModel::start(Script::bash_then_text_expecting(
        "echo hello",
        "hello",
        "Done.",
    ))
    .await
    .unwrap();
    let a = format!("{}/v1/messages", server.base_url());
    let ev = post_sse(
        a.clone(),
        &anthropic_tool_result("p", BASH_CALL_ID, "hello"),
    )
    .await;
    assert_eq!(anthropic_text(&ev), "Done.");
    server.assert_no_failures();

    let ev = post_sse(a, &anthropic_tool_result("p", BASH_CALL_ID, "goodbye")).await;
    let text = anthropic_text(&ev);
    assert!(text.starts_with("ASSERTION FAILED: "), "{text}");
    assert!(text.contains("goodbye"), "{text}");
    let o = format!("{}/responses", server.v1_url());
    let ev = post_sse(o, &openai_tool_result("p", BASH_CALL_ID, "nope")).await;
    assert!(openai_text(&ev).starts_with("ASSERTION FAILED: "));

    let failures = server.failures();
    assert_eq!(failures.len(), 2, "{failures:?}");
    assert!(
        failures[0].contains("does not contain \"hello\""),
        "{failures:?}"
    );
    let reqs = server.requests();
    assert!(reqs[0].failures.is_empty());
    assert_eq!(reqs[1].failures.len(), 1);
}

#[tokio::test]
async fn multi_turn_assertions_and_recorded_context() {
    let script = Script::new()
        .rule(
            Rule::new(last_user_text_contains("second"), Reply::text("two"))
                .assert_user_texts_contain("first")
                .assert_assistant_texts_contain("one"),
        )
        .on(any(), Reply::text("one"));
    let server = ScriptedModel::start(script).await.unwrap();
    let a = format!("{}/v1/messages", server.base_url());
    let mut body = anthropic_prompt("first");
    assert_eq!(anthropic_text(&post_sse(a.clone(), &body).await), "one");
    let msgs = body["messages"].as_array_mut().unwrap();
    msgs.push(json!({"role": "assistant", "content": [{"type": "text", "text": "one"}]}));
    msgs.push(json!({"role": "user", "content": "second"}));
    assert_eq!(anthropic_text(&post_sse(a.clone(), &body).await), "two");
    server.assert_no_failures();

    let reqs = server.model_requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[1].user_texts().len(), 2);
    assert!(reqs[1].user_texts()[0].contains("first"));
    assert_eq!(reqs[1].assistant_texts(), ["one"]);
    assert_eq!(reqs[1].last_user_text().as_deref(), Some("second"));

    // A second turn that lost the first one fails its assertions.
    let lost =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "second"}]});
    assert!(anthropic_text(&post_sse(a, &lost).await).starts_with("ASSERTION FAILED"));
    assert_eq!(server.failures().len(), 2);
}

#[tokio::test]
async fn thinking_and_custom_tools_render_per_api() {
    let reply = Reply::thinking("hmm, let me see")
        .then_text("Looking.")
        .then_tool(ToolCall::per_api(
            "call_9",
            ("Read", json!({"file_path": "/a"})),
            ("view_image", json!({"path": "/a"})),
        ));
    let server = ScriptedModel::start(Script::new().on(any(), reply))
        .await
        .unwrap();
    let ev = post_sse(
        format!("{}/v1/messages", server.base_url()),
        &anthropic_prompt("x"),
    )
    .await;
    let starts: Vec<&Value> = ev
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .map(|(_, d)| &d["content_block"])
        .collect();
    assert_eq!(starts[0]["type"], "thinking");
    assert_eq!(starts[1]["type"], "text");
    assert_eq!(starts[2]["name"], "Read");
    let thinking: String = ev
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "thinking_delta")
        .map(|(_, d)| d["delta"]["thinking"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(thinking, "hmm, let me see");
    assert!(ev
        .iter()
        .any(|(_, d)| d["delta"]["type"] == "signature_delta"));
    assert_eq!(anthropic_stop_reason(&ev), "tool_use");

    let ev = post_sse(
        format!("{}/responses", server.v1_url()),
        &openai_prompt("x"),
    )
    .await;
    let items = openai_done_items(&ev);
    assert_eq!(items[0]["type"], "reasoning");
    assert_eq!(items[0]["summary"][0]["text"], "hmm, let me see");
    assert_eq!(items[1]["type"], "message");
    assert_eq!(items[2]["name"], "view_image");
    assert!(ev
        .iter()
        .any(|(n, _)| n == "response.reasoning_summary_text.delta"));
}

#[tokio::test]
async fn chunks_are_streamed_with_delays() {
    let server = ScriptedModel::start(Script::new().on(
        any(),
        Reply::text_chunks(["Hel", "lo", "!"]).with_delay(150),
    ))
    .await
    .unwrap();
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/messages", server.base_url()))
        .json(&anthropic_prompt("x"))
        .send()
        .await
        .unwrap();
    let start = Instant::now();
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let mut seen = Vec::new(); // (time, number of text deltas so far)
    while let Some(chunk) = stream.next().await {
        buf.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        let n = buf.matches("\"text_delta\"").count();
        seen.push((start.elapsed(), n));
    }
    let ev = parse_sse(&buf);
    let deltas: Vec<_> = ev
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "text_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, ["Hel", "lo", "!"]);
    // The first delta was readable well before the last one was sent.
    let first = seen.iter().find(|(_, n)| *n >= 1).unwrap().0;
    let last = seen.iter().find(|(_, n)| *n >= 3).unwrap().0;
    assert!(
        last - first >= Duration::from_millis(250),
        "first {first:?} last {last:?}"
    );
}

#[tokio::test]
async fn non_streaming_requests_get_whole_messages() {
    let server = ScriptedModel::start(Script::bash_then_text("ls", "Done."))
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let mut body = anthropic_prompt("x");
    body["stream"] = json!(false);
    let msg: Value = client
        .post(format!("{}/v1/messages", server.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(msg["type"], "message");
    assert_eq!(msg["stop_reason"], "tool_use");
    assert_eq!(msg["content"][0]["type"], "tool_use");
    assert_eq!(msg["content"][0]["input"]["command"], "ls");

    let mut body = openai_tool_result("x", BASH_CALL_ID, "out");
    body["stream"] = json!(false);
    let resp: Value = client
        .post(format!("{}/responses", server.v1_url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(resp["object"], "response");
    assert_eq!(resp["output"][0]["content"][0]["text"], "Done.");
}

#[tokio::test]
async fn count_tokens_models_and_unknown_paths() {
    let server = ScriptedModel::start(Script::text("x")).await.unwrap();
    let client = reqwest::Client::new();
    let v: Value = client
        .post(format!(
            "{}/v1/messages/count_tokens?beta=true",
            server.base_url()
        ))
        .json(&anthropic_prompt("count me"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(v["input_tokens"].as_u64().unwrap() > 0);

    let v: Value = client
        .get(format!("{}/models", server.v1_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&"gpt-test"), "{ids:?}");
    assert!(ids.iter().any(|id| id.starts_with("claude")), "{ids:?}");

    let r = client
        .post(format!("{}/v1/unknown", server.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    let paths: Vec<String> = server.requests().iter().map(|r| r.path.clone()).collect();
    assert_eq!(
        paths,
        ["/v1/messages/count_tokens", "/v1/models", "/v1/unknown"]
    );
    // None of those is a model request, and none is a failure.
    assert!(server.model_requests().is_empty());
    server.assert_no_failures();
}

#[tokio::test]
async fn malformed_body_is_a_recorded_failure() {
    let server = ScriptedModel::start(Script::text("x")).await.unwrap();
    let r = reqwest::Client::new()
        .post(format!("{}/v1/messages", server.base_url()))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(server.failures().len(), 1);
}

#[tokio::test]
async fn server_stops_on_drop() {
    let server = ScriptedModel::start(Script::text("x")).await.unwrap();
    let addr = server.addr();
    assert!(tokio::net::TcpStream::connect(addr).await.is_ok());
    drop(server);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_err() {
            break;
        }
        assert!(Instant::now() < deadline, "still accepting after drop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn helpers_for_cli_configuration() {
    let server = ScriptedModel::start(Script::text("x")).await.unwrap();
    let env = server.claude_env();
    assert!(env.contains(&("ANTHROPIC_BASE_URL".to_string(), server.base_url())));
    let args = server.codex_config_args("gpt-test");
    assert_eq!(args.len(), 6);
    assert!(args[3].contains(&format!("base_url=\"{}\"", server.v1_url())));
    assert!(args[3].contains("wire_api=\"responses\""));
    assert_eq!(args[5], "model=gpt-test");
}

/// A held reply streams up to its hold, then nothing until the gate opens.
#[tokio::test]
async fn a_held_reply_waits_for_its_gate() {
    let gate = Gate::new();
    let server = ScriptedModel::anthropic(Script::new().on(
        any(),
        Reply::text_chunks(["one ", "two ", "three"]).hold_before_delta(1, gate.clone()),
    ))
    .await
    .unwrap();
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/messages", server.base_url()))
        .json(&json!({"model": "m", "max_tokens": 10, "stream": true,
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    // Up to the hold: the first delta arrives.
    while !seen.contains("one ") {
        let chunk = body.next().await.expect("stream open").unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    // Held: nothing more within a while (the stream would otherwise send
    // the next delta at once: the reply has no delay).
    let more = tokio::time::timeout(Duration::from_millis(300), body.next()).await;
    assert!(more.is_err(), "the held reply went on: {more:?}");
    assert!(!seen.contains("two "));
    gate.open();
    while let Some(chunk) = body.next().await {
        seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(seen.contains("two ") && seen.contains("three"), "{seen}");
    assert!(seen.contains("message_stop"), "{seen}");
}

#[tokio::test]
async fn a_model_requiring_a_key_refuses_requests_without_it() {
    let server = ScriptedModel::start_requiring_key(
        "127.0.0.1:0".parse().unwrap(),
        Script::text("keyed answer"),
        "the-real-key",
    )
    .await
    .unwrap();
    let url = format!("{}/v1/messages", server.base_url());
    let send = |key: Option<(&'static str, &'static str)>| {
        let mut req = reqwest::Client::new()
            .post(&url)
            .json(&anthropic_prompt("hello"));
        if let Some((name, value)) = key {
            req = req.header(name, value);
        }
        req.send()
    };
    for refused in [
        None,
        Some(("x-api-key", "placeholder")),
        Some(("authorization", "Bearer nope")),
    ] {
        let r = send(refused).await.unwrap();
        assert_eq!(r.status().as_u16(), 401, "{refused:?}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], "authentication_error");
    }
    assert_eq!(server.refused(), 3);
    for key in [
        ("x-api-key", "the-real-key"),
        ("authorization", "Bearer the-real-key"),
    ] {
        let r = send(Some(key)).await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{key:?}");
        let events = parse_sse(&r.text().await.unwrap());
        let text: String = events
            .iter()
            .filter_map(|(_, data)| data["delta"]["text"].as_str())
            .collect();
        assert_eq!(text, "keyed answer", "{key:?}");
    }
    assert_eq!(server.refused(), 3);
    assert!(server.failures().is_empty(), "{:?}", server.failures());
    assert_eq!(
        server.model_requests().len(),
        5,
        "every request is recorded"
    );
}
