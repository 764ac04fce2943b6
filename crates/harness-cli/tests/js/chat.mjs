// The AI SDK's own chat (`AbstractChat` of `ai`, what `useChat` wraps,
// with its `DefaultChatTransport`) driving a session of `harness serve`
// through `/v1/chat`, run by crates/harness-cli/tests/chat.rs from the
// example app's installed dependencies. Prints `RESULT <json>` on success;
// any failed check throws (exit 1).
//
// node chat.mjs '{"base":…,"client":…,"session":…,"agent":…,"approvalSession":…}'
import assert from 'node:assert/strict';
import {
  AbstractChat,
  DefaultChatTransport,
  lastAssistantMessageIsCompleteWithApprovalResponses,
  readUIMessageStream,
  validateUIMessages,
} from 'ai';
import { abortChat, loadChat } from '../../packages/ai-sdk/src/chat.ts';

const args = JSON.parse(process.argv[2]);
const api = `${args.base}/v1/chat`;
const headers = { Authorization: `Bearer ${args.client}` };
const result = {};

// The state `useChat` keeps in React, as plain fields; every text the
// assistant message showed is recorded, to see the answer stream in.
class State {
  constructor(messages = []) {
    this.messages = messages;
    this.status = 'ready';
    this.error = undefined;
    this.texts = new Set();
  }
  pushMessage = (m) => { this.messages = this.messages.concat(m); this.seen(m); };
  popMessage = () => { this.messages = this.messages.slice(0, -1); };
  replaceMessage = (i, m) => {
    this.messages = [...this.messages.slice(0, i), this.snapshot(m), ...this.messages.slice(i + 1)];
    this.seen(m);
  };
  snapshot = (v) => structuredClone(v);
  seen(m) {
    if (m.role !== 'assistant') return;
    const text = m.parts.filter((p) => p.type === 'text').map((p) => p.text).join('');
    if (text) this.texts.add(text);
  }
}

class Chat extends AbstractChat {
  constructor({ messages, ...init }) {
    const state = new State(messages);
    super({ ...init, state });
    this.store = state;
  }
}

function chat(id, messages = []) {
  return new Chat({
    id,
    messages,
    transport: new DefaultChatTransport({ api, headers }),
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
  });
}

async function waitFor(what, check, ms = 60_000, state = () => '') {
  const end = Date.now() + ms;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}: ${state()}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

async function info(id) {
  const r = await fetch(`${args.base}/v1/sessions/${id}`, { headers });
  assert.equal(r.status, 200);
  return r.json();
}

const last = (c) => c.messages[c.messages.length - 1];
const text = (m) => m.parts.filter((p) => p.type === 'text').map((p) => p.text).join('');
const tool = (m) => m.parts.find((p) => p.type === 'dynamic-tool');
const json = (v) => JSON.parse(JSON.stringify(v));

// Keeps the process alive while requests wait (the SDK's timers do not).
const alive = setInterval(() => {}, 1000);

// 1. A prompt: the tool call and its output, the answer streamed, the end.
const c = chat(args.session);
await c.sendMessage({ text: 'run the tool' });
assert.equal(c.status, 'ready', `status ${c.status}: ${c.error}`);
let m = last(c);
assert.equal(m.role, 'assistant');
assert.equal(m.id, 't1-assistant');
assert.equal(tool(m)?.state, 'output-available', JSON.stringify(m));
assert.match(JSON.stringify(tool(m).output), /tool-ran/);
assert.equal(text(m), 'The tool ran.');
assert.deepEqual(m.metadata, { turnId: 't1', status: 'finished' });
result.partialTexts = [...c.store.texts].filter((t) => t !== 'The tool ran.');
result.toolName = tool(m).toolName;

// 2. A second prompt continues the conversation (the model asserts it saw
// the first).
await c.sendMessage({ text: 'what did I ask first?' });
assert.equal(c.status, 'ready', `status ${c.status}: ${c.error}`);
m = last(c);
assert.equal(m.id, 't2-assistant');
assert.equal(text(m), 'You first asked me to run the tool.');

// 3. The same POST again (a retry after a dropped response): no new turn,
// the same answer replayed.
const turnsBefore = (await info(args.session)).meta.turns;
const upToPrompt = c.messages.slice(0, c.messages.length - 1);
assert.equal(upToPrompt[upToPrompt.length - 1].role, 'user');
const stream = await new DefaultChatTransport({ api, headers }).sendMessages({
  chatId: args.session,
  messages: upToPrompt,
  trigger: 'submit-message',
  messageId: undefined,
  abortSignal: new AbortController().signal,
});
let replayed;
for await (const message of readUIMessageStream({ stream })) replayed = message;
assert.equal(replayed.id, 't2-assistant');
assert.equal(text(replayed), 'You first asked me to run the tool.');
assert.equal((await info(args.session)).meta.turns, turnsBefore, 'a retried POST starts no turn');
result.retryTurns = turnsBefore;

