// A sandbox of `harness serve` as the AI SDK sees it: the bare
// `SandboxSession` (exec, files) and the network session on top of it
// (ports, lifecycle, network policy, request transformations). Every
// method is one API call; methods are arrow-function properties (the
// harness 1.0.40 agent calls them on an `Object.create` overlay).

import type { HarnessV1NetworkPolicy, HarnessV1NetworkSandboxSession } from '@ai-sdk/harness';
import type {
  Experimental_SandboxProcess as SandboxProcess,
  Experimental_SandboxSession as SandboxSession,
} from '@ai-sdk/provider-utils';
import { Api, HarnessSandboxError, SandboxInfo, SseParser, portUrl, sliceLines } from './wire.js';

type ProcessOptions = {
  command: string;
  workingDirectory?: string;
  env?: Record<string, string>;
  abortSignal?: AbortSignal;
};

type ReadOptions = { path: string; abortSignal?: AbortSignal };

/** Connection details for a port (`HarnessV1PortEndpoint` of newer harness releases). */
export type PortEndpoint = { readonly url: string; readonly headers?: Readonly<Record<string, string>> };

/** A request transformation (`HarnessV1RequestTransformation` of newer harness releases). */
export type RequestTransformation = {
  readonly match: {
    readonly host: string;
    readonly path?: { exact: string } | { startsWith: string } | { regex: string };
    readonly method?: ReadonlyArray<string>;
    readonly queryString?: ReadonlyArray<KeyValueMatcher>;
    readonly headers?: ReadonlyArray<KeyValueMatcher>;
  };
  readonly transform: { readonly headers: Readonly<Record<string, string>> };
};

type PartMatcher = { exact: string } | { startsWith: string } | { regex: string };
type KeyValueMatcher = { readonly key?: PartMatcher; readonly value?: PartMatcher };

const encoder = new TextEncoder();

function decodeBase64(data: string): Uint8Array {
  return new Uint8Array(Buffer.from(data, 'base64'));
}

/** Exec, spawn and files on one named sandbox. */
export class HarnessSandboxSession implements SandboxSession {
  protected readonly api: Api;
  protected readonly info: SandboxInfo;

  constructor(api: Api, info: SandboxInfo) {
    this.api = api;
    this.info = info;
  }

  protected path(suffix = ''): string {
    return `/v1/sandboxes/${encodeURIComponent(this.info.name)}${suffix}`;
  }

  get description(): string {
    const ports = this.info.ports.length > 0 ? ` Exposed ports: ${this.info.ports.join(', ')}.` : '';
    return (
      `A ${this.info.provider} sandbox of harness serve (name: ${this.info.name}). ` +
      `Working directory: ${this.info.workdir}. Files persist until the sandbox is destroyed.${ports}`
    );
  }

  readonly spawn = async (options: ProcessOptions): Promise<SandboxProcess> => {
    options.abortSignal?.throwIfAborted();
    // The request is not tied to the abort signal: a dropped connection
    // leaves the command running on the server; abort kills it explicitly.
    const response = await this.api.send('POST', this.path('/exec'), {
      json: { command: options.command, cwd: options.workingDirectory, env: options.env ?? {} },
    });
    const processId = response.headers.get('x-harness-process') ?? '';
    return new RemoteProcess(this.api, this.path(`/processes/${encodeURIComponent(processId)}/kill`), response, options.abortSignal);
  };

  readonly run = async (options: ProcessOptions): Promise<{ exitCode: number; stdout: string; stderr: string }> => {
    const process = await this.spawn(options);
    const [stdout, stderr] = await Promise.all([text(process.stdout), text(process.stderr)]);
    const { exitCode } = await process.wait();
    return { exitCode, stdout, stderr };
  };

  readonly readFile = async (options: ReadOptions): Promise<ReadableStream<Uint8Array> | null> => {
    const response = await this.api.send('GET', `${this.path('/file')}?path=${encodeURIComponent(options.path)}`, {
      signal: options.abortSignal,
      allow: [404],
    });
    if (response.status === 404) {
      const body = (await response.json().catch(() => ({}))) as { error?: { code?: string; message?: string } };
      if (body.error?.code === 'no_such_file') return null;
      throw new HarnessSandboxError(404, body.error?.code ?? 'not_found', body.error?.message ?? 'not found');
    }
    return response.body as ReadableStream<Uint8Array>;
  };

