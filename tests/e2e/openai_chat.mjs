// The OpenAI HTTP API of the gateway through the real `openai` client (third_party/npm):
// chat completion, the same request streamed (SSE), /v1/models, /v1/completions, the dgserve
// extension fields, and a 400 for an unsupported field.
//   GATEWAY_HTTP=127.0.0.1:P MODEL_ID=name node tests/e2e/openai_chat.mjs
import { npmRequire, env, check, equal, runSteps } from './lib.mjs';

const { OpenAI, APIError } = npmRequire('openai');
const MODEL = env('MODEL_ID');
const client = new OpenAI({
  baseURL: `http://${env('GATEWAY_HTTP')}/v1`,
  apiKey: 'unused',
  maxRetries: 0,
  timeout: 60_000,
});

const MAX_TOKENS = 24;
const base = {
  model: MODEL,
  messages: [
    { role: 'system', content: 'You are a terse assistant.' },
    { role: 'user', content: 'Write one sentence about diffusion language models.' },
  ],
  max_tokens: MAX_TOKENS,
  seed: 1234,
};

function checkUsage(usage, what) {
  check(usage && typeof usage === 'object', `${what}: usage object present`, usage);
  check(Number.isInteger(usage.completion_tokens) && usage.completion_tokens > 0 &&
        usage.completion_tokens <= MAX_TOKENS,
        `${what}: 0 < usage.completion_tokens <= max_tokens (${MAX_TOKENS})`, usage);
  check(Number.isInteger(usage.prompt_tokens) && usage.prompt_tokens > 0,
        `${what}: usage.prompt_tokens > 0`, usage);
  equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens,
        `${what}: usage.total_tokens = prompt_tokens + completion_tokens`);
}

// Streams `params` and returns what a client sees: the chunks, content deltas and finish reasons.
async function collectStream(params) {
  const stream = await client.chat.completions.create({ ...params, stream: true });
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  const deltas = [];
  const finishes = [];  // [chunk index, reason]
  let lastWithChoices = -1;
  chunks.forEach((c, i) => {
    check(Array.isArray(c.choices), 'every chunk has a choices array', c);
    if (c.choices.length > 0) lastWithChoices = i;
    for (const ch of c.choices) {
      equal(ch.index, 0, 'chunk choice index');
      const content = ch.delta?.content;
      if (typeof content === 'string' && content.length > 0) deltas.push(content);
      if (ch.finish_reason != null) finishes.push([i, ch.finish_reason]);
    }
    equal(c.object, 'chat.completion.chunk', 'chunk object');
  });
  return { chunks, deltas, finishes, lastWithChoices, text: deltas.join('') };
}

let reference;  // the non-streaming completion of `base`
// Prompt tokens served from the gateway's prefix cache: printed so that a text mismatch between
// two runs of the same seeded request can be told apart as cache-dependent.
const cached = (usage) => usage?.prompt_tokens_details?.cached_tokens;

