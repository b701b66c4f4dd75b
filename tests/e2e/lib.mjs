// Shared helpers of the e2e client scripts: the pinned npm packages of third_party/npm, the
// cluster addresses from the environment (run_e2e.sh exports cluster.env) and small asserts.
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const NPM_DIR = process.env.DGSERVE_NPM_DIR || path.join(ROOT, 'third_party/npm');
// ESM resolution does not look in third_party/npm/node_modules; resolve from there explicitly.
export const npmRequire = createRequire(path.join(NPM_DIR, 'package.json'));

export function env(name) {
  const v = process.env[name];
  if (!v) throw new Error(`environment variable ${name} is not set (run via tests/e2e/run_e2e.sh)`);
  return v;
}

export class CheckError extends Error {}

export function check(cond, what, detail) {
  if (!cond) {
    const extra = detail === undefined ? '' : `\n  got: ${typeof detail === 'string' ? detail : JSON.stringify(detail)}`;
    throw new CheckError(`${what}${extra}`);
  }
}

export function equal(actual, expected, what) {
  if (actual !== expected) {
    throw new CheckError(`${what}\n  expected: ${JSON.stringify(expected)}\n  actual:   ${JSON.stringify(actual)}`);
  }
}

// Runs the named steps in order; reports each; exits 1 if any failed (all steps still run).
export async function runSteps(script, steps) {
  let failed = 0;
  for (const [name, fn] of steps) {
    try {
      await fn();
      console.log(`  ok   ${script}: ${name}`);
    } catch (e) {
      failed++;
      const msg = e instanceof CheckError ? e.message : (e && e.stack) || String(e);
      console.log(`  FAIL ${script}: ${name}\n    ${String(msg).replace(/\n/g, '\n    ')}`);
    }
  }
  if (failed) {
    console.log(`${script}: ${failed} of ${steps.length} checks failed`);
    process.exit(1);
  }
}