// 4. The history is the log's, and what the streams built.
const history = await loadChat({ api, id: args.session, headers });
await validateUIMessages({ messages: history });
assert.deepEqual(history.map((h) => h.id), ['t1-user', 't1-assistant', 't2-user', 't2-assistant']);
assert.deepEqual(history[0].parts, [{ type: 'text', text: 'run the tool' }]);
for (const i of [1, 3]) assert.deepEqual(history[i], json(c.messages[i]), `message ${i}`);

if (args.agent === 'claude-code') {
  // 5. A dropped connection (the page closed, `stop()`) leaves the turn
  // running to its end.
  const dropped = c.sendMessage({ text: 'slow please' });
  await waitFor('the slow text', () => last(c).role === 'assistant' && text(last(c)).startsWith('slowly'));
  await c.stop();
  await dropped;
  // While it runs, what a page cannot do is an error it can show, and
  // stores nothing: a prompt, an answer to no pending request.
  const turns = (await info(args.session)).meta.turns;
  const busy = chat(args.session);
  await busy.sendMessage({ text: 'busy?' });
  assert.equal(busy.status, 'error');
  assert.equal(JSON.parse(busy.error.message).error.code, 'turn_in_progress');
  assert.match(JSON.parse(busy.error.message).error.message, /t3 is still running/);
  const stray = chat(args.session, [
    { id: 't1-assistant', role: 'assistant', parts: [
      { type: 'dynamic-tool', toolName: 'Bash', toolCallId: 'x', state: 'approval-responded', input: {}, approval: { id: 'nope', approved: true } },
    ] },
  ]);
  await stray.sendMessage();
  assert.equal(stray.status, 'error');
  assert.equal(JSON.parse(stray.error.message).error.code, 'no_pending_approval');
  assert.equal((await info(args.session)).meta.turns, turns, 'nothing stored');
  result.refusals = [busy.error.message, stray.error.message].map((m) => JSON.parse(m).error.message);
  const t3 = await waitFor('the dropped turn to end', async () => {
    const t = (await info(args.session)).meta.turn;
    return t.turn_id === 't3' && t.status !== 'not_started' && t.status !== 'ready_for_next_step' ? t : null;
  });
  assert.equal(t3.status, 'finished', JSON.stringify(t3));
  const h = await loadChat({ api, id: args.session, headers });
  assert.equal(text(h[h.length - 1]), 'slowly and slower still.');

  // 6. abortChat beside stop(): the turn ends failed with the reason.
  const stopped = c.sendMessage({ text: 'slow please, again' });
  await waitFor('the second slow text', () => last(c).id === 't4-assistant' && text(last(c)).startsWith('slowly'));
  await c.stop();
  await stopped;
  const end = await abortChat({ api, id: args.session, headers, reason: 'test stop' });
  assert.deepEqual(end, { turnId: 't4', status: 'failed', error: 'aborted: test stop' });
  assert.deepEqual(await abortChat({ api, id: args.session, headers }), { turnId: null, status: 'none' });

  // 7. An approval: the stream pauses at the request; the answer
  // (addToolApprovalResponse, sent by sendAutomaticallyWhen) continues
  // the same message to the end.
  const a = chat(args.approvalSession);
  await a.sendMessage({ text: 'run the tool' });
  m = last(a);
  assert.equal(tool(m)?.state, 'approval-requested', JSON.stringify(m));
  assert.equal(m.metadata.status, 'awaiting_tool_approval');
  await a.addToolApprovalResponse({ id: tool(m).approval.id, approved: true });
  await waitFor(
    'the approved turn to end',
    () => a.status === 'ready' && last(a).metadata?.status === 'finished',
    60_000,
    () => JSON.stringify({ status: a.status, error: a.error?.message, messages: a.messages }),
  );
  m = last(a);
  assert.equal(a.messages.length, 2, 'one assistant message, continued');
  assert.equal(tool(m).state, 'output-available');
  assert.equal(tool(m).approval.approved, true);
  assert.equal(text(m), 'The tool ran.');
  const ah = await loadChat({ api, id: args.approvalSession, headers });
  assert.deepEqual(ah[1], json(m));
  result.approved = true;
}

clearInterval(alive);
console.log(`RESULT ${JSON.stringify(result)}`);
