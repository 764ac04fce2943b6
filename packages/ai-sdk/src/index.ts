// `createHarnessSandbox`: the AI SDK's sandbox provider slot
// (`HarnessV1SandboxProvider`) over `harness serve`. Thin: every decision
// (naming, snapshots per identity, network policy, the proxy that adds
// request transformations, port URLs) is the server's; see docs/ai-sdk.md.

import type { HarnessV1NetworkPolicy, HarnessV1SandboxProvider } from '@ai-sdk/harness';
import type { Experimental_SandboxSession as SandboxSession } from '@ai-sdk/provider-utils';
import { HarnessNetworkSandboxSession, RequestTransformation } from './session.js';
import { Api, Fetch, HarnessSandboxError, SandboxInfo } from './wire.js';

export { HarnessNetworkSandboxSession, HarnessSandboxSession } from './session.js';
export type { PortEndpoint, RequestTransformation } from './session.js';
export { HarnessSandboxError, SseParser, portUrl, sliceLines } from './wire.js';
export type { SandboxInfo } from './wire.js';

/** Where the sandboxes are and what they are like. */
export type HarnessSandboxSettings = {
  /** `harness serve`'s URL, e.g. `http://127.0.0.1:8787`. */
  url: string;
  /** A bearer token the server grants (`--token TOKEN=host`, or a client token scoped to the session). */
  token?: string;
  /** `local`, `docker`, … (what the server offers). */
  provider?: string;
  /** The image (Docker). */
  image?: string;
  /** Ports reachable through the server; the Claude Code harness uses the first for its bridge. */
  ports?: number[];
  /** The default working directory (containers). */
  workdir?: string;
  /** Variables for every command. */
  env?: Record<string, string>;
  /** CPU limit, in cores. */
  cpus?: number;
  /** Memory limit, in MiB. */
  memory?: number;
  /** The network policy at create (change it later with `setNetworkPolicy`). */
  networkPolicy?: HarnessV1NetworkPolicy;
  /** Headers the server adds to matching requests on their way out (keys stay on the host). */
  requestTransformations?: RequestTransformation[];
  /** Shell commands run once after a fresh create, before the first-create hook (part of its snapshot). */
  bootstrapPreCommands?: string[];
  /** Wrap mode: use this existing sandbox of the server (by name); the caller owns it. */
  sandbox?: string;
  /** Wrap mode: the ports the agent may lease for its bridges. */
  bridgePorts?: number[];
  /** A fetch to use instead of the global one. */
  fetch?: Fetch;
};

type CreateOptions = {
  sessionId?: string;
  abortSignal?: AbortSignal;
  identity?: string;
  onFirstCreate?: (session: SandboxSession, opts: { abortSignal?: AbortSignal }) => Promise<void>;
};

/** The provider object `HarnessAgent({ sandbox })` takes. */
export class HarnessSandboxProvider implements HarnessV1SandboxProvider {
  readonly specificationVersion = 'harness-sandbox-v1' as const;
  readonly providerId: string;
  readonly bridgePorts?: ReadonlyArray<number>;
  private readonly api: Api;
  private readonly settings: HarnessSandboxSettings;

  constructor(settings: HarnessSandboxSettings) {
    this.settings = settings;
    this.api = new Api(settings.url, settings.token, settings.fetch);
    this.providerId = `harness-serve:${settings.sandbox ? 'wrap' : (settings.provider ?? 'docker')}`;
    if (settings.sandbox && settings.bridgePorts) this.bridgePorts = settings.bridgePorts;
  }

  readonly createSession = async (options: CreateOptions = {}): Promise<HarnessNetworkSandboxSession> => {
    options.abortSignal?.throwIfAborted();
    if (this.settings.sandbox) {
      // Wrap mode: the caller's sandbox, its lifecycle the caller's; the
      // agent applies its own recipe idempotently.
      const info = await this.api.json<SandboxInfo>(
        'POST',
        `/v1/sandboxes/${encodeURIComponent(this.settings.sandbox)}/resume`,
        undefined,
        options.abortSignal,
      );
      return new HarnessNetworkSandboxSession(this.api, info, false);
    }
    const s = this.settings;
    const info = await this.api.json<SandboxInfo>(
      'POST',
      '/v1/sandboxes',
      {
        provider: s.provider ?? 'docker',
        sessionId: options.sessionId,
        identity: options.identity,
        image: s.image,
        workdir: s.workdir,
        env: s.env,
        cpus: s.cpus,
        memory: s.memory,
        ports: s.ports,
        networkPolicy: s.networkPolicy,
        requestTransformations: s.requestTransformations,
        bootstrapPreCommands: s.bootstrapPreCommands,
      },
      options.abortSignal,
    );
    const session = new HarnessNetworkSandboxSession(this.api, info);
    // The server says whether the first-create hook must run: `required`
    // (the identity's first sandbox; report back so it is snapshotted
    // once), `none` (no identity: run it on every fresh create),
    // `snapshot` (made from the identity's snapshot: already done).
    if (info.bootstrap === 'required' || (info.bootstrap === 'none' && options.onFirstCreate)) {
      try {
        await options.onFirstCreate?.(session.restricted(), { abortSignal: options.abortSignal });
      } catch (error) {
        if (info.bootstrap === 'required') {
          await this.report(info.name, false).catch(() => {});
        }
        await session.destroy().catch(() => {});
        throw error;
      }
      if (info.bootstrap === 'required') await this.report(info.name, true);
    }
    return session;
  };

  readonly resumeSession = async (options: { sessionId: string; abortSignal?: AbortSignal }): Promise<HarnessNetworkSandboxSession> => {
    const info = await this.api.json<SandboxInfo>(
      'POST',
      `/v1/sandboxes/${encodeURIComponent(options.sessionId)}/resume`,
      undefined,
      options.abortSignal,
    );
    return new HarnessNetworkSandboxSession(this.api, info);
  };

  private async report(name: string, ok: boolean): Promise<void> {
    await this.api.json('POST', `/v1/sandboxes/${encodeURIComponent(name)}/bootstrap`, { ok });
  }
}

/**
 * A sandbox provider for `HarnessAgent` over `harness serve`:
 *
 * ```ts
 * const agent = new HarnessAgent({
 *   harness: claudeCode,
 *   sandbox: createHarnessSandbox({ url: 'http://127.0.0.1:8787', token, provider: 'docker', ports: [4000] }),
 * });
 * ```
 */
export function createHarnessSandbox(settings: HarnessSandboxSettings): HarnessSandboxProvider {
  if (!settings?.url) throw new HarnessSandboxError(0, 'invalid', 'createHarnessSandbox needs the server url');
  return new HarnessSandboxProvider(settings);
}
