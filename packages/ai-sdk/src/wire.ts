// The wire of `harness serve`'s sandbox API (docs/ai-sdk.md): JSON
// requests, errors as {"error": {"code", "message"}}, command output as
// Server-Sent Events. No sandbox logic lives here: the server decides.

import * as http from 'node:http';
import * as https from 'node:https';
import { Readable } from 'node:stream';

/** An error the API answered (4xx/5xx), or a transport failure (status 0). */
export class HarnessSandboxError extends Error {
  readonly status: number;
  readonly code: string;
  constructor(status: number, code: string, message: string) {
    super(message);
    this.name = 'HarnessSandboxError';
    this.status = status;
    this.code = code;
  }
}

/** What the server answers about a sandbox. */
export type SandboxInfo = {
  name: string;
  provider: string;
  id: string;
  workdir: string;
  ports: number[];
  bootstrap?: 'none' | 'snapshot' | 'required';
};

export type Fetch = typeof globalThis.fetch;


const keepAlive = { http: new http.Agent({ keepAlive: true }), https: new https.Agent({ keepAlive: true }) };

/**
 * A response body as a web stream that queues up to 1 MiB before it pauses
 * the socket (`Readable.toWeb` pauses far sooner, and a 64 MiB read then
 * costs three times as long).
 */
function toWeb(res: http.IncomingMessage): ReadableStream<Uint8Array> {
  return new ReadableStream<Uint8Array>(
    {
      start(controller) {
        res.on('data', (chunk: Buffer) => {
          controller.enqueue(new Uint8Array(chunk.buffer, chunk.byteOffset, chunk.byteLength));
          if ((controller.desiredSize ?? 1) <= 0) res.pause();
        });
        res.on('end', () => controller.close());
        res.on('error', (e) => controller.error(e));
      },
      pull() {
        res.resume();
      },
      cancel() {
        res.destroy();
      },
    },
    new ByteLengthQueuingStrategy({ highWaterMark: 1 << 20 }),
  );
}

/**
 * A request through `node:http` with keep-alive, answered as a WHATWG
 * `Response`: on loopback it moves bodies about twice as fast as Node's
 * `fetch` and spends half the time on a small request (docs/ai-sdk.md).
 */
function nodeFetch(url: string, init: RequestInit): Promise<Response> {
  return new Promise((resolve, reject) => {
    const target = new URL(url);
    const secure = target.protocol === 'https:';
    const request = (secure ? https : http).request(
      target,
      {
        method: init.method,
        headers: init.headers as Record<string, string>,
        agent: secure ? keepAlive.https : keepAlive.http,
        signal: init.signal ?? undefined,
      },
      (res) => {
        const status = res.statusCode ?? 0;
        const headers = new Headers();
        for (const [name, value] of Object.entries(res.headers)) {
          if (Array.isArray(value)) value.forEach((v) => headers.append(name, v));
          else if (value !== undefined) headers.set(name, value);
        }
        if (init.method === 'HEAD' || status === 204 || status === 304) {
          res.resume();
          resolve(new Response(null, { status, headers }));
          return;
        }
        resolve(new Response(toWeb(res), { status, headers }));
      },
    );
    request.on('error', reject);
    const body = init.body;
    if (body === undefined || body === null) request.end();
    else if (typeof body === 'string' || body instanceof Uint8Array) request.end(body);
    else if (body instanceof ReadableStream) {
      Readable.fromWeb(body as import('node:stream/web').ReadableStream<Uint8Array>)
        .on('error', (e) => request.destroy(e))
        .pipe(request);
    } else reject(new TypeError('unsupported request body'));
  });
}

/** One client of one server. */
export class Api {
  readonly url: string;
  private readonly token: string | undefined;
  private readonly fetchImpl: Fetch;

  constructor(url: string, token: string | undefined, fetchImpl?: Fetch) {
    this.url = url.replace(/\/+$/, '');
    this.token = token;
    this.fetchImpl = fetchImpl ?? (nodeFetch as Fetch);
  }

