// The dgserve Grafana dashboard, typed with @grafana/schema (third_party/npm).
//
// `tsc --noEmit -p deploy/grafana` type-checks it; `node deploy/grafana/build.mjs` writes
// deploy/grafana/dashboard.json from it (the committed JSON must match: see
// deploy/checks/obs_static.sh). README.md describes every row and the metrics each panel reads.
//
// Every query is filtered by the `job` and `instance` template variables, and goes to the
// Prometheus data source picked by the `datasource` variable. The query and panel builders and
// the row layout are in lib.ts.
import {
  type AnnotationQuery,
  type Dashboard,
  type VariableModel,
  DashboardCursorSync,
  VariableHide,
  VariableRefresh,
  VariableSort,
} from '@grafana/schema';
import {
  DS,
  sel,
  rate,
  quantile,
  mean,
  type Q,
  thresholds,
  timeseries,
  stat,
  heatmap,
  rightAxis,
  type Sized,
  layout,
  GW,
  PF,
  DN,
} from './lib';

/** non-OK / all, over the rate interval, for one `*_requests_total{status}` counter: 0 (not
 *  "no data") while there is traffic but no non-OK status series yet. */
const errorRatio = (counter: string): string =>
  `(sum(${rate(counter, 'status!="OK"')}) or vector(0)) / sum(${rate(counter)})`;

const requests: Sized[] = [
  {
    w: 8,
    panel: timeseries({
      title: 'Requests by status',
      description:
        'Generation requests per second finished by the gateway, by final status (gRPC code name: OK, INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, ...), and the samples (choices) per second they completed: a request with n = 3 completes 3.',
      unit: 'reqps',
      queries: [
        { expr: `sum by (status) (${rate(`${GW}_requests_total`)})`, legend: '{{status}}' },
        { expr: `sum(${rate(`${GW}_samples_total`)})`, legend: 'samples (n per request)' },
      ],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'Error ratio (non-OK / all)',
      description:
        'Share of requests that did not finish OK, at the gateway and on each worker role. The dashed line is the DgserveHighErrorRate alert threshold (5 %, over 5 m).',
      unit: 'percentunit',
      min: 0,
      redAbove: 0.05,
      queries: [
        { expr: errorRatio(`${GW}_requests_total`), legend: 'gateway' },
        { expr: errorRatio(`${PF}_requests_total`), legend: 'prefill workers' },
        { expr: errorRatio(`${DN}_requests_total`), legend: 'denoise workers' },
      ],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'HTTP requests by route and code',
      description: 'OpenAI-compatible HTTP front end: requests per second by route and HTTP status code.',
      unit: 'reqps',
      queries: [
        { expr: `sum by (route, code) (${rate(`${GW}_http_requests_total`)})`, legend: '{{route}} {{code}}' },
      ],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'In-flight requests and retries',
      description:
        'Requests admitted by the gateway and not finished (left axis), and attempts repeated on another worker after UNAVAILABLE (right axis, per second).',
      queries: [
        { expr: `sum(${sel(`${GW}_inflight_requests`)})`, legend: 'in flight' },
        { expr: `sum(${rate(`${GW}_retries_total`)})`, legend: 'retries/s' },
      ],
      overrides: rightAxis('retries/s', 'reqps'),
    }),
  },
  {
    w: 8,
    panel: stat({
      title: 'Workers seen by the gateway',
      description:
        'Prefill and denoise workers the gateway knows, by role and health state. Any unhealthy worker is red; DgserveWorkerUnhealthy fires after 2 m.',
      queries: [
        { expr: `sum by (role) (${sel(`${GW}_workers`, 'state="healthy"')})`, legend: '{{role}} healthy' },
        { expr: `sum by (role) (${sel(`${GW}_workers`, 'state="unhealthy"')})`, legend: '{{role}} unhealthy' },
      ],
      overrides: [
        {
          matcher: { id: 'byRegexp', options: '.*unhealthy' },
          properties: [{ id: 'thresholds', value: thresholds(1) }],
        },
      ],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'HTTP latency p95 by route',
      description: '95th percentile of the HTTP handling time per route (streaming responses count until the last event).',
      unit: 's',
      queries: [{ expr: quantile(0.95, `${GW}_http_request_duration_seconds`, ['route']), legend: '{{route}}' }],
    }),
  },
];

