#!/usr/bin/env node
// Writes deploy/grafana/dashboard.json from deploy/grafana/dashboard.ts.
//
//   node deploy/grafana/build.mjs [--out FILE]     (default: deploy/grafana/dashboard.json)
//
// dashboard.ts is transpiled with the TypeScript of third_party/npm (types are not checked
// here: `tsc --noEmit -p deploy/grafana` does that) and evaluated as CommonJS, its imports
// resolved from third_party/npm/node_modules (@grafana/schema's enums are runtime values).
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

const source = join(here, 'dashboard.ts');
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
new Function('exports', 'require', 'module', '__filename', '__dirname', outputText)(
  module.exports, npmRequire, module, source, here);
const dashboard = module.exports.default;
if (!dashboard || typeof dashboard !== 'object' || !Array.isArray(dashboard.panels)) {
  console.error('build.mjs: dashboard.ts has no default export with panels');
  process.exit(1);
}
writeFileSync(out, JSON.stringify(dashboard, null, 2) + '\n');
console.log(`build.mjs: wrote ${out} (${dashboard.panels.length} panels and rows)`);
