// harness: watch and steer sessions from a browser.
//
// Everything goes through the session server's public API: GET/POST
// /v1/sessions, POST …/messages (prompt, approval-response, abort),
// …/fork and …/export, and the session's SSE stream (/events), which the
// browser's EventSource resumes by itself with Last-Event-ID after a
// dropped connection. Frames are rendered once each (by seq); live text
// deltas fill a block that its stored message then settles, so nothing is
// shown twice and nothing is missed, also across a reload.

const $ = (selector, root = document) => root.querySelector(selector);

const state = {
  token: sessionStorage.getItem("harness.token") || "",
  // The server accepts requests without a token (`--insecure-no-auth`,
  // `--demo`): no sign-in needed.
  open: false,
  session: null,
  // The seq a search hit opened the session at, until it is shown.
  focus: null,
  source: null,
  lastSeq: 0,
  running: null,
  sealed: false,
  blocks: new Map(),
  tools: new Map(),
  approvals: new Map(),
};

// ---- talking to the server ----------------------------------------------

function describe(status, body) {
  const code = body && body.error ? body.error.code : "";
  const message = body && body.error ? body.error.message : "";
  if (status === 401) return `The server refused this token (401 ${code}): ${message}`;
  if (status === 403) return `This token may not do that (403 ${code}): ${message}`;
  return `The server said ${status} ${code}: ${message}`;
}

async function api(path, options = {}) {
  const headers = Object.assign({ "Content-Type": "application/json" }, options.headers || {});
  if (state.token) headers.Authorization = `Bearer ${state.token}`;
  let response;
  try {
    response = await fetch(path, Object.assign({}, options, { headers }));
  } catch (e) {
    throw new Error(`The server cannot be reached: ${e.message}`);
  }
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    body = null;
  }
  if (!response.ok) {
    const error = new Error(describe(response.status, body));
    error.status = response.status;
    throw error;
  }
  return body;
}

function post(path, body) {
  return api(path, { method: "POST", body: JSON.stringify(body) });
}

function say(text, kind = "error") {
  const status = $("#status");
  status.textContent = text;
  status.dataset.kind = kind;
}

// ---- views ----------------------------------------------------------------

function show(view) {
  for (const id of ["signin-view", "sessions-view", "session-view"]) {
    $(`#${id}`).hidden = id !== view;
  }
  $("#who").hidden = !state.token && !state.open;
  $("#who-text").textContent = state.token ? "signed in" : "no sign-in needed";
}

function signOut() {
  state.token = "";
  state.open = false;
  sessionStorage.removeItem("harness.token");
  closeSession();
  location.hash = "#/";
  route();
}

async function signIn(event) {
  event.preventDefault();
  const token = $("#token").value.trim();
  const session = $("#signin-session").value.trim();
  state.token = token;
  try {
    if (session) {
      await api(`/v1/sessions/${encodeURIComponent(session)}`);
    } else {
      await api("/v1/sessions?limit=1");
    }
  } catch (e) {
    if (e.status === 403 && !session) {
      // A valid token that may not list sessions: keep it, ask for an id.
      sessionStorage.setItem("harness.token", token);
      say("This token cannot list sessions; open a session by its id.", "info");
      location.hash = "#/";
      route();
      return;
    }
    state.token = "";
    say(e.message);
    return;
  }
  sessionStorage.setItem("harness.token", token);
  say("", "info");
  location.hash = session ? `#/s/${session}` : "#/";
  route();
}

function relative(ms) {
  if (!ms) return "—";
  const seconds = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (seconds < 60) return `${seconds} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return new Date(ms).toLocaleString();
}

// Every session, page by page: the server answers at most 1,000 at a
// time, by id, and an empty page ends the list.
async function allSessions() {
  const all = [];
  for (let page = 0; page < 100; page++) {
    const last = all.length ? all[all.length - 1].session : null;
    const after = last ? `&after=${encodeURIComponent(last)}` : "";
    const next = await api(`/v1/sessions?limit=1000${after}`);
    if (!next.length) break;
    all.push(...next);
  }
  return all;
}

async function loadSessions() {
  const body = $("#sessions tbody");
  let list;
  try {
    list = await allSessions();
  } catch (e) {
    body.replaceChildren();
    if (e.status !== 403) say(e.message);
    return;
  }
  list.sort((a, b) => (b.last_at_ms || 0) - (a.last_at_ms || 0));
  body.replaceChildren(
    ...list.map((info) => {
      const row = document.createElement("tr");
      const config = info.meta.config || { agent: "claude-code", sandbox: { provider: "local" } };
      const turn = info.meta.turn;
      const link = document.createElement("a");
      link.href = `#/s/${info.session}`;
      link.textContent = info.session;
      const cells = [
        link,
        config.agent,
        config.sandbox.provider,
        info.sealed ? "sealed" : turn ? `${turn.turn_id} ${turn.status}` : "—",
        relative(info.last_at_ms),
      ];
      for (const content of cells) {
        const cell = document.createElement("td");
        cell.append(content);
        row.append(cell);
      }
      return row;
    }),
  );
}