const frontEnd: Sized[] = [
  {
    w: 6,
    panel: timeseries({
      title: 'HTTP connections and SSE streams',
      description:
        'Open HTTP connections of the gateway (idle keep-alive ones included) and the SSE streams being written, per gateway.',
      min: 0,
      queries: [
        { expr: `sum by (instance) (${sel(`${GW}_http_open_connections`)})`, legend: 'connections {{instance}}' },
        { expr: `sum by (instance) (${sel(`${GW}_http_open_streams`)})`, legend: 'streams {{instance}}' },
      ],
    }),
  },
  {
    w: 6,
    panel: timeseries({
      title: 'Requests waiting for admission',
      description:
        'Requests in the gateway\'s admission queue (--max_queued_requests; always 0 when it is 0), next to those admitted (--max_concurrent_requests bounds them). Beyond both, requests get 429 / RESOURCE_EXHAUSTED at once.',
      min: 0,
      queries: [
        { expr: `sum(${sel(`${GW}_queued_requests`)})`, legend: 'queued' },
        { expr: `sum(${sel(`${GW}_inflight_requests`)})`, legend: 'in flight' },
      ],
    }),
  },
  {
    w: 6,
    panel: timeseries({
      title: 'Admission wait p50 / p95',
      description: 'Time a request waited in the admission queue before it ran (requests admitted at once count as ~0).',
      unit: 's',
      min: 0,
      queries: [0.5, 0.95].map((q) => ({
        expr: quantile(q, `${GW}_queue_duration_seconds`),
        legend: `p${Math.round(q * 100)}`,
      })),
    }),
  },
  {
    w: 6,
    panel: timeseries({
      title: 'Resumes after a denoise worker failure',
      description:
        'Requests per second continued from their next canvas on other workers after their denoise worker failed mid-request.',
      unit: 'reqps',
      min: 0,
      queries: [{ expr: `sum(${rate(`${GW}_resumes_total`)})`, legend: 'resumes/s' }],
    }),
  },
];

const ttftStages = (q: number): Q[] => [
  { expr: quantile(q, `${GW}_prefill_duration_seconds`), legend: 'prefill + KV transfer' },
  { expr: quantile(q, `${GW}_time_to_first_step_seconds`), legend: 'first canvas step' },
  { expr: quantile(q, `${GW}_time_to_first_block_seconds`), legend: 'first committed block (TTFT)' },
];

const ttft: Sized[] = [
  {
    w: 12,
    panel: timeseries({
      title: 'Time to first token, by stage (p50)',
      description:
        'Median time from request start to: the end of prefill and its KV transfer; the first denoising step of the first canvas; the first committed block (the first tokens a client can see). The stages are cumulative.',
      unit: 's',
      min: 0,
      queries: ttftStages(0.5),
    }),
  },
  {
    w: 12,
    panel: timeseries({
      title: 'Time to first token, by stage (p95)',
      description:
        '95th percentile of the same three stages. The dashed line is the DgserveSlowTimeToFirstBlock objective (p95 of the first committed block over 5 m above 10 s).',
      unit: 's',
      min: 0,
      redAbove: 10,
      queries: ttftStages(0.95),
    }),
  },
  {
    w: 12,
    panel: timeseries({
      title: 'Request latency (end to end)',
      description: 'Percentiles of the whole request at the gateway, from arrival to the last token.',
      unit: 's',
      min: 0,
      queries: [0.5, 0.95, 0.99].map((q) => ({
        expr: quantile(q, `${GW}_request_duration_seconds`),
        legend: `p${Math.round(q * 100)}`,
      })),
    }),
  },
  {
    w: 12,
    panel: timeseries({
      title: 'Worker-side waits (p95)',
      description:
        'Where the TTFT goes on the workers: queue + encoder time of a prompt and one encoder step on the prefill workers; on the denoise workers, arrival to complete prompt KV and arrival to the first canvas step.',
      unit: 's',
      min: 0,
      queries: [
        { expr: quantile(0.95, `${PF}_duration_seconds`), legend: 'prefill: prompt (queue + encoder)' },
        { expr: quantile(0.95, `${PF}_step_duration_seconds`), legend: 'prefill: encoder step' },
        { expr: quantile(0.95, `${DN}_kv_wait_seconds`), legend: 'denoise: wait for prompt KV' },
        { expr: quantile(0.95, `${DN}_time_to_first_step_seconds`), legend: 'denoise: first canvas step' },
      ],
    }),
  },
];