  readonly readBinaryFile = async (options: ReadOptions): Promise<Uint8Array | null> => {
    const stream = await this.readFile(options);
    if (stream === null) return null;
    return new Uint8Array(await new Response(stream).arrayBuffer());
  };

  readonly readTextFile = async (
    options: ReadOptions & { encoding?: string; startLine?: number; endLine?: number },
  ): Promise<string | null> => {
    const bytes = await this.readBinaryFile(options);
    if (bytes === null) return null;
    const text = new TextDecoder(options.encoding ?? 'utf-8').decode(bytes);
    return sliceLines(text, options.startLine, options.endLine);
  };

  readonly writeFile = async (options: {
    path: string;
    content: ReadableStream<Uint8Array>;
    abortSignal?: AbortSignal;
  }): Promise<void> => {
    await this.put(options.path, options.content, options.abortSignal);
  };

  readonly writeBinaryFile = async (options: { path: string; content: Uint8Array; abortSignal?: AbortSignal }): Promise<void> => {
    await this.put(options.path, options.content as Uint8Array<ArrayBuffer>, options.abortSignal);
  };

  readonly writeTextFile = async (options: {
    path: string;
    content: string;
    encoding?: string;
    abortSignal?: AbortSignal;
  }): Promise<void> => {
    const encoding = options.encoding ?? 'utf-8';
    const bytes =
      encoding === 'utf-8' || encoding === 'utf8'
        ? encoder.encode(options.content)
        : new Uint8Array(Buffer.from(options.content, encoding as BufferEncoding)) as Uint8Array<ArrayBuffer>;
    await this.put(options.path, bytes, options.abortSignal);
  };

  private async put(path: string, body: BodyInit, signal?: AbortSignal): Promise<void> {
    const response = await this.api.send('PUT', `${this.path('/file')}?path=${encodeURIComponent(path)}`, {
      body,
      signal,
    });
    await response.arrayBuffer();
  }
}

async function text(stream: ReadableStream<Uint8Array>): Promise<string> {
  return new Response(stream).text();
}

/** A command running on the server, its output streamed back. */
class RemoteProcess implements SandboxProcess {
  readonly stdout: ReadableStream<Uint8Array>;
  readonly stderr: ReadableStream<Uint8Array>;
  private readonly exited: Promise<number>;
  private done = false;
  private killing: Promise<void> | undefined;

