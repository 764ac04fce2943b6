// `@harness/ai-sdk/chat`: what `useChat` needs beside its default transport
// to drive a session of `harness serve` (docs/ai-sdk.md, "useChat"). The
// transport itself is the AI SDK's, unchanged:
//
//   const chat = useChat({
//     id: sessionId, resume: true, messages: await loadChat({ api, id: sessionId, headers }),
//     transport: new DefaultChatTransport({ api, headers }),
//     sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
//   });
//   <button onClick={() => { chat.stop(); abortChat({ api, id: sessionId, headers }); }}>Stop</button>
//
// with `api = '<server>/v1/chat'`. Browser-safe: `fetch` only, no Node
// module, no AI SDK import, only erasable TypeScript (Node runs the
// source as it is). Every rule is the server's.

/** Where the chat endpoint is, as given to `DefaultChatTransport`. */
export type ChatEndpoint = {
  /** The transport's `api`: `<harness serve URL>/v1/chat`. */
  api: string;
  /** The chat id: the session id. */
  id: string;
  /** The transport's headers, e.g. `{ Authorization: 'Bearer …' }`. */
  headers?: Record<string, string> | Headers;
  /** A `fetch` to use instead of the global one. */
  fetch?: typeof fetch;
};

/** How an aborted turn ended (`status` is `failed`, `error` `aborted: <reason>`). */
export type ChatTurnEnd = {
  /** The turn aborted, or `null` when none was running. */
  turnId: string | null;
  /** Its status once it ended (`running` if it had not within a minute). */
  status: string;
  /** Its error, e.g. `aborted: stopped in the chat`. */
  error?: string | null;
};

/** A refusal of the server: its HTTP status, code and message. */
export class ChatRequestError extends Error {
  /** The HTTP status. */
  readonly status: number;
  /** The server's error code (`no_active_turn`, `forbidden`, …). */
  readonly code: string;
  constructor(status: number, code: string, message: string) {
    super(message);
    this.name = 'ChatRequestError';
    this.status = status;
    this.code = code;
  }
}

function url(endpoint: ChatEndpoint, tail: string): string {
  return `${endpoint.api.replace(/\/+$/, '')}/${encodeURIComponent(endpoint.id)}/${tail}`;
}

async function refusal(response: Response): Promise<ChatRequestError> {
  let code = 'http_error';
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = (await response.json()) as { error?: { code?: string; message?: string } };
    code = body.error?.code ?? code;
    message = body.error?.message ?? message;
  } catch {
    // Not our JSON: keep the status line.
  }
  return new ChatRequestError(response.status, code, message);
}

/**
 * Stop the session's running turn: the agent is killed and the turn ends
 * `failed` with `aborted: <reason>`. Call it beside `useChat`'s `stop()`,
 * which only drops the connection (the server cannot tell that from a
 * network drop, so it never stops the turn). Resolves once the turn
 * ended, with how; `turnId: null` when no turn was running.
 */
export async function abortChat(
  endpoint: ChatEndpoint & { reason?: string },
): Promise<ChatTurnEnd> {
  const headers = new Headers(endpoint.headers);
  headers.set('content-type', 'application/json');
  const response = await (endpoint.fetch ?? fetch)(url(endpoint, 'abort'), {
    method: 'POST',
    headers,
    body: JSON.stringify(endpoint.reason === undefined ? {} : { reason: endpoint.reason }),
  });
  if (response.status === 409) {
    const error = await refusal(response);
    if (error.code === 'no_active_turn') return { turnId: null, status: 'none' };
    throw error;
  }
  if (!response.ok) throw await refusal(response);
  return (await response.json()) as ChatTurnEnd;
}

/**
 * The session's conversation as the AI SDK's `UIMessage[]`, for
 * `useChat({ messages })` when a page opens a past or running session.
 */
export async function loadChat<M = unknown>(endpoint: ChatEndpoint): Promise<M[]> {
  const response = await (endpoint.fetch ?? fetch)(url(endpoint, 'messages'), {
    headers: new Headers(endpoint.headers),
  });
  if (!response.ok) throw await refusal(response);
  return (await response.json()) as M[];
}