const denoising: Sized[] = [
  {
    w: 12,
    panel: heatmap({
      title: 'Steps per canvas',
      description:
        'Distribution of denoising steps (decoder passes) a canvas needed before commit, on the denoise workers: canvases per bucket per interval. Fewer steps = the entropy bound accepts more tokens per step.',
      queries: [
        {
          expr: `sum by (le) (increase(${sel(`${DN}_steps_per_canvas_bucket`)}[$__rate_interval]))`,
          legend: '{{le}}',
          format: 'heatmap',
        },
      ],
    }),
  },
  {
    w: 12,
    panel: timeseries({
      title: 'Canvas latency',
      description: 'Wall time of one canvas on a denoise worker, from its first step to its commit.',
      unit: 's',
      min: 0,
      queries: [0.5, 0.95, 0.99].map((q) => ({
        expr: quantile(q, `${DN}_canvas_duration_seconds`),
        legend: `p${Math.round(q * 100)}`,
      })),
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'Output tokens/s',
      description:
        'Committed canvas tokens per second on each denoise worker (whole canvases, before stop handling), and completion tokens the gateway returned to clients.',
      unit: 'short',
      min: 0,
      queries: [
        { expr: `sum by (instance) (${rate(`${DN}_output_tokens_total`)})`, legend: 'committed {{instance}}' },
        { expr: `sum(${rate(`${GW}_completion_tokens_total`)})`, legend: 'returned to clients' },
      ],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'Active canvases',
      description:
        'Canvases in the running batch of each denoise worker (left axis), and the mean number of canvases per batched decoder pass (right axis).',
      min: 0,
      queries: [
        { expr: `sum by (instance) (${sel(`${DN}_active_canvases`)})`, legend: '{{instance}}' },
        { expr: mean(`${DN}_batch_canvases`), legend: 'mean batch' },
      ],
      overrides: rightAxis('mean batch', 'short'),
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'Denoising step and commit time (p95)',
      description: 'One batched denoising step (decoder pass) and one batched commit (encoder pass) on the denoise workers.',
      unit: 's',
      min: 0,
      queries: [
        { expr: quantile(0.95, `${DN}_step_duration_seconds`), legend: 'step' },
        { expr: quantile(0.95, `${DN}_commit_duration_seconds`), legend: 'commit' },
      ],
    }),
  },
  {
    w: 12,
    panel: timeseries({
      title: 'Tokens accepted per step and steps per canvas (mean)',
      description:
        'Mean canvas positions the entropy bound accepted per step, and mean decoder passes per committed canvas (decoder passes / canvases).',
      min: 0,
      queries: [
        { expr: mean(`${DN}_accepted_tokens_per_step`), legend: 'accepted tokens per step' },
        {
          expr: `sum(${rate(`${DN}_decoder_passes_total`)}) / sum(${rate(`${DN}_canvases_total`)})`,
          legend: 'steps per canvas',
        },
      ],
    }),
  },
  {
    w: 12,
    panel: timeseries({
      title: 'Commit entropy (nats)',
      description: 'Mean per-position entropy of the last step of a canvas (p50 and p95 across canvases).',
      min: 0,
      queries: [0.5, 0.95].map((q) => ({
        expr: quantile(q, `${DN}_commit_mean_entropy_nats`),
        legend: `p${Math.round(q * 100)}`,
      })),
    }),
  },
];

