// The package's own pure parts (no server): the SSE framing of command
// output, port URLs (no query string, the scheme the caller asks for) and
// line ranges. The end-to-end behaviour against `harness serve` is
// crates/harness-cli/tests/ai_sdk_sandbox.rs.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { SseParser, portUrl, sliceLines, createHarnessSandbox, HarnessSandboxError } from '../dist/index.js';

test('SSE events split across chunks come out whole, comments and CRLF ignored', () => {
  const p = new SseParser();
  assert.deepEqual(p.push('event: stdout\ndata: aGk'), []);
  assert.deepEqual(p.push('=\n\n: keep-alive\n\nevent: exit\r\ndata: {"exit_code":3}\r\n\r\n'), [
    { event: 'stdout', data: 'aGk=' },
    { event: 'exit', data: '{"exit_code":3}' },
  ]);
  assert.deepEqual(p.push('data: a\ndata: b\n\n'), [{ event: 'message', data: 'a\nb' }]);
});

test('port URLs keep the path, drop nothing, and map the scheme', () => {
  const path = '/v1/sandbox-port/s1/4000/abc/';
  assert.equal(portUrl('http://127.0.0.1:8787', path, 'ws'), 'ws://127.0.0.1:8787/v1/sandbox-port/s1/4000/abc/');
  assert.equal(portUrl('https://h.example/', path, 'ws'), 'wss://h.example/v1/sandbox-port/s1/4000/abc/');
  assert.equal(portUrl('http://h:1', path), 'http://h:1/v1/sandbox-port/s1/4000/abc/');
  assert.equal(portUrl('http://h:1', path, 'https'), 'https://h:1/v1/sandbox-port/s1/4000/abc/');
  // The AI SDK appends `?agent_bridge_token=…` to the string: there must be no query yet.
  assert.ok(!portUrl('http://h:1', path, 'ws').includes('?'));
});

test('line ranges are 1-based, inclusive, and stop at the end', () => {
  const text = 'a\nb\nc\nd';
  assert.equal(sliceLines(text), text);
  assert.equal(sliceLines(text, 2, 3), 'b\nc');
  assert.equal(sliceLines(text, 3), 'c\nd');
  assert.equal(sliceLines(text, 1, 99), text);
});

test('the provider is synchronous, names itself, and needs a url', () => {
  const p = createHarnessSandbox({ url: 'http://127.0.0.1:1', provider: 'local' });
  assert.equal(p.specificationVersion, 'harness-sandbox-v1');
  assert.equal(p.providerId, 'harness-serve:local');
  assert.equal(p.bridgePorts, undefined);
  assert.equal(typeof p.resumeSession, 'function');
  const wrap = createHarnessSandbox({ url: 'http://127.0.0.1:1', sandbox: 'mine', bridgePorts: [4000] });
  assert.deepEqual(wrap.bridgePorts, [4000]);
  assert.throws(() => createHarnessSandbox({}), HarnessSandboxError);
});

test('an unreachable server is a HarnessSandboxError with status 0', async () => {
  const p = createHarnessSandbox({ url: 'http://127.0.0.1:9', provider: 'local' });
  await assert.rejects(p.createSession({ sessionId: 's' }), (e) => e instanceof HarnessSandboxError && e.status === 0);
});
