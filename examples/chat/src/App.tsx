// useChat against a session of `harness serve`, with the AI SDK's own
// default transport: the session is the chat (its id is the chat id), the
// transport's `api` is the server's `/v1/chat`, and the token goes in the
// transport's headers. Beside useChat only two helpers: `loadChat` (the
// session's history, so a reload shows the conversation) and `abortChat`
// (the one line beside `stop()`: stop() only drops the connection, which
// never stops the agent). See docs/ai-sdk.md, "useChat".
import { useChat } from '@ai-sdk/react';
import { abortChat, loadChat, type ChatTurnEnd } from '@harness/ai-sdk/chat';
import {
  DefaultChatTransport,
  lastAssistantMessageIsCompleteWithApprovalResponses,
  type DynamicToolUIPart,
  type UIMessage,
} from 'ai';
import { useEffect, useMemo, useState, type FormEvent } from 'react';

/** What this server keeps beside a turn's assistant message. */
type TurnMetadata = { turnId?: string; status?: string; error?: string };
type Message = UIMessage<TurnMetadata>;

/** Same origin: vite proxies /v1 to harness serve (vite.config.ts). */
const API = `${window.location.origin}/v1/chat`;

/** The session and a token for it, from the address: `#session=…&token=…`. */
function fromHash(): { session: string; token: string } {
  const params = new URLSearchParams(window.location.hash.slice(1));
  return { session: params.get('session') ?? '', token: params.get('token') ?? '' };
}

export function App() {
  const [{ session, token }, setSignIn] = useState(fromHash);
  const [history, setHistory] = useState<Message[] | null>(null);
  const [failure, setFailure] = useState('');
  const headers = useMemo(() => ({ Authorization: `Bearer ${token}` }), [token]);

  useEffect(() => {
    if (!session) return;
    setHistory(null);
    loadChat<Message>({ api: API, id: session, headers })
      .then(setHistory)
      .catch((e: Error) => setFailure(e.message));
  }, [session, headers]);

  if (!session) return <SignIn onDone={(s, t) => { window.location.hash = new URLSearchParams({ session: s, token: t }).toString(); setSignIn({ session: s, token: t }); }} />;
  if (failure) return <p role="alert" id="failure">{failure}</p>;
  if (history === null) return <p id="loading">Loading the conversation…</p>;
  return <Chat session={session} headers={headers} history={history} />;
}

function SignIn({ onDone }: { onDone: (session: string, token: string) => void }) {
  const [session, setSession] = useState('');
  const [token, setToken] = useState('');
  return (
    <form id="signin" onSubmit={(e) => { e.preventDefault(); onDone(session, token); }}>
      <label>Session <input id="session" value={session} onChange={(e) => setSession(e.target.value)} required /></label>
      <label>Token <input id="token" type="password" value={token} onChange={(e) => setToken(e.target.value)} /></label>
      <button type="submit">Open</button>
    </form>
  );
}

function Chat({ session, headers, history }: { session: string; headers: Record<string, string>; history: Message[] }) {
  const transport = useMemo(() => new DefaultChatTransport<Message>({ api: API, headers }), [headers]);
  const { messages, setMessages, sendMessage, addToolApprovalResponse, status, error, stop } = useChat<Message>({
    id: session,
    messages: history,
    transport,
    // A reload mid-turn reattaches to the running turn (GET /v1/chat/{id}/stream).
    resume: true,
    // An approval answered with addToolApprovalResponse is sent at once.
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
  });
  const [input, setInput] = useState('');
  const [stopped, setStopped] = useState<ChatTurnEnd | null>(null);
  const busy = status === 'submitted' || status === 'streaming';

  const send = (e: FormEvent) => {
    e.preventDefault();
    if (!input.trim()) return;
    setStopped(null);
    sendMessage({ text: input });
    setInput('');
  };

  const onStop = async () => {
    stop(); // the browser stops reading…
    const end = await abortChat({ api: API, id: session, headers, reason: 'stopped from the chat' }); // …and the agent stops
    setStopped(end);
    setMessages(await loadChat<Message>({ api: API, id: session, headers }));
  };

  return (
    <main>
      <h1>Session {session}</h1>
      <ol id="messages" role="log">
        {messages.map((m) => (
          <li key={m.id} className={`message ${m.role}`} data-id={m.id}>
            {m.parts.map((part, i) => {
              switch (part.type) {
                case 'text':
                  return <p key={i} className="text">{part.text}</p>;
                case 'reasoning':
                  return <details key={i} className="reasoning"><summary>Thinking</summary>{part.text}</details>;
                case 'dynamic-tool':
                  return <Tool key={i} part={part} answer={(approved) => addToolApprovalResponse({ id: part.approval!.id, approved })} />;
                default:
                  return null;
              }
            })}
            {m.role === 'assistant' && m.metadata?.status && m.metadata.status !== 'running' && (
              <p className={`turn-status ${m.metadata.status}`}>
                {m.metadata.status}{m.metadata.error ? `: ${m.metadata.error}` : ''}
              </p>
            )}
          </li>
        ))}
      </ol>
      <p id="status" aria-live="polite" data-status={status}>
        {status}
        {error && <span className="error"> — {describe(error)}</span>}
        {stopped?.turnId && <span className="stopped"> — turn {stopped.turnId} {stopped.status}: {stopped.error}</span>}
      </p>
      <form id="composer" onSubmit={send}>
        <textarea id="prompt" aria-label="Message" value={input} onChange={(e) => setInput(e.target.value)} />
        <button id="send" type="submit" disabled={busy}>Send</button>
        <button id="stop" type="button" onClick={onStop} disabled={!busy}>Stop</button>
      </form>
    </main>
  );
}

/** The server's message of a refused request (its body is `{"error": {code, message}}`). */
function describe(error: Error): string {
  try {
    return JSON.parse(error.message).error.message ?? error.message;
  } catch {
    return error.message;
  }
}

function Tool({ part, answer }: { part: DynamicToolUIPart; answer: (approved: boolean) => void }) {
  return (
    <div className="tool" data-state={part.state} data-call={part.toolCallId}>
      <strong className="tool-name">{part.toolName}</strong>
      <pre className="input">{JSON.stringify(part.input, null, 2)}</pre>
      {part.state === 'approval-requested' && (
        <span className="approval">
          <button className="approve" onClick={() => answer(true)}>Approve</button>
          <button className="deny" onClick={() => answer(false)}>Deny</button>
        </span>
      )}
      {part.state === 'approval-responded' && <span className="answered">{part.approval.approved ? 'Approved' : 'Denied'}</span>}
      {part.state === 'output-available' && <pre className="output">{typeof part.output === 'string' ? part.output : JSON.stringify(part.output, null, 2)}</pre>}
      {part.state === 'output-error' && <pre className="output error">{part.errorText}</pre>}
    </div>
  );
}