  headers(extra?: Record<string, string>): Record<string, string> {
    const h: Record<string, string> = { ...extra };
    if (this.token) h.authorization = `Bearer ${this.token}`;
    return h;
  }

  /** A raw request; errors (non-2xx) are thrown as {@link HarnessSandboxError}. */
  async send(
    method: string,
    path: string,
    init: { body?: BodyInit | null; json?: unknown; signal?: AbortSignal; allow?: number[] } = {},
  ): Promise<Response> {
    const headers = this.headers(init.json === undefined ? undefined : { 'content-type': 'application/json' });
    const body = init.json === undefined ? init.body : JSON.stringify(init.json);
    let response: Response;
    try {
      response = await this.fetchImpl(`${this.url}${path}`, {
        method,
        headers,
        body,
        signal: init.signal,
        // A stream body needs half duplex in Node's fetch.
        ...(body instanceof ReadableStream ? { duplex: 'half' } : {}),
      } as RequestInit);
    } catch (error) {
      if (init.signal?.aborted) throw init.signal.reason ?? error;
      throw new HarnessSandboxError(0, 'unreachable', `harness serve at ${this.url}: ${String(error)}`);
    }
    if (!response.ok && !(init.allow ?? []).includes(response.status)) {
      throw await toError(response);
    }
    return response;
  }

  /** A JSON request answered with JSON. */
  async json<T>(method: string, path: string, json?: unknown, signal?: AbortSignal): Promise<T> {
    const response = await this.send(method, path, { json, signal });
    if (response.status === 204) return undefined as T;
    return (await response.json()) as T;
  }
}

async function toError(response: Response): Promise<HarnessSandboxError> {
  const text = await response.text().catch(() => '');
  try {
    const parsed = JSON.parse(text) as { error?: { code?: string; message?: string } };
    if (parsed.error?.code) {
      return new HarnessSandboxError(response.status, parsed.error.code, parsed.error.message ?? text);
    }
  } catch {
    // not JSON
  }
  return new HarnessSandboxError(response.status, 'http_error', `${response.status}: ${text}`);
}

/** One Server-Sent Event. */
export type SseEvent = { event: string; data: string };

/**
 * Split a stream of SSE text into events. `push` takes the next chunk of
 * text and returns the events it completed.
 */
export class SseParser {
  private buffer = '';

  push(text: string): SseEvent[] {
    this.buffer += text.replace(/\r\n/g, '\n');
    const out: SseEvent[] = [];
    let end: number;
    while ((end = this.buffer.indexOf('\n\n')) >= 0) {
      const block = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(end + 2);
      let event = 'message';
      const data: string[] = [];
      for (const line of block.split('\n')) {
        if (line.startsWith(':')) continue;
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? '' : line.slice(colon + 1);
        if (value.startsWith(' ')) value = value.slice(1);
        if (field === 'event') event = value;
        else if (field === 'data') data.push(value);
      }
      if (data.length > 0) out.push({ event, data: data.join('\n') });
    }
    return out;
  }
}

/**
 * The URL of a port path on a server at `base`, in the scheme asked for:
 * `ws` becomes `ws:` or `wss:` as the server is `http:` or `https:`. No
 * query string: the AI SDK appends its own.
 */
export function portUrl(base: string, path: string, protocol: 'http' | 'https' | 'ws' = 'http'): string {
  const url = new URL(path, `${base.replace(/\/+$/, '')}/`);
  const secure = url.protocol === 'https:';
  if (protocol === 'ws') url.protocol = secure ? 'wss:' : 'ws:';
  else if (protocol === 'https') url.protocol = 'https:';
  else url.protocol = secure ? 'https:' : 'http:';
  return url.toString();
}

/** Lines `startLine`..`endLine` (1-based, inclusive) of `text`. */
export function sliceLines(text: string, startLine?: number, endLine?: number): string {
  if (startLine === undefined && endLine === undefined) return text;
  const lines = text.split('\n');
  const start = Math.max(1, startLine ?? 1) - 1;
  const end = Math.min(lines.length, endLine ?? lines.length);
  return lines.slice(start, end).join('\n');
}