await runSteps('openai_chat', [
  ['chat completion (non-streaming)', async () => {
    const r = await client.chat.completions.create(base);
    reference = r;
    equal(r.object, 'chat.completion', 'object');
    equal(r.model, MODEL, 'model');
    check(typeof r.id === 'string' && r.id.length > 0, 'id is a non-empty string', r.id);
    equal(r.choices.length, 1, 'number of choices');
    const c = r.choices[0];
    equal(c.message.role, 'assistant', 'choices[0].message.role');
    check(typeof c.message.content === 'string', 'choices[0].message.content is a string', c.message);
    check(['stop', 'length'].includes(c.finish_reason), 'finish_reason in {stop, length}', c.finish_reason);
    checkUsage(r.usage, 'chat completion');
    console.log(`    text (${r.usage.completion_tokens} tokens, ${c.finish_reason}, ${cached(r.usage)} cached prompt tokens): ${JSON.stringify(c.message.content)}`);
  }],
  ['same request again gives the same text (seeded)', async () => {
    check(reference, 'needs the non-streaming completion');
    const r = await client.chat.completions.create(base);
    equal(r.choices[0].message.content, reference.choices[0].message.content,
          `text of the repeated request (cached prompt tokens: first ${cached(reference.usage)}, repeat ${cached(r.usage)})`);
  }],
  ['chat completion (stream: true) matches the non-streaming one', async () => {
    check(reference, 'needs the non-streaming completion');
    const s = await collectStream({ ...base, stream_options: { include_usage: true } });
    check(s.deltas.length >= 1, 'at least one content delta', s.chunks);
    equal(s.finishes.length, 1, 'number of chunks with a finish_reason');
    equal(s.finishes[0][0], s.lastWithChoices, 'the finish_reason chunk is the last chunk with choices');
    equal(s.finishes[0][1], reference.choices[0].finish_reason, 'streamed finish_reason');
    const usageChunks = s.chunks.filter((c) => c.usage);
    equal(s.text, reference.choices[0].message.content,
          `concatenated stream deltas = non-streaming text (cached prompt tokens: non-streaming ${cached(reference.usage)}, streaming ${cached(usageChunks[0]?.usage)})`);
    equal(usageChunks.length, 1, 'number of usage chunks (include_usage)');
    equal(usageChunks[0].choices.length, 0, 'the usage chunk has no choices');
    equal(usageChunks[0].usage.completion_tokens, reference.usage.completion_tokens, 'streamed usage.completion_tokens');
  }],
  ['stream with canvas steps (dgserve extension fields)', async () => {
    check(reference, 'needs the non-streaming completion');
    const s = await collectStream({ ...base, canvas_step_interval: 1, canvas_text: true });
    const steps = s.chunks.filter((c) => c.dgserve?.canvas_step).map((c) => c.dgserve.canvas_step);
    check(steps.length >= 1, 'at least one chunk with dgserve.canvas_step', s.chunks.slice(0, 3));
    for (const st of steps) {
      check(Number.isInteger(st.canvas) && Number.isInteger(st.step) && Array.isArray(st.token_ids) &&
            typeof st.text === 'string', 'canvas_step has canvas, step, token_ids and text', st);
    }
    equal(s.finishes.length, 1, 'number of chunks with a finish_reason');
    equal(s.finishes[0][0], s.lastWithChoices, 'the finish_reason chunk is the last chunk');
    equal(s.text, reference.choices[0].message.content, 'text with canvas steps = text without');
  }],
  ['max_denoising_steps caps the decoder passes', async () => {
    const r = await client.chat.completions.create({ ...base, max_denoising_steps: 2 });
    const d = r.usage?.dgserve;
    check(d && Number.isInteger(d.canvases) && d.canvases > 0, 'usage.dgserve.canvases > 0', r.usage);
    check(d.denoising_steps >= d.canvases && d.denoising_steps <= 2 * d.canvases,
          'canvases <= usage.dgserve.denoising_steps <= 2 * canvases', d);
  }],
  ['models.list() has the served model', async () => {
    const ids = [];
    for await (const m of client.models.list()) ids.push(m.id);
    check(ids.includes(MODEL), `models.list() contains ${JSON.stringify(MODEL)}`, ids);
    const m = await client.models.retrieve(MODEL);
    equal(m.id, MODEL, 'models.retrieve(model).id');
  }],
  ['completions (legacy /v1/completions)', async () => {
    const r = await client.completions.create({ model: MODEL, prompt: 'The cat', max_tokens: 8, seed: 3 });
    equal(r.object, 'text_completion', 'object');
    check(typeof r.choices?.[0]?.text === 'string', 'choices[0].text is a string', r.choices);
    check(['stop', 'length'].includes(r.choices[0].finish_reason), 'finish_reason in {stop, length}', r.choices[0]);
    check(r.usage.completion_tokens <= 8, 'usage.completion_tokens <= 8', r.usage);
  }],
  ['unsupported field logprobs: true -> 400 naming the field', async () => {
    let err;
    try {
      await client.chat.completions.create({ ...base, logprobs: true });
    } catch (e) {
      err = e;
    }
    check(err !== undefined, 'the request with logprobs: true throws');
    check(err instanceof APIError, 'throws an openai APIError', String(err));
    equal(err.status, 400, 'APIError.status');
    check(/logprobs/.test(err.message), 'the error message names the field "logprobs"', err.message);
  }],
  ['unknown model -> 404 APIError', async () => {
    let err;
    try {
      await client.chat.completions.create({ ...base, model: `${MODEL}-does-not-exist` });
    } catch (e) {
      err = e;
    }
    check(err instanceof APIError, 'throws an openai APIError', String(err));
    equal(err.status, 404, 'APIError.status');
  }],
]);