async function startSession(event) {
  event.preventDefault();
  const body = {
    agent: $("#new-agent").value,
    sandbox: $("#new-sandbox").value,
  };
  const image = $("#new-image").value.trim();
  if (image) body.image = image;
  if ($("#new-approvals").checked) body.approvals = true;
  try {
    const info = await post("/v1/sessions", body);
    location.hash = `#/s/${info.session}`;
  } catch (e) {
    say(e.message);
  }
}

// ---- one session ----------------------------------------------------------

function closeSession() {
  if (state.source) state.source.close();
  state.source = null;
  state.session = null;
}

async function openSession(id) {
  closeSession();
  Object.assign(state, {
    session: id,
    lastSeq: 0,
    running: null,
    sealed: false,
    blocks: new Map(),
    tools: new Map(),
    approvals: new Map(),
    usage: { calls: 0, input: 0, output: 0, spend: 0, reportedInput: 0, reportedOutput: 0 },
  });
  $("#transcript").replaceChildren();
  $("#session-id").textContent = id;
  $("#session-meta").textContent = "";
  $("#session-usage").textContent = "";
  updateComposer();
  show("session-view");
  try {
    const info = await api(`/v1/sessions/${encodeURIComponent(id)}`);
    const config = info.meta.config || { agent: "claude-code", sandbox: { provider: "local" } };
    $("#session-meta").textContent =
      `${config.agent} in a ${config.sandbox.provider} sandbox` + (config.approvals ? ", asks before tools run" : "");
  } catch (e) {
    say(e.message);
    return;
  }
  const url = `/v1/sessions/${encodeURIComponent(id)}/events?after=0&access_token=${encodeURIComponent(state.token)}`;
  const source = new EventSource(url);
  state.source = source;
  source.addEventListener("open", () => ($("#connection").textContent = ""));
  source.addEventListener("error", () => {
    $("#connection").textContent =
      source.readyState === EventSource.CLOSED ? "disconnected" : "reconnecting… (resuming from the last frame)";
  });
  source.addEventListener("frame", (e) => onFrame(JSON.parse(e.data)));
  source.addEventListener("live", (e) => onLive(JSON.parse(e.data)));
}

function updateComposer() {
  const running = state.running !== null;
  $("#abort").disabled = !running || state.sealed;
  $("#send").disabled = state.sealed;
  $("#turn-state").textContent = state.sealed ? "sealed" : running ? `turn ${state.running} running…` : "";
}

function entry(kind, seq, turn) {
  const item = document.createElement("li");
  item.className = `entry ${kind}`;
  if (seq) item.dataset.seq = seq;
  if (turn) item.dataset.turn = turn;
  $("#transcript").append(item);
  return item;
}

/// Fork-here and Export for a stored frame.
function actions(item, seq) {
  const bar = document.createElement("div");
  bar.className = "actions";
  const fork = document.createElement("button");
  fork.type = "button";
  fork.textContent = "Fork here";
  fork.setAttribute("aria-label", `Fork the session at frame ${seq}`);
  fork.addEventListener("click", async () => {
    try {
      const info = await post(`/v1/sessions/${encodeURIComponent(state.session)}/fork?until=${seq}`, {});
      location.hash = `#/s/${info.session}`;
    } catch (e) {
      say(e.message);
    }
  });
  const download = document.createElement("button");
  download.type = "button";
  download.textContent = "Export";
  download.setAttribute("aria-label", `Export frames up to ${seq}`);
  download.addEventListener("click", async () => {
    try {
      const frames = await api(`/v1/sessions/${encodeURIComponent(state.session)}/export?until=${seq}`);
      const blob = new Blob([JSON.stringify(frames, null, 2)], { type: "application/json" });
      const a = document.createElement("a");
      a.href = URL.createObjectURL(blob);
      a.download = `${state.session}-until-${seq}.json`;
      a.click();
      URL.revokeObjectURL(a.href);
    } catch (e) {
      say(e.message);
    }
  });
  bar.append(fork, download);
  item.append(bar);
}

