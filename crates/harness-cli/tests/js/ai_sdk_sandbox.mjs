// The AI SDK's real HarnessAgent (@ai-sdk/harness) with the real Claude
// Code harness (@ai-sdk/harness-claude-code) in sandboxes of `harness
// serve`, through this repository's package (packages/ai-sdk). Run by
// crates/harness-cli/tests/ai_sdk_sandbox.rs from the package's build
// directory (its node_modules), on Node 22:
//
//   node ai_sdk_sandbox.mjs <scenario> '<json args>'
//
// Each scenario prints `RESULT <json>` last; the Rust test asserts on it.
// Any failure throws (exit 1).

import { appendFileSync, readFileSync, writeFileSync } from 'node:fs';
import { setTimeout as sleep } from 'node:timers/promises';
import { HarnessAgent } from '@ai-sdk/harness/agent';
import { createClaudeCode } from '@ai-sdk/harness-claude-code';
import { createHarnessSandbox } from './dist/index.js';

const [scenario, rawArgs] = process.argv.slice(2);
const args = JSON.parse(rawArgs ?? '{}');
const out = {};
// The step a scenario is at, said on stderr as it goes: a scenario that
// ends without its RESULT (Node exits 13 when every awaited promise has
// lost its last handle) says where it stood.
const started = Date.now();
let at = 'start';
function step(name) {
  at = name;
  console.error(`step ${name} (+${Date.now() - started} ms)`);
}
process.on('exit', (code) => {
  if (code !== 0) console.error(`ended with ${code} at step ${at}`);
});
// The AI SDK's waits (between attempts to open the bridge's WebSocket, its
// open and hello timeouts) are unref'd timers: they keep no process alive,
// leaving that to the application around them. This script is that
// application, so it holds the event loop open while its scenario runs.
// Without it, a first attempt that failed (the bridge busy with the last
// process's detach, more often on a loaded CI machine) ended Node with 13
// in the middle of the retry's wait, at step attach.
const alive = setInterval(() => {}, 60_000);

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

/** The provider the agent scenarios use: the key only as a request transformation. */
function provider(extra = {}) {
  return createHarnessSandbox({
    url: args.url,
    token: args.token,
    provider: args.provider,
    image: args.image,
    ports: [args.port],
    env: { CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC: '1', DISABLE_TELEMETRY: '1' },
    requestTransformations: [
      {
        match: { host: args.modelHost, headers: [{ key: { exact: 'x-api-key' }, value: { exact: args.placeholder } }] },
        transform: { headers: { 'x-api-key': args.realKey } },
      },
    ],
    ...extra,
  });
}

function agent(sandbox) {
  return new HarnessAgent({
    // The sandbox sees a placeholder; the server's proxy puts the key in.
    harness: createClaudeCode({
      auth: { anthropic: { apiKey: args.placeholder, baseUrl: args.modelUrl } },
      model: 'claude-sonnet-4-5',
      startupTimeoutMs: 120_000,
    }),
    sandbox,
    instructions: 'Be brief.',
  });
}

async function sessionDir(sandboxProvider, session) {
  const sandbox = await sandboxProvider.resumeSession({ sessionId: session.sessionId });
  return { sandbox, dir: `${sandbox.defaultWorkingDirectory}/claude-code-${session.sessionId}` };
}