  constructor(
    private readonly api: Api,
    private readonly killPath: string,
    response: Response,
    private readonly abortSignal: AbortSignal | undefined,
  ) {
    // Output is queued as it comes, never back-pressured: a consumer that
    // stops reading must not stall the command (the AI SDK stops reading
    // its bridge's stdout once the bridge is ready).
    let out!: ReadableStreamDefaultController<Uint8Array>;
    let err!: ReadableStreamDefaultController<Uint8Array>;
    this.stdout = new ReadableStream<Uint8Array>({ start: (c) => void (out = c) });
    this.stderr = new ReadableStream<Uint8Array>({ start: (c) => void (err = c) });
    const emit = (c: ReadableStreamDefaultController<Uint8Array>, bytes: Uint8Array) => {
      try {
        c.enqueue(bytes);
      } catch {
        // the consumer cancelled its stream
      }
    };
    const finish = (c: ReadableStreamDefaultController<Uint8Array>, error?: unknown) => {
      try {
        if (error === undefined) c.close();
        else c.error(error);
      } catch {
        // already closed or cancelled
      }
    };
    this.exited = (async () => {
      const parser = new SseParser();
      const decoder = new TextDecoder();
      const reader = (response.body as ReadableStream<Uint8Array>).getReader();
      try {
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          for (const event of parser.push(decoder.decode(value, { stream: true }))) {
            if (event.event === 'stdout') emit(out, decodeBase64(event.data));
            else if (event.event === 'stderr') emit(err, decodeBase64(event.data));
            else if (event.event === 'exit') {
              const exit = JSON.parse(event.data) as { exit_code: number };
              this.done = true;
              finish(out);
              finish(err);
              return exit.exit_code;
            } else if (event.event === 'error') {
              const e = JSON.parse(event.data) as { error: string; code: string };
              throw new HarnessSandboxError(0, e.code, e.error);
            }
          }
        }
        throw new HarnessSandboxError(0, 'no_exit', 'the command output ended without an exit status');
      } catch (error) {
        this.done = true;
        finish(out, error);
        finish(err, error);
        throw error;
      }
    })();
    // A failure is reported by wait(); never unhandled.
    this.exited.catch(() => {});
    if (abortSignal) {
      const onAbort = () => void this.kill();
      if (abortSignal.aborted) onAbort();
      else abortSignal.addEventListener('abort', onAbort, { once: true });
      this.exited.finally(() => abortSignal.removeEventListener('abort', onAbort)).catch(() => {});
    }
  }

  wait = async (): Promise<{ exitCode: number }> => {
    const exitCode = await this.exited.catch((error) => {
      if (this.abortSignal?.aborted) throw this.abortSignal.reason ?? error;
      throw error;
    });
    if (this.abortSignal?.aborted) {
      throw this.abortSignal.reason ?? new DOMException('The operation was aborted.', 'AbortError');
    }
    return { exitCode };
  };

  kill = async (): Promise<void> => {
    if (this.done) return;
    this.killing ??= this.api
      .send('POST', this.killPath, { allow: [404] })
      .then(() => undefined)
      .catch(() => undefined);
    await this.killing;
  };
}

/** The full session the agent holds: the sandbox plus ports, lifecycle and network. */
export class HarnessNetworkSandboxSession extends HarnessSandboxSession implements HarnessV1NetworkSandboxSession {
  readonly id: string;
  readonly defaultWorkingDirectory: string;
  readonly ports: ReadonlyArray<number>;
  /** How the server made this sandbox: `required` when the first-create hook had to run. */
  readonly bootstrap: SandboxInfo['bootstrap'];
  private readonly owned: boolean;

  constructor(api: Api, info: SandboxInfo, owned = true) {
    super(api, info);
    this.id = info.name;
    this.defaultWorkingDirectory = info.workdir;
    this.ports = info.ports;
    this.bootstrap = info.bootstrap;
    this.owned = owned;
  }

  readonly getPortUrl = async (options: { port: number; protocol?: 'http' | 'https' | 'ws' }): Promise<string> => {
    const { path } = await this.api.json<{ path: string }>('GET', this.path(`/ports/${options.port}`));
    return portUrl(this.api.url, path, options.protocol);
  };

  readonly getPortEndpoint = async (options: { port: number; protocol?: 'http' | 'https' | 'ws' }): Promise<PortEndpoint> => ({
    url: await this.getPortUrl(options),
  });

  /** Kill every process of the sandbox; its files stay. Idempotent. */
  readonly stop = async (): Promise<void> => {
    if (!this.owned) return;
    await this.api.send('POST', this.path('/stop'), { allow: [404] });
  };

  /** Remove the sandbox (running or stopped). */
  readonly destroy = async (): Promise<void> => {
    if (!this.owned) return;
    await this.api.send('DELETE', this.path(), { allow: [404] });
  };

  readonly setNetworkPolicy = async (policy: HarnessV1NetworkPolicy): Promise<void> => {
    await this.api.json('PUT', this.path('/network-policy'), policy);
  };

  readonly setRequestTransformations = async (transformations: ReadonlyArray<RequestTransformation>): Promise<void> => {
    await this.api.json('PUT', this.path('/request-transformations'), { transformations });
  };

  readonly addRequestTransformations = async (transformations: ReadonlyArray<RequestTransformation>): Promise<void> => {
    await this.api.json('POST', this.path('/request-transformations'), { transformations });
  };

  /** The same sandbox without the infrastructure methods. */
  readonly restricted = (): SandboxSession => new HarnessSandboxSession(this.api, this.info);
}