function text(tag, content, className) {
  const el = document.createElement(tag);
  el.textContent = content;
  if (className) el.className = className;
  return el;
}

function shown(value) {
  if (typeof value === "string") return value;
  return JSON.stringify(value, null, 2);
}

/// The text or reasoning block `id` of a turn, created on first use.
function block(turn, kind, id) {
  const key = `${turn}/${kind}/${id}`;
  let found = state.blocks.get(key);
  if (!found) {
    const item = entry(kind === "reasoning" ? "reasoning" : "assistant", null, turn);
    let body;
    if (kind === "reasoning") {
      const details = document.createElement("details");
      details.append(text("summary", "Reasoning"));
      body = text("p", "");
      details.append(body);
      item.append(details);
    } else {
      body = text("p", "");
      item.append(body);
    }
    found = { item, body };
    state.blocks.set(key, found);
  }
  return found;
}

function onLive({ turnId, part }) {
  switch (part.type) {
    case "text-start":
    case "reasoning-start":
      // A block (re)starts: a re-sent block or the catch-up of a block in
      // progress replaces what was shown.
      block(turnId, part.type.startsWith("text") ? "text" : "reasoning", part.id).body.textContent = "";
      break;
    case "text-delta":
    case "reasoning-delta":
      block(turnId, part.type.startsWith("text") ? "text" : "reasoning", part.id).body.textContent += part.delta;
      break;
    default:
      break;
  }
}

function toolCard(turn, id, name, seq) {
  let card = state.tools.get(id);
  if (!card) {
    const item = entry("tool", seq, turn);
    item.append(text("h3", name));
    const input = text("pre", "", "input");
    const output = text("pre", "", "output");
    output.hidden = true;
    item.append(input, output);
    card = { item, input, output };
    state.tools.set(id, card);
  }
  return card;
}

/// A tool's input: a command as itself, a file edit as a diff (Claude
/// Code's Edit and Write report old and new text), anything else as JSON.
function renderInput(card, input) {
  const pre = card.input;
  pre.replaceChildren();
  const isObject = input && typeof input === "object";
  const line = (prefix, content, className) => {
    const span = text("span", `${prefix}${content}\n`, className);
    pre.append(span);
  };
  if (isObject && typeof input.command === "string") {
    card.item.classList.add("shell");
    pre.textContent = input.command;
  } else if (isObject && typeof input.old_string === "string" && typeof input.new_string === "string") {
    pre.classList.add("diff");
    line("", input.file_path || "", "path");
    for (const l of input.old_string.split("\n")) line("- ", l, "del");
    for (const l of input.new_string.split("\n")) line("+ ", l, "ins");
  } else if (isObject && typeof input.content === "string" && input.file_path) {
    pre.classList.add("diff");
    line("", input.file_path, "path");
    for (const l of input.content.split("\n")) line("+ ", l, "ins");
  } else {
    pre.textContent = shown(input);
  }
}