async function agentScenarios() {
  const sandboxProvider = provider();
  const a = agent(sandboxProvider);
  let t = Date.now();
  const s1 = await a.createSession();
  out.createSessionMs = Date.now() - t;

  // Text generation.
  t = Date.now();
  const r1 = await a.generate({ session: s1, prompt: 'say hello' });
  out.firstTurnMs = Date.now() - t;
  out.text = r1.text;

  // Streaming: the deltas arrive as parts, in order.
  const r2 = await a.stream({ session: s1, prompt: 'stream please' });
  const deltas = [];
  const types = new Set();
  for await (const part of r2.stream) {
    types.add(part.type);
    if (part.type === 'text-delta') deltas.push(part.text);
  }
  out.streamDeltas = deltas;
  out.streamText = await r2.text;
  out.streamTypes = [...types];

  // A bash tool through the bridge: the file it wrote is in the sandbox.
  const r3 = await a.generate({ session: s1, prompt: 'run the tool' });
  out.toolText = r3.text;
  const { sandbox: sb1, dir } = await sessionDir(sandboxProvider, s1);
  out.toolFile = await sb1.readTextFile({ path: `${dir}/tool.txt` });

  // File round trips through the provider: text, bytes, a stream, a missing file, an exit code.
  const bytes = new Uint8Array(256 * 1024).map((_, i) => (i * 7) & 0xff);
  await sb1.writeBinaryFile({ path: `${dir}/deep/blob.bin`, content: bytes });
  const back = await sb1.readBinaryFile({ path: `${dir}/deep/blob.bin` });
  check(back && back.length === bytes.length && back.every((b, i) => b === bytes[i]), 'binary round trip');
  await sb1.writeTextFile({ path: 'notes/hello.txt', content: 'line1\nline2\nline3\n' });
  out.relativeRead = await sb1.readTextFile({ path: `${sb1.defaultWorkingDirectory}/notes/hello.txt`, startLine: 2, endLine: 2 });
  await sb1.writeFile({ path: `${dir}/streamed.txt`, content: new Blob(['streamed ', 'content']).stream() });
  out.streamedRead = await new Response(await sb1.readFile({ path: `${dir}/streamed.txt` })).text();
  out.missing = await sb1.readTextFile({ path: `${dir}/no-such-file` });
  out.exit = await sb1.run({ command: 'echo out; echo err >&2; exit 7' });
  out.agentSeesHostWrite = (await sb1.run({ command: `cat "${dir}/deep/blob.bin" | wc -c` })).stdout.trim();

  // Multi-turn context: the model checks the history holds the first prompt.
  const r4 = await a.generate({ session: s1, prompt: 'what did I ask first' });
  out.recall = r4.text;

  // Distinct sandboxes per session. (Local sandboxes share the host's
  // network: a second bridge at once needs another port.)
  const provider2 = args.port2 ? provider({ ports: [args.port2] }) : sandboxProvider;
  const a2 = args.port2 ? agent(provider2) : a;
  const s2 = await a2.createSession();
  const { sandbox: sb2, dir: dir2 } = await sessionDir(provider2, s2);
  // Where the first session's file is, in the second sandbox (a local
  // sandbox's paths are host paths: the same place relative to its own root).
  const sameSpot = `${sb2.defaultWorkingDirectory}/claude-code-${s1.sessionId}/tool.txt`;
  out.distinct = { id1: sb1.id, id2: sb2.id, other: await sb2.readTextFile({ path: sameSpot }) };
  const r5 = await a2.generate({ session: s2, prompt: 'say hello' });
  out.secondSessionText = r5.text;
  check((await sb2.readTextFile({ path: `${dir2}/tool.txt` })) === null, 'the second session has no tool.txt');

  // Abort: the turn rejects, the session stays usable.
  // `@ai-sdk/harness` 1.0.40 can also throw, outside any promise of ours,
  // "received terminal finish with unclosed step content" from its stream
  // reader when the abort lands inside a step (seen once in a cold CI run,
  // the machine loaded): an uncaught exception that ends Node. That one is
  // noted (the Rust test prints it) and the scenario goes on; anything
  // else uncaught still ends the scenario.
  const onUncaught = (e) => {
    if (String(e?.message ?? e).includes('unclosed step content')) {
      out.upstreamErrorAfterAbort = String(e.message);
      return;
    }
    console.error(e);
    process.exit(1);
  };
  process.on('uncaughtException', onUncaught);
  const ac = new AbortController();
  const slow = a2.generate({ session: s2, prompt: 'slow please', abortSignal: ac.signal });
  setTimeout(() => ac.abort(), 1500);
  out.abort = await Promise.race([
    slow.then(
      () => 'finished',
      (e) => e?.name ?? String(e),
    ),
    sleep(60_000).then(() => 'the aborted generate never settled in 60 s'),
  ]);
  // harness 1.0.40 can end the first turn after an abort with no step at
  // all (the aborted turn's end taken for the new one's, under load): it
  // is noted, and the turn after it must work.
  await sleep(500);
  let r6 = await a2.generate({ session: s2, prompt: 'say hello' });
  out.emptyTurnAfterAbort = r6.steps.length === 0;
  if (out.emptyTurnAfterAbort) r6 = await a2.generate({ session: s2, prompt: 'say hello' });
  out.afterAbort = r6.text;
  process.off('uncaughtException', onUncaught);
  await s2.destroy();
  out.destroyed = await provider2
    .resumeSession({ sessionId: s2.sessionId })
    .then(() => 'still there', (e) => e.code ?? String(e));

  // Park the first session for another process.
  const state = await s1.detach();
  writeFileSync(args.stateFile, JSON.stringify({ sessionId: s1.sessionId, state }));
  out.sessionId = s1.sessionId;
  out.sandboxId = sb1.id;
}

/**
 * The agent under a `custom` policy: the model host (and the registry,
 * for a cold bootstrap) allowed through the proxy, no route of its own;
 * the bridge's port still reaches the host.
 */