const queues: Sized[] = [
  {
    w: 12,
    panel: timeseries({
      title: 'Queue depth',
      description:
        'Prompts queued or running on each prefill worker; requests waiting for their prompt KV or a batch slot on each denoise worker; of those, prompts and samples held back because the device K/V memory would not hold them beside the running ones.',
      min: 0,
      queries: [
        { expr: `sum by (instance) (${sel(`${PF}_queue_depth`)})`, legend: 'prefill {{instance}}' },
        { expr: `sum by (instance) (${sel(`${DN}_queue_depth`)})`, legend: 'denoise {{instance}}' },
        {
          expr: `sum by (instance) (${sel(`${PF}_queued_for_kv_memory`)})`,
          legend: 'prefill held for K/V memory {{instance}}',
        },
        {
          expr: `sum by (instance) (${sel(`${DN}_queued_for_kv_memory`)})`,
          legend: 'denoise held for K/V memory {{instance}}',
        },
      ],
    }),
  },
  {
    w: 12,
    panel: timeseries({
      title: 'Prefill throughput',
      description:
        'Prompt tokens per second run through the encoder on each prefill worker, and the encoder throughput of its last step (a gauge).',
      min: 0,
      queries: [
        { expr: `sum by (instance) (${rate(`${PF}_computed_tokens_total`)})`, legend: 'computed {{instance}}' },
        { expr: `sum by (instance) (${sel(`${PF}_tokens_per_second`)})`, legend: 'last step {{instance}}' },
      ],
    }),
  },
];

/** Free share of one role's KV pool per worker and layer kind. free counts cached blocks too. */
const kvFree = (metric: string): string =>
  `sum by (instance, kind) (${sel(metric, 'state="free"')}) / sum by (instance, kind) (${sel(metric, 'state=~"used|free"')})`;