function onPart(frame) {
  const { turnId, part } = frame.body;
  switch (part.type) {
    case "tool-call": {
      const card = toolCard(turnId, part.toolCallId, part.toolName, frame.seq);
      renderInput(card, part.input);
      actions(card.item, frame.seq);
      break;
    }
    case "tool-result": {
      const card = toolCard(turnId, part.toolCallId, part.toolName, frame.seq);
      card.output.hidden = false;
      card.output.textContent = shown(part.output);
      card.item.classList.toggle("failed", Boolean(part.isError));
      break;
    }
    case "tool-approval-request": {
      const item = entry("approval", frame.seq, turnId);
      const command = part.input && part.input.command ? part.input.command : shown(part.input);
      item.append(text("h3", `Permission requested: ${part.toolName}`), text("pre", command, "input"));
      const answer = document.createElement("div");
      answer.className = "answer";
      for (const [label, approved] of [["Approve", true], ["Deny", false]]) {
        const button = document.createElement("button");
        button.type = "button";
        button.textContent = label;
        button.setAttribute("aria-label", `${label} ${part.toolName}`);
        button.addEventListener("click", async () => {
          for (const b of answer.querySelectorAll("button")) b.disabled = true;
          try {
            await post(`/v1/sessions/${encodeURIComponent(state.session)}/messages`, {
              type: "approval-response",
              approvalId: part.approvalId,
              approved,
              reason: approved ? null : "denied in the web page",
            });
          } catch (e) {
            for (const b of answer.querySelectorAll("button")) b.disabled = false;
            say(e.message);
          }
        });
        answer.append(button);
      }
      item.append(answer);
      state.approvals.set(part.approvalId, answer);
      break;
    }
    case "file-change":
      entry("file", frame.seq, turnId).append(text("p", `✎ ${part.kind} ${part.path}`));
      break;
    case "error":
      entry("error", frame.seq, turnId).append(text("p", part.message));
      break;
    case "warning": {
      // A model the agent cannot reach shows up at once, not as silence.
      const retry = part.attempt ? ` (retry ${part.attempt}${part.maxAttempts ? ` of ${part.maxAttempts}` : ""})` : "";
      entry("warning", frame.seq, turnId).append(text("p", `⚠ ${part.message}${retry}`));
      break;
    }
    case "audit": {
      // Audit records are the log's, not the conversation's: they add to
      // the usage line, nothing to the transcript.
      const record = part.record || {};
      if (record.kind === "model-call") {
        state.usage.calls += 1;
        state.usage.input += record.inputTokens || 0;
        state.usage.output += record.outputTokens || 0;
        state.usage.spend += record.spendMicros || 0;
        showUsage();
      }
      break;
    }
    case "finish": {
      const usage = part.usage || {};
      state.usage.reportedInput += usage.inputTokens || 0;
      state.usage.reportedOutput += usage.outputTokens || 0;
      showUsage();
      entry("finish", frame.seq, turnId).append(
        text("p", `finished (${part.finishReason}) · ${usage.inputTokens || 0} in / ${usage.outputTokens || 0} out tokens`),
      );
      break;
    }
    default:
      break;
  }
}

/// The session's usage so far, as its log has it (the same sums as the
/// session info's `meta.usage`): brokered calls when there are any, else
/// what the agent reported.
function showUsage() {
  const u = state.usage;
  const n = (v) => v.toLocaleString("en-US");
  if (u.calls > 0) {
    const spend = u.spend > 0 ? ` · $${(u.spend / 1e6).toFixed(4)}` : "";
    $("#session-usage").textContent =
      `usage: ${n(u.calls)} model call${u.calls === 1 ? "" : "s"} · ${n(u.input)} in / ${n(u.output)} out tokens${spend}`;
  } else if (u.reportedInput + u.reportedOutput > 0) {
    $("#session-usage").textContent =
      `usage: ${n(u.reportedInput)} in / ${n(u.reportedOutput)} out tokens (as the agent reports)`;
  }
}

/// A search hit's snippet: the matched words (between `[` and `]`) marked.
function snippet(line) {
  const span = document.createElement("span");
  span.className = "snippet";
  for (const piece of line.split(/(\[[^\]]*\])/)) {
    if (piece.length > 2 && piece.startsWith("[") && piece.endsWith("]")) span.append(text("mark", piece.slice(1, -1)));
    else span.append(piece);
  }
  return span;
}

/// Search every session (`GET /v1/search`); each hit links to its frame.
async function search(event) {
  event.preventDefault();
  const q = $("#search-q").value.trim();
  const list = $("#search-results");
  list.replaceChildren();
  try {
    const hits = await api(`/v1/search?q=${encodeURIComponent(q)}`);
    if (!hits.length) {
      list.append(text("li", `No frame holds all of: ${q}`, "none"));
      return;
    }
    for (const hit of hits) {
      const link = document.createElement("a");
      link.href = `#/s/${hit.session}/${hit.seq}`;
      link.append(text("code", hit.session), ` #${hit.seq} `, text("span", hit.kind, "kind"), " ", snippet(hit.snippet));
      const item = document.createElement("li");
      item.append(link);
      list.append(item);
    }
  } catch (e) {
    say(e.message);
  }
}

/// Once the frame a search hit named is shown: mark it, scroll to it.
function focusFrame() {
  const want = state.focus;
  const shown = [...document.querySelectorAll("#transcript [data-seq]")];
  const at = shown.filter((el) => Number(el.dataset.seq) <= want).pop();
  if (!at) return;
  state.focus = null;
  for (const old of document.querySelectorAll("#transcript .found")) old.classList.remove("found");
  at.classList.add("found");
  at.setAttribute("aria-current", "true");
  at.tabIndex = -1;
  at.scrollIntoView({ block: "center" });
  at.focus({ preventScroll: true });
}

function onFrame(frame) {
  renderFrame(frame);
  if (state.focus !== null && frame.seq >= state.focus) focusFrame();
}

