// The chat helpers' requests (`@harness/ai-sdk/chat`), against a local
// stand-in that records them and answers as `harness serve` does. The
// helpers against the real server, beside `useChat`'s transport, are
// crates/harness-cli/tests/chat.rs.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createServer } from 'node:http';
import { abortChat, loadChat, ChatRequestError } from '../dist/chat.js';

async function server(answer) {
  const seen = [];
  const srv = createServer((req, res) => {
    let body = '';
    req.on('data', (c) => (body += c));
    req.on('end', () => {
      seen.push({ method: req.method, url: req.url, auth: req.headers.authorization, body });
      const [status, json] = answer(req);
      res.writeHead(status, { 'content-type': 'application/json' });
      res.end(JSON.stringify(json));
    });
  });
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  return { api: `http://127.0.0.1:${srv.address().port}/v1/chat`, seen, close: () => srv.close() };
}

test('abortChat posts the reason to the session and returns how the turn ended', async () => {
  const s = await server(() => [200, { turnId: 't2', status: 'failed', error: 'aborted: user stop' }]);
  const end = await abortChat({ api: s.api + '/', id: 's 1', headers: { Authorization: 'Bearer tok' }, reason: 'user stop' });
  assert.deepEqual(end, { turnId: 't2', status: 'failed', error: 'aborted: user stop' });
  assert.deepEqual(s.seen, [{ method: 'POST', url: '/v1/chat/s%201/abort', auth: 'Bearer tok', body: '{"reason":"user stop"}' }]);
  s.close();
});

test('abortChat with no turn running resolves; other refusals throw with the server message', async () => {
  let answer = [409, { error: { code: 'no_active_turn', message: 'no turn is running' } }];
  const s = await server(() => answer);
  assert.deepEqual(await abortChat({ api: s.api, id: 's' }), { turnId: null, status: 'none' });
  answer = [403, { error: { code: 'forbidden', message: 'not your session' } }];
  await assert.rejects(abortChat({ api: s.api, id: 's' }), (e) => e instanceof ChatRequestError && e.status === 403 && e.code === 'forbidden' && e.message === 'not your session');
  s.close();
});

test('loadChat reads the history with the headers given', async () => {
  const history = [{ id: 't1-user', role: 'user', parts: [{ type: 'text', text: 'hi' }] }];
  const s = await server(() => [200, history]);
  assert.deepEqual(await loadChat({ api: s.api, id: 's', headers: new Headers({ Authorization: 'Bearer x' }) }), history);
  assert.equal(s.seen[0].url, '/v1/chat/s/messages');
  assert.equal(s.seen[0].auth, 'Bearer x');
  s.close();
});
