// The public gRPC API of the gateway through @grpc/grpc-js + @grpc/proto-loader, loading
// proto/dgserve/v1/generation.proto: GenerateStream with canvas steps, the unary Generate of
// the same request, ListModels, and grpc.health.v1 Check on every gRPC port of the cluster.
//   GATEWAY_GRPC=127.0.0.1:P PREFILL0_GRPC=... DENOISE0_GRPC=... MODEL_ID=name node grpc_stream.mjs
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { ROOT, npmRequire, env, check, equal, runSteps } from './lib.mjs';

const grpc = npmRequire('@grpc/grpc-js');
const protoLoader = npmRequire('@grpc/proto-loader');
const MODEL = env('MODEL_ID');
const HERE = path.dirname(fileURLToPath(import.meta.url));
const RPC_TIMEOUT_MS = 60_000;

const loadOptions = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };
const api = grpc.loadPackageDefinition(protoLoader.loadSync('dgserve/v1/generation.proto',
  { ...loadOptions, includeDirs: [path.join(ROOT, 'proto')] }));
const health = grpc.loadPackageDefinition(protoLoader.loadSync('grpc/health/v1/health.proto',
  { ...loadOptions, includeDirs: [path.join(ROOT, 'proto')] }));

const client = new api.dgserve.v1.GenerationService(env('GATEWAY_GRPC'), grpc.credentials.createInsecure());
const deadline = () => new Date(Date.now() + RPC_TIMEOUT_MS);

const MAX_TOKENS = 24;
const request = {
  model: MODEL,
  chat: { messages: [{ role: 'user', content: 'Tell me a short story about a robot.' }] },
  max_tokens: MAX_TOKENS,
  seed: 7,
  stream_options: { canvas_step_interval: 1, canvas_text: true },
};

function unary(c, method, req) {
  return new Promise((resolve, reject) => {
    c[method](req, { deadline: deadline() }, (err, resp) => (err ? reject(err) : resolve(resp)));
  });
}

function streamEvents(req) {
  return new Promise((resolve, reject) => {
    const events = [];
    const call = client.GenerateStream(req, { deadline: deadline() });
    call.on('data', (ev) => events.push(ev));
    call.on('error', reject);
    call.on('end', () => resolve(events));
  });
}

let streamed;  // {text, ids, finished} from GenerateStream

await runSteps('grpc_stream', [
  ['GenerateStream with canvas steps', async () => {
    const events = await streamEvents(request);
    const kinds = events.map((e) => e.event);
    check(events.length > 0, 'the stream has events');
    const steps = events.filter((e) => e.event === 'canvas_step').map((e) => e.canvas_step);
    const blocks = events.filter((e) => e.event === 'block').map((e) => e.block);
    const finished = events.filter((e) => e.event === 'finished').map((e) => e.finished);
    check(steps.length >= 1, 'at least one canvas_step event', kinds);
    check(blocks.length >= 1, 'at least one block event', kinds);
    equal(finished.length, 1, 'number of finished events');
    equal(events[events.length - 1].event, 'finished', 'the last event');
    const ids = new Set(events.map((e) => e.request_id));
    check(ids.size === 1 && !ids.has(''), 'every event carries the same non-empty request_id', [...ids]);
    for (const st of steps) {
      check(st.token_ids.length > 0, 'canvas_step.token_ids is not empty', st);
      check(typeof st.text === 'string', 'canvas_step.text is set (canvas_text: true)', st);
    }
    const f = finished[0];
    check(['stop', 'length'].includes(f.finish_reason), 'finish_reason in {stop, length}', f.finish_reason);
    check(f.usage && f.usage.completion_tokens > 0 && f.usage.completion_tokens <= MAX_TOKENS,
          `0 < usage.completion_tokens <= ${MAX_TOKENS}`, f.usage);
    const blockIds = blocks.flatMap((b) => b.token_ids);
    equal(blockIds.length, f.usage.completion_tokens, 'block token ids in all = usage.completion_tokens');
    streamed = { text: blocks.map((b) => b.text).join(''), ids: blockIds, finished: f };
    console.log(`    ${steps.length} canvas steps, ${blocks.length} blocks, ${f.usage.completion_tokens} tokens (${f.finish_reason}): ${JSON.stringify(streamed.text)}`);
  }],
  ['unary Generate of the same request = the stream', async () => {
    check(streamed, 'needs the GenerateStream result');
    const r = await unary(client, 'Generate', request);
    equal(r.text, streamed.text, 'Generate text = concatenated block texts of GenerateStream');
    equal(JSON.stringify(r.token_ids), JSON.stringify(streamed.ids), 'Generate token_ids = concatenated block token ids');
    equal(r.finish_reason, streamed.finished.finish_reason, 'finish_reason');
    equal(r.usage.completion_tokens, streamed.finished.usage.completion_tokens, 'usage.completion_tokens');
  }],
  ['ListModels', async () => {
    const r = await unary(client, 'ListModels', {});
    const ids = r.models.map((m) => m.id);
    check(ids.includes(MODEL), `ListModels has ${JSON.stringify(MODEL)}`, ids);
  }],
  ['grpc.health.v1 Check on every gRPC port', async () => {
    for (const name of ['GATEWAY_GRPC', 'PREFILL0_GRPC', 'DENOISE0_GRPC']) {
      const h = new health.grpc.health.v1.Health(env(name), grpc.credentials.createInsecure());
      try {
        const r = await unary(h, 'Check', { service: '' });
        equal(r.status, 'SERVING', `health of ${name} (${env(name)})`);
      } finally {
        h.close();
      }
    }
  }],
]);
client.close();