const kv: Sized[] = [
  {
    w: 8,
    panel: timeseries({
      title: 'Denoise KV blocks (full-attention layers)',
      description:
        'KV blocks of the denoise workers\' pools: used (referenced), free (not referenced; total = used + free) and cached (the part of free that holds evictable prefix-cache blocks).',
      min: 0,
      queries: [{ expr: `sum by (instance, state) (${sel(`${DN}_kv_blocks`, 'kind="full"')})`, legend: '{{instance}} {{state}}' }],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'Prefill KV blocks (full-attention layers)',
      description: 'The same for the prefill workers\' pools (their cached blocks are the prefix cache).',
      min: 0,
      queries: [{ expr: `sum by (instance, state) (${sel(`${PF}_kv_blocks`, 'kind="full"')})`, legend: '{{instance}} {{state}}' }],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'KV free share',
      description:
        'free / (used + free) per worker and layer kind (full, sliding). The dashed line is the DgserveKvCacheExhausted threshold (5 % of the full-layer blocks of a denoise worker, for 5 m).',
      unit: 'percentunit',
      min: 0,
      max: 1,
      redAbove: 0.05,
      queries: [
        { expr: kvFree(`${DN}_kv_blocks`), legend: 'denoise {{instance}} {{kind}}' },
        { expr: kvFree(`${PF}_kv_blocks`), legend: 'prefill {{instance}} {{kind}}' },
      ],
    }),
  },
  {
    w: 12,
    panel: timeseries({
      title: 'Prefix-cache hit rate',
      description:
        'Prefill prefix cache: share of lookups whose served prefill reused at least one block; share of prompt tokens reused from the cache (a hit is used at any 16-token KV block boundary, so every matched token is reused).',
      unit: 'percentunit',
      min: 0,
      max: 1,
      queries: [
        {
          expr: `sum(${rate(`${PF}_prefix_cache_hits_total`)}) / sum(${rate(`${PF}_prefix_cache_queries_total`)})`,
          legend: 'lookups with a hit',
        },
        {
          expr: `sum(${rate(`${PF}_cached_tokens_total`)}) / (sum(${rate(`${PF}_cached_tokens_total`)}) + sum(${rate(`${PF}_computed_tokens_total`)}))`,
          legend: 'prompt tokens reused',
        },
      ],
    }),
  },
  {
    w: 12,
    panel: timeseries({
      title: 'Prompt tokens/s (all vs. from a prefix cache)',
      description: 'Prompt tokens of the requests the gateway finished, per second, and those of them served from a prefix cache (the usage the API reports as cached_tokens).',
      min: 0,
      queries: [
        { expr: `sum(${rate(`${GW}_prompt_tokens_total`)})`, legend: 'prompt' },
        { expr: `sum(${rate(`${GW}_cached_prompt_tokens_total`)})`, legend: 'cached prompt' },
      ],
    }),
  },
  // The CUDA backend's device K/V block pools: only workers on --device cuda export these.
  {
    w: 8,
    panel: timeseries({
      title: 'Device KV blocks by state (CUDA workers)',
      description:
        'Device K/V blocks of the CUDA backend\'s pools per worker and layer kind: in_use (held by a sequence), cached (held by none, kept for their rows: a later prefix hit takes them without an upload) and free (allocated, neither); the pools grow and never shrink. No series on CPU workers.',
      min: 0,
      queries: [
        { expr: `sum by (instance, kind, state) (${sel(`${DN}_device_kv_blocks`)})`, legend: 'denoise {{instance}} {{kind}} {{state}}' },
        { expr: `sum by (instance, kind, state) (${sel(`${PF}_device_kv_blocks`)})`, legend: 'prefill {{instance}} {{kind}} {{state}}' },
      ],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'Device KV blocks shared and swap-outs/s (CUDA workers)',
      description:
        'Device K/V blocks per second a sequence took from another sequence or the device cache instead of uploading their rows (a prefix hit or a fork on the device), and idle sequences per second whose device-only rows were copied to the host to free their blocks (the pool at its bound, --cuda_kv_pool_gb, or the device out of memory), pools compacted per second to give the pool of the other layer kind the memory of their unheld blocks (the two share one bound), pool growths per second (each maps at most 1 GiB of device memory and stalls the pass that makes it), and encoder passes, denoising steps or commits per second the backend refused for want of K/V memory and the worker ran in smaller passes.',
      min: 0,
      queries: [
        { expr: `sum by (instance) (${rate(`${PF}_device_kv_shared_blocks_total`)})`, legend: 'shared prefill {{instance}}' },
        { expr: `sum by (instance) (${rate(`${DN}_device_kv_shared_blocks_total`)})`, legend: 'shared denoise {{instance}}' },
        { expr: `sum by (instance) (${rate(`${PF}_device_kv_swap_outs_total`)})`, legend: 'swap-outs prefill {{instance}}' },
        { expr: `sum by (instance) (${rate(`${DN}_device_kv_swap_outs_total`)})`, legend: 'swap-outs denoise {{instance}}' },
        { expr: `sum by (instance) (${rate(`${PF}_device_kv_compactions_total`)})`, legend: 'pool compactions prefill {{instance}}' },
        { expr: `sum by (instance) (${rate(`${DN}_device_kv_compactions_total`)})`, legend: 'pool compactions denoise {{instance}}' },
        { expr: `sum by (instance) (${rate(`${PF}_device_kv_growths_total`)})`, legend: 'pool growths prefill {{instance}}' },
        { expr: `sum by (instance) (${rate(`${DN}_device_kv_growths_total`)})`, legend: 'pool growths denoise {{instance}}' },
        { expr: `sum by (instance) (${rate(`${PF}_passes_in_parts_total`)})`, legend: 'passes run in parts prefill {{instance}}' },
        { expr: `sum by (instance) (${rate(`${DN}_passes_in_parts_total`)})`, legend: 'passes run in parts denoise {{instance}}' },
      ],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'Device KV copies host ↔ device (CUDA workers)',
      description:
        'K/V bytes per second uploaded from host caches to the device (rows the device lacks: a cache it has not seen, or rows another writer added) and copied back to host caches (the deferred host copy before a prompt is indexed and shipped), as stored on the device.',
      unit: 'Bps',
      min: 0,
      queries: [
        { expr: `sum by (instance) (${rate(`${PF}_device_kv_upload_bytes_total`)})`, legend: 'upload prefill {{instance}}' },
        { expr: `sum by (instance) (${rate(`${DN}_device_kv_upload_bytes_total`)})`, legend: 'upload denoise {{instance}}' },
        { expr: `sum by (instance) (${rate(`${PF}_device_kv_sync_to_host_bytes_total`)})`, legend: 'to host prefill {{instance}}' },
        { expr: `sum by (instance) (${rate(`${DN}_device_kv_sync_to_host_bytes_total`)})`, legend: 'to host denoise {{instance}}' },
      ],
    }),
  },
];