function renderFrame(frame) {
  if (frame.seq <= state.lastSeq) return; // already shown
  state.lastSeq = frame.seq;
  const body = frame.body;
  switch (body.type) {
    case "user-message": {
      const item = entry("user", frame.seq, body.turnId);
      item.append(text("p", body.text));
      actions(item, frame.seq);
      state.running = body.turnId || "";
      break;
    }
    case "message": {
      const found = block(body.turnId, body.kind, body.id);
      found.body.textContent = body.text;
      found.item.dataset.seq = frame.seq;
      found.item.classList.add("stored");
      if (body.interrupted) found.item.classList.add("interrupted");
      actions(found.item, frame.seq);
      break;
    }
    case "part":
      onPart(frame);
      break;
    case "approval-response": {
      const answer = state.approvals.get(body.approvalId);
      if (answer) answer.replaceChildren(text("p", body.approved ? "Approved" : `Denied${body.reason ? `: ${body.reason}` : ""}`, "answered"));
      break;
    }
    case "abort-requested":
      entry("note", frame.seq, body.turnId).append(text("p", `Abort requested: ${body.reason}`));
      break;
    case "turn-status":
      if (["finished", "failed", "timed_out"].includes(body.status)) {
        const item = entry(`status ${body.status}`, frame.seq, body.turnId);
        item.append(text("p", `turn ${body.turnId} ${body.status}${body.error ? `: ${body.error}` : ""}`));
        if (state.running === body.turnId) state.running = null;
      } else if (state.running === null) {
        state.running = body.turnId;
      }
      break;
    case "host-call":
      // A host tool the agent called; it runs on the session's tool host.
      entry("note", frame.seq, body.turnId).append(
        text("p", `Host tool ${body.tool} called (${body.callId})`),
      );
      break;
    case "host-outcome": {
      const detail = body.outcome === "completed"
        ? `${body.isError ? "failed" : "completed"}${body.truncated ? ", output truncated" : ""}`
        : `${body.outcome}${body.reason ? `: ${body.reason}` : ""}`;
      entry(`note host-${body.outcome}`, frame.seq, body.turnId).append(
        text("p", `Host tool call ${body.callId} ${detail}`),
      );
      break;
    }
    case "sealed":
      entry("note", frame.seq).append(text("p", "The session is sealed; fork it to continue."));
      state.sealed = true;
      break;
    default:
      break;
  }
  updateComposer();
}

async function send(event) {
  event.preventDefault();
  const prompt = $("#prompt");
  const text = prompt.value.trim();
  if (!text || !state.session) return;
  try {
    await post(`/v1/sessions/${encodeURIComponent(state.session)}/messages`, { type: "prompt", text });
    prompt.value = "";
    say("", "info");
  } catch (e) {
    say(e.message);
  }
}

async function abort() {
  try {
    await post(`/v1/sessions/${encodeURIComponent(state.session)}/messages`, {
      type: "abort",
      reason: "stopped in the web page",
    });
  } catch (e) {
    say(e.message);
  }
}

// ---- routing --------------------------------------------------------------

let refresher = null;

async function route() {
  clearInterval(refresher);
  if (!state.token && !state.open) {
    // Does this server want a token at all?
    try {
      await api("/v1/sessions?limit=1");
      state.open = true;
    } catch (_) {
      closeSession();
      show("signin-view");
      return;
    }
  }
  const match = location.hash.match(/^#\/s\/([A-Za-z0-9._-]+)(?:\/(\d+))?$/);
  if (match) {
    // `#/s/<id>/<seq>` (a search hit): that frame, marked, once shown.
    state.focus = match[2] ? Number(match[2]) : null;
    if (state.session !== match[1]) openSession(match[1]);
    else if (state.focus !== null) focusFrame();
    return;
  }
  closeSession();
  show("sessions-view");
  loadSessions();
  refresher = setInterval(loadSessions, 5000);
}

$("#signin").addEventListener("submit", signIn);
$("#signout").addEventListener("click", signOut);
$("#new-session").addEventListener("submit", startSession);
$("#open-session").addEventListener("submit", (event) => {
  event.preventDefault();
  location.hash = `#/s/${$("#open-id").value.trim()}`;
});
$("#refresh").addEventListener("click", loadSessions);
$("#search").addEventListener("submit", search);
$("#composer").addEventListener("submit", send);
$("#abort").addEventListener("click", abort);
$("#prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("#composer").requestSubmit();
  }
});
window.addEventListener("hashchange", route);
route();
