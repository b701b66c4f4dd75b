// Waits until a Prometheus server started by run_e2e.sh scrapes all the cluster's metrics
// targets (health "up") and then queries dgserve_gateway_requests_total.
//   PROM_URL=http://127.0.0.1:P EXPECT_TARGETS=3 node tests/e2e/prometheus_check.mjs
import { env, check, runSteps } from './lib.mjs';

const PROM = env('PROM_URL');
const EXPECT = Number(env('EXPECT_TARGETS'));
const WAIT_MS = 60_000;

async function api(pathAndQuery) {
  const res = await fetch(`${PROM}${pathAndQuery}`, { signal: AbortSignal.timeout(10_000) });
  const body = await res.json();
  check(res.ok && body.status === 'success', `GET ${pathAndQuery} succeeds`, body);
  return body.data;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Polls fn until it returns a truthy value or WAIT_MS passes; returns the last value.
async function poll(fn) {
  const end = Date.now() + WAIT_MS;
  let last;
  for (;;) {
    try {
      last = await fn();
      if (last.ok) return last;
    } catch (e) {
      last = { ok: false, error: String(e) };
    }
    if (Date.now() > end) return last;
    await sleep(500);
  }
}

await runSteps('prometheus', [
  [`all ${EXPECT} targets up`, async () => {
    const r = await poll(async () => {
      const data = await api('/api/v1/targets?state=active');
      const targets = data.activeTargets.map((t) => ({ url: t.scrapeUrl, health: t.health, lastError: t.lastError }));
      return { ok: targets.length === EXPECT && targets.every((t) => t.health === 'up'), targets };
    });
    check(r.ok, `within ${WAIT_MS / 1000} s, /api/v1/targets reports ${EXPECT} targets with health "up"`, r);
    for (const t of r.targets) console.log(`    up: ${t.url}`);
  }],
  ['query dgserve_gateway_requests_total', async () => {
    const r = await poll(async () => {
      const data = await api('/api/v1/query?query=dgserve_gateway_requests_total');
      return { ok: data.resultType === 'vector' && data.result.length > 0, data };
    });
    check(r.ok, 'dgserve_gateway_requests_total has a non-empty result', r);
    const total = r.data.result.reduce((s, x) => s + Number(x.value[1]), 0);
    check(total > 0, 'the requests sent before are counted (sum > 0)', r.data.result);
    for (const x of r.data.result) console.log(`    ${JSON.stringify(x.metric)} ${x.value[1]}`);
  }],
]);
