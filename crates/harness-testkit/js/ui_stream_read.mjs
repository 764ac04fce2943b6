// Reads one UI message stream with the AI SDK itself (`ai` package, what
// `useChat` runs): every chunk must pass `uiMessageChunkSchema`, and
// `readUIMessageStream` folds them into the message, printed as
// `AI SDK MESSAGE <json>`. Args: URL [bearer token].
// Run by harness_testkit::ai_sdk::read_ui_stream.
import { uiMessageChunkSchema, readUIMessageStream } from 'ai';
import { parseJsonEventStream } from '@ai-sdk/provider-utils';

const [url, token] = process.argv.slice(2);
const res = await fetch(url, { headers: token ? { authorization: `Bearer ${token}` } : {} });
if (res.status !== 200) throw new Error(`GET ${url}: ${res.status} ${await res.text()}`);
if (res.headers.get('x-vercel-ai-ui-message-stream') !== 'v1') throw new Error('missing header');
const chunks = [];
const parsed = parseJsonEventStream({ stream: res.body, schema: uiMessageChunkSchema });
const checked = parsed.pipeThrough(new TransformStream({
  transform(r, c) {
    if (!r.success) throw new Error('chunk rejected by uiMessageChunkSchema: ' + JSON.stringify(r.rawValue) + ' ' + r.error);
    chunks.push(r.value.type); c.enqueue(r.value);
  },
}));
let last;
for await (const m of readUIMessageStream({ stream: checked })) last = m;
console.log('chunks:', chunks.join(','));
console.log('AI SDK MESSAGE ' + JSON.stringify(last));