async function agentUnderCustom() {
  const sandboxProvider = provider({
    networkPolicy: { mode: 'custom', allowedHosts: ['registry.npmjs.org'], allowedCIDRs: [`${args.gateway}/32`] },
  });
  const a = agent(sandboxProvider);
  const s = await a.createSession();
  out.text = (await a.generate({ session: s, prompt: 'say hello' })).text;
  const sandbox = await sandboxProvider.resumeSession({ sessionId: s.sessionId });
  const [host, port] = args.modelHost.split(':');
  out.direct = (
    await sandbox.run({ command: `timeout 5 bash -c 'exec 3<>/dev/tcp/${host}/${port}' 2>&1 && echo OPEN || echo BLOCKED` })
  ).stdout.trim();
  await s.destroy();
}

async function resumeScenario() {
  const { sessionId, state } = JSON.parse(readFileSync(args.stateFile, 'utf8'));
  const sandboxProvider = provider();
  const a = agent(sandboxProvider);
  // Attach to the bridge the first process left running.
  step('attach');
  const s = await a.createSession({ sessionId, resumeFrom: state });
  step('generate on the attached bridge');
  const r1 = await a.generate({ session: s, prompt: 'what did I ask first' });
  out.attached = r1.text;
  // Stop (processes gone, files kept), then resume again: the bridge is started anew.
  step('stop');
  const stopped = await s.stop();
  step('resume from the stopped state');
  const s2 = await a.createSession({ sessionId, resumeFrom: stopped });
  step('generate on the new bridge');
  const r2 = await a.generate({ session: s2, prompt: 'what did I ask first' });
  out.rerun = r2.text;
  step('read the files');
  const { sandbox, dir } = await sessionDir(sandboxProvider, s2);
  out.toolFileAfterStop = await sandbox.readTextFile({ path: `${dir}/tool.txt` });
  out.secretScan = await scanForKey(sandbox);
  step('destroy');
  await s2.destroy();
}

/**
 * Where the key could be inside the sandbox: processes' env and argv, and
 * files. The scan itself carries the key in two halves (its env) and
 * joins them only in a pipe (`grep -f <(…)`), so it adds no hit of its own.
 */
async function scanForKey(sandbox) {
  const key = args.realKey;
  const half = Math.floor(key.length / 2);
  const env = { KA: key.slice(0, half), KB: key.slice(half) };
  const pattern = `-F -f <(printf '%s%s' "$KA" "$KB")`;
  // A container's /proc is its own; a local sandbox sees the host's, and
  // its processes are those with its HARNESS_SANDBOX_ROOT.
  const mine =
    args.provider === 'local'
      ? `for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -qx "HARNESS_SANDBOX_ROOT=$HARNESS_SANDBOX_ROOT" && echo $p; done`
      : `ls -d /proc/[0-9]*`;
  const procs = await sandbox.run({
    command: `for p in $(${mine}); do cat $p/environ $p/cmdline 2>/dev/null; done | tr '\\0' '\\n' | grep -c ${pattern}; true`,
    env,
  });
  const placeholder = await sandbox.run({
    command: `for p in $(${mine}); do cat $p/environ 2>/dev/null; done | tr '\\0' '\\n' | grep -c -F "$P"; true`,
    env: { P: args.placeholder },
  });
  const roots =
    args.provider === 'local'
      ? `"$HARNESS_SANDBOX_ROOT" /tmp/harness`
      : '/ --exclude-dir=proc --exclude-dir=sys --exclude-dir=opt --exclude-dir=dev';
  const files = await sandbox.run({ command: `grep -r -l ${pattern} ${roots} 2>/dev/null | head -5; true`, env });
  // The check can fail: the key split in two still matches when joined.
  const selfTest = await sandbox.run({
    command: `printf 'x%s%sy' "$KA" "$KB" | grep -c ${pattern}; true`,
    env,
  });
  return {
    procHits: procs.stdout.trim(),
    placeholderInEnv: placeholder.stdout.trim(),
    files: files.stdout.trim(),
    selfTest: selfTest.stdout.trim(),
  };
}