const transfer: Sized[] = [
  {
    w: 8,
    panel: timeseries({
      title: 'KV transfer bytes/s by transport',
      description: 'KV payload bytes per second the prefill workers send to denoise workers, by transport (tcp, inprocess).',
      unit: 'Bps',
      min: 0,
      queries: [{ expr: `sum by (transport) (${rate(`${PF}_kv_transfer_bytes_total`)})`, legend: '{{transport}}' }],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'KV transfer failures/s by transport',
      description: 'Failed KV transfers per second, by transport: on the sending (prefill) and receiving (denoise) side.',
      unit: 'short',
      min: 0,
      queries: [
        { expr: `sum by (transport) (${rate(`${PF}_kv_transfer_failures_total`)})`, legend: 'send {{transport}}' },
        { expr: `sum by (transport) (${rate(`${DN}_kv_transfer_failures_total`)})`, legend: 'receive {{transport}}' },
      ],
    }),
  },
  {
    w: 8,
    panel: timeseries({
      title: 'KV transfer time p95 by transport',
      description: 'Wall time of one request\'s KV transfer from a prefill worker, by transport.',
      unit: 's',
      min: 0,
      queries: [
        { expr: quantile(0.95, `${PF}_kv_transfer_duration_seconds`, ['transport']), legend: '{{transport}}' },
      ],
    }),
  },
];

// ---- variables and the dashboard ----

const promVariable = (name: string, label: string, query: string): VariableModel => ({
  type: 'query',
  name,
  label,
  datasource: DS,
  query,
  refresh: VariableRefresh.onTimeRangeChanged,
  includeAll: true,
  multi: true,
  allValue: '.*',
  current: { text: ['All'], value: ['$__all'], selected: true },
  sort: VariableSort.alphabeticalAsc,
  hide: VariableHide.dontHide,
  regex: '',
  options: [],
});

const annotations: AnnotationQuery[] = [
  {
    builtIn: 1,
    datasource: { type: 'grafana', uid: '-- Grafana --' },
    enable: true,
    hide: true,
    iconColor: 'rgba(0, 211, 255, 1)',
    name: 'Annotations & Alerts',
    type: 'dashboard',
  },
];

const dashboard: Dashboard = {
  uid: 'dgserve-overview',
  title: 'dgserve: DiffusionGemma serving',
  description:
    'Requests, the HTTP front end and admission, time to first token by stage, block-diffusion denoising, queues, KV cache and KV transfer of a dgserve cluster (gateway, prefill and denoise workers).',
  tags: ['dgserve', 'llm', 'diffusion'],
  editable: true,
  graphTooltip: DashboardCursorSync.Crosshair,
  schemaVersion: 42,
  version: 1,
  time: { from: 'now-1h', to: 'now' },
  timepicker: {},
  timezone: 'browser',
  refresh: '30s',
  fiscalYearStartMonth: 0,
  liveNow: false,
  links: [],
  annotations: { list: annotations },
  templating: {
    list: [
      {
        type: 'datasource',
        name: 'datasource',
        label: 'Data source',
        query: 'prometheus',
        refresh: VariableRefresh.onDashboardLoad,
        hide: VariableHide.dontHide,
        includeAll: false,
        multi: false,
        regex: '',
        options: [],
      },
      promVariable('job', 'Job', 'label_values({__name__=~"dgserve_.+_requests_total"}, job)'),
      promVariable('instance', 'Instance', 'label_values({__name__=~"dgserve_.+_requests_total", job=~"$job"}, instance)'),
    ],
  },
  panels: layout([
    { title: 'Requests and errors', panels: requests },
    { title: 'HTTP front end and admission', panels: frontEnd },
    { title: 'Time to first token', panels: ttft },
    { title: 'Denoising', panels: denoising },
    { title: 'Queues and prefill', panels: queues },
    { title: 'KV cache', panels: kv },
    { title: 'KV transfer', panels: transfer },
  ]),
};

export default dashboard;
