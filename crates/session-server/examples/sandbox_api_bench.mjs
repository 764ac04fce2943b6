// The Node half of `cargo xtask bench sandbox-api`: the same calls as the
// Rust half, through `harness serve`'s sandbox API with the npm package
// (packages/ai-sdk). Prints `RESULT <json>` (milliseconds, MiB/s).
//
//   node sandbox_api_bench.mjs '{"url":…,"provider":"docker","image":…,"n":30,"mib":64}'

import { createHarnessSandbox } from './dist/index.js';

const args = JSON.parse(process.argv[2]);
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const ms = () => Number(process.hrtime.bigint()) / 1e6;

const provider = createHarnessSandbox({ url: args.url, provider: args.provider, image: args.image, ports: [4000] });
// Warm this process (fetch's first use, the JIT) on a sandbox of its own:
// the Rust half runs warm too.
{
  const warm = await provider.createSession({ sessionId: `warm-${args.provider}-${process.pid}` });
  for (let i = 0; i < 3; i++) await warm.run({ command: 'true' });
  await warm.writeBinaryFile({ path: 'warm.bin', content: new Uint8Array(1 << 20) });
  await warm.readBinaryFile({ path: 'warm.bin' });
  await warm.destroy();
}
let t = ms();
const session = await provider.createSession({ sessionId: `bench-${args.provider}-${process.pid}` });
const first = await session.run({ command: 'true' });
const firstCommandMs = ms() - t;
if (first.exitCode !== 0) throw new Error('true failed');

const exec = [];
for (let i = 0; i < args.n; i++) {
  t = ms();
  const r = await session.run({ command: 'true' });
  exec.push(ms() - t);
  if (r.exitCode !== 0) throw new Error('true failed');
}

const size = args.mib * 1024 * 1024;
const bytes = new Uint8Array(size);
for (let i = 0; i < size; i += 4096) bytes[i] = i & 0xff;
const path = `${session.defaultWorkingDirectory}/bench.bin`;
t = ms();
await session.writeBinaryFile({ path, content: bytes });
const writeMs = ms() - t;
t = ms();
const stream = await session.readFile({ path });
let read = 0;
for await (const chunk of stream) read += chunk.length;
const readMs = ms() - t;
if (read !== size) throw new Error(`read ${read} of ${size}`);
await session.destroy();

console.log(
  `RESULT ${JSON.stringify({
    firstCommandMs,
    execMedianMs: median(exec),
    writeMibS: args.mib / (writeMs / 1000),
    readMibS: args.mib / (readMs / 1000),
  })}`,
);