async function configMatrix() {
  const { gateway, allowedPort, refusedPort } = args;
  const base = { url: args.url, token: args.token, provider: 'docker', image: args.image };
  // An HTTP GET from inside the sandbox with Node (the server's tools):
  // through the sandbox's proxy (HTTP_PROXY), or straight to the host.
  const get = (url, direct) =>
    `node -e '
const u = new URL(process.argv[1]);
const p = new URL(process.env.HTTP_PROXY);
const opts = process.argv[2] === "direct"
  ? { host: u.hostname, port: u.port, path: u.pathname }
  : { host: p.hostname, port: p.port, path: u.href, headers: { host: u.host } };
const req = require("http").get({ ...opts, timeout: 5000 }, (r) => {
  let b = ""; r.on("data", (d) => (b += d));
  r.on("end", () => console.log(r.statusCode === 200 ? "OK " + b.trim() : "HTTP " + r.statusCode + " " + b.trim().slice(0, 160)));
});
req.on("error", (e) => console.log("FAIL " + e.code));
req.on("timeout", () => { console.log("FAIL timeout"); req.destroy(); });
' ${url} ${direct ? 'direct' : 'proxy'}`;
  const allowed = `http://${gateway}:${allowedPort}/`;
  const refused = `http://127.0.0.1:${refusedPort}/`;
  const p = createHarnessSandbox({
    ...base,
    workdir: '/srv/work',
    env: { FOO: 'bar baz' },
    cpus: 0.5,
    memory: 256,
    networkPolicy: { mode: 'deny-all' },
  });
  const s = await p.createSession({ sessionId: `cfg-${args.suffix}` });
  const run = async (command) => (await s.run({ command })).stdout.trim();
  out.workdir = { reported: s.defaultWorkingDirectory, pwd: await run('pwd') };
  out.env = await run('echo "$FOO"');
  out.cpu = await run('cat /sys/fs/cgroup/cpu.max 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us');
  out.memory = await run('cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes');
  out.denyAll = { direct: await run(get(allowed, true)), proxied: await run(get(allowed, false)) };
  await s.setNetworkPolicy({ mode: 'custom', allowedCIDRs: [`${gateway}/32`] });
  out.customAtRunTime = {
    allowed: await run(get(allowed, false)),
    refused: await run(get(refused, false)),
    direct: await run(get(allowed, true)),
  };
  await s.setNetworkPolicy({ mode: 'allow-all' });
  out.allowAllAtRunTime = { direct: await run(get(allowed, true)), proxiedLoopback: await run(get(refused, false)) };
  await s.destroy();

  const c = createHarnessSandbox({ ...base, networkPolicy: { mode: 'custom', allowedCIDRs: [`${gateway}/32`] } });
  const s2 = await c.createSession({ sessionId: `cfg-custom-${args.suffix}` });
  const run2 = async (command) => (await s2.run({ command })).stdout.trim();
  out.customAtCreate = {
    allowed: await run2(get(allowed, false)),
    refused: await run2(get(refused, false)),
    direct: await run2(get(allowed, true)),
  };
  await s2.destroy();
}

async function bootstrapOnce() {
  const p = createHarnessSandbox({ url: args.url, token: args.token, provider: args.provider, image: args.image });
  const session = await p.createSession({
    sessionId: args.sessionId,
    identity: args.identity,
    onFirstCreate: async (restricted) => {
      appendFileSync(args.countFile, `${args.sessionId}\n`);
      await restricted.writeTextFile({ path: '/opt/bootstrapped-by.txt', content: args.sessionId });
      // Long enough for the other process's create to arrive meanwhile.
      await sleep(2000);
    },
  });
  out.bootstrap = session.bootstrap;
  out.by = await session.readTextFile({ path: '/opt/bootstrapped-by.txt' });
  await session.destroy();
}

/** Wrap mode: a sandbox the caller made through the API, used as it is. */
async function wrapMode() {
  const p = createHarnessSandbox({ url: args.url, token: args.token, sandbox: args.name, bridgePorts: [4000] });
  out.bridgePorts = p.bridgePorts;
  const s = await p.createSession({ sessionId: 'ignored-in-wrap-mode', identity: 'x', onFirstCreate: async () => {
    out.hookRan = true;
  } });
  out.id = s.id;
  out.run = (await s.run({ command: 'cat mine.txt' })).stdout;
  await s.stop();
  await s.destroy();
  // The caller's sandbox is still there, running.
  out.after = (await s.run({ command: 'echo still-here' })).stdout;
  out.hookRan ??= false;
}

const scenarios = {
  wrap: wrapMode,
  agent: agentScenarios,
  'agent-custom': agentUnderCustom,
  resume: resumeScenario,
  config: configMatrix,
  'bootstrap-once': bootstrapOnce,
};

const run = scenarios[scenario];
if (!run) throw new Error(`unknown scenario ${scenario}`);
await run();
console.log(`RESULT ${JSON.stringify(out)}`);
clearInterval(alive);
// The agent keeps sockets (a detached bridge's) open: end here.
process.exit(0);
