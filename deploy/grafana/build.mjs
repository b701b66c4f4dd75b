#!/usr/bin/env node
// Writes deploy/grafana/dashboard.json from deploy/grafana/dashboard.ts.
//
//   node deploy/grafana/build.mjs [--out FILE]     (default: deploy/grafana/dashboard.json)
//
// dashboard.ts (and lib.ts, which it imports) is transpiled with the TypeScript of
// third_party/npm (types are not checked here: `tsc --noEmit -p deploy/grafana` does that) and
// evaluated as CommonJS, its package imports resolved from third_party/npm/node_modules
// (@grafana/schema's enums are runtime values).
// The output is deterministic: the same dashboard.ts always gives the same bytes.
import { readFileSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, '../..');
const args = process.argv.slice(2);
let out = join(here, 'dashboard.json');
for (let i = 0; i < args.length; i++) {
  if (args[i] === '--out' && i + 1 < args.length) out = resolve(args[++i]);
  else {
    console.error(`build.mjs: unknown argument ${args[i]}\nusage: node deploy/grafana/build.mjs [--out FILE]`);
    process.exit(2);
  }
}

const npmRequire = createRequire(join(root, 'third_party/npm/package.json'));
let ts;
try {
  ts = npmRequire('typescript');
  npmRequire.resolve('@grafana/schema');
} catch (e) {
  console.error(`build.mjs: needs typescript and @grafana/schema in third_party/npm (run tools/setup.sh): ${e.message}`);
  process.exit(1);
}

// A .ts file transpiled and evaluated as CommonJS; its relative imports ('./lib') are the .ts
// files next to it (each evaluated once), the others come from third_party/npm.
const loaded = new Map();
function load(source) {
  if (loaded.has(source)) return loaded.get(source).exports;
  const { outputText, diagnostics } = ts.transpileModule(readFileSync(source, 'utf8'), {
    fileName: source,
    reportDiagnostics: true,
    compilerOptions: { module: ts.ModuleKind.CommonJS, target: ts.ScriptTarget.ES2022 },
  });
  if (diagnostics && diagnostics.length) {
    console.error(ts.formatDiagnostics(diagnostics, {
      getCanonicalFileName: (f) => f, getCurrentDirectory: () => root, getNewLine: () => '\n',
    }));
    process.exit(1);
  }
  const module = { exports: {} };
  loaded.set(source, module);
  const require = (spec) =>
    spec.startsWith('./') ? load(join(dirname(source), spec.endsWith('.ts') ? spec : `${spec}.ts`)) : npmRequire(spec);
  new Function('exports', 'require', 'module', '__filename', '__dirname', outputText)(
    module.exports, require, module, source, dirname(source));
  return module.exports;
}
const module = { exports: load(join(here, 'dashboard.ts')) };
const dashboard = module.exports.default;
if (!dashboard || typeof dashboard !== 'object' || !Array.isArray(dashboard.panels)) {
  console.error('build.mjs: dashboard.ts has no default export with panels');
  process.exit(1);
}
writeFileSync(out, JSON.stringify(dashboard, null, 2) + '\n');
console.log(`build.mjs: wrote ${out} (${dashboard.panels.length} panels and rows)`);
