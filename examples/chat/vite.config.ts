// The page talks to `harness serve` through this server (dev and preview):
// `/v1` is proxied to HARNESS_URL, so the page and the API share an origin
// (no CORS) and the token never leaves the page's own requests.
import { fileURLToPath } from 'node:url';
import react from '@vitejs/plugin-react';
import { defineConfig } from 'vite';

const target = process.env.HARNESS_URL ?? 'http://127.0.0.1:8787';

export default defineConfig({
  plugins: [react()],
  resolve: {
    alias: {
      // In your app: `npm install @harness/ai-sdk` and drop this alias.
      '@harness/ai-sdk/chat': fileURLToPath(new URL('../../packages/ai-sdk/src/chat.ts', import.meta.url)),
    },
  },
  server: { proxy: { '/v1': target } },
  preview: { proxy: { '/v1': target } },
});
