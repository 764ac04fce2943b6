// Validates /ui-stream with the AI SDK itself (`ai` package): every chunk
// must pass `uiMessageChunkSchema`, and `readUIMessageStream` must build the
// expected message, live and replayed. Run by tests/ai_sdk.rs.
import { uiMessageChunkSchema, readUIMessageStream } from 'ai';
import { parseJsonEventStream } from '@ai-sdk/provider-utils';
import WebSocket from 'ws';

const base = process.argv[2];
const id = 'ui' + Date.now();
await fetch(`${base}/v1/sessions`, { method: 'POST', body: JSON.stringify({ id }) });

async function check(res) {
  if (res.headers.get('x-vercel-ai-ui-message-stream') !== 'v1') throw new Error('missing header');
  const parsed = parseJsonEventStream({ stream: res.body, schema: uiMessageChunkSchema });
  const chunks = [];
  const checked = parsed.pipeThrough(new TransformStream({
    transform(r, c) {
      if (!r.success) throw new Error('chunk rejected by uiMessageChunkSchema: ' + JSON.stringify(r.rawValue) + ' ' + r.error);
      chunks.push(r.value.type); c.enqueue(r.value);
    },
  }));
  let last;
  for await (const m of readUIMessageStream({ stream: checked })) last = m;
  return { chunks, message: last };
}

// The server registers the reader before it answers, so once the head is
// here every live part will reach it.
const live = check(await fetch(`${base}/v1/sessions/${id}/ui-stream`));
const ws = new WebSocket(`${base.replace('http', 'ws')}/v1/sessions/${id}/ws?role=runner&generation=1`);
await new Promise(r => ws.on('open', r));
const p = part => ws.send(JSON.stringify({ type: 'part', turnId: 't', part }));
p({ type: 'stream-start' });
p({ type: 'reasoning-start', id: 'r' }); p({ type: 'reasoning-delta', id: 'r', delta: 'hmm' }); p({ type: 'reasoning-end', id: 'r' });
p({ type: 'text-start', id: 'b' }); p({ type: 'text-delta', id: 'b', delta: 'Hel' }); p({ type: 'text-delta', id: 'b', delta: 'lo' }); p({ type: 'text-end', id: 'b' });
p({ type: 'tool-call', toolCallId: 'c1', toolName: 'Bash', input: { command: 'ls' } });
p({ type: 'tool-result', toolCallId: 'c1', toolName: 'Bash', output: 'a\nb' });
p({ type: 'tool-call', toolCallId: 'c2', toolName: 'Bash', input: { command: 'false' } });
p({ type: 'tool-result', toolCallId: 'c2', toolName: 'Bash', output: 'exit 1', isError: true });
p({ type: 'file-change', kind: 'create', path: 'x.txt' });
p({ type: 'finish-step' });
p({ type: 'finish', finishReason: 'stop' });
const a = await live;
console.log('live chunks:', a.chunks.join(','));
console.log('live message parts:', JSON.stringify(a.message.parts));
const b = await check(await fetch(`${base}/v1/sessions/${id}/ui-stream?after=0`));
console.log('replay chunks:', b.chunks.join(','));
console.log('replay message parts:', JSON.stringify(b.message.parts));
ws.close();
// What useChat would render, checked: same message live and replayed.
const want = JSON.stringify(a.message.parts);
if (JSON.stringify(b.message.parts) !== want) throw new Error('replay differs from live');
const parts = a.message.parts;
const text = parts.find(x => x.type === 'text');
if (!text || text.text !== 'Hello') throw new Error('text part: ' + JSON.stringify(text));
const reasoning = parts.find(x => x.type === 'reasoning');
if (!reasoning || reasoning.text !== 'hmm') throw new Error('reasoning part: ' + JSON.stringify(reasoning));
const tools = parts.filter(x => x.type === 'dynamic-tool').map(x => x.toolCallId + ':' + x.state).join(',');
if (tools !== 'c1:output-available,c2:output-error') throw new Error('tool parts: ' + tools);
if (a.chunks.filter(c => c === 'text-delta').length !== 2) throw new Error('live deltas: ' + a.chunks);
console.log('AI SDK CHECK OK');
