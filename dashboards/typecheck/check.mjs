#!/usr/bin/env node
// Type-checks Grafana dashboards against Grafana's published `Dashboard` type (@grafana/schema):
// each dashboard becomes `export const d: Dashboard = <the JSON>;` and `tsc --noEmit --strict`
// checks it, so a misspelled key (`pannels`) or a wrong type (`"h": "8"`) fails.
//
// Usage: node dashboards/typecheck/check.mjs DASHBOARD.json...
// Needs `scripts/install-test-deps.sh` (it installs typescript and @grafana/schema into
// target/dashboard-typecheck, or $DASHBOARD_TYPECHECK_DIR). Errors are reported at the line of
// the JSON file. Exit status: 0 all pass, 1 a dashboard fails, 2 the setup is missing.
//
// Limitation: a JSON string cannot satisfy a TypeScript string enum, so fields typed as one
// (`thresholds.mode`, `color.mode`, value `mappings[].type`) cannot be type-checked this way; the
// dashboards leave them to Grafana's defaults.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, '..', '..');
const scratch = resolve(process.env.DASHBOARD_TYPECHECK_DIR ?? join(root, 'target', 'dashboard-typecheck'));
const tsc = join(scratch, 'node_modules', 'typescript', 'bin', 'tsc');

const files = process.argv.slice(2);
if (files.length === 0) {
  console.error('usage: node dashboards/typecheck/check.mjs DASHBOARD.json...');
  process.exit(2);
}
if (!existsSync(tsc) || !existsSync(join(scratch, 'node_modules', '@grafana', 'schema', 'package.json'))) {
  console.error(`typescript or @grafana/schema is not installed in ${scratch}; run scripts/install-test-deps.sh (make test-deps)`);
  process.exit(2);
}

// A fresh folder under the scratch folder, so that parallel runs do not meet and
// `@grafana/schema` resolves from the scratch folder's node_modules.
mkdirSync(join(scratch, 'runs'), { recursive: true });
const run = mkdtempSync(join(scratch, 'runs', 'check-'));
// The import takes line 1 and the JSON starts on line 2: a .ts line is its JSON line plus 1.
const LINE_OFFSET = 1;
const sources = new Map();
let failed = false;
try {
  files.forEach((file, i) => {
    const text = readFileSync(file, 'utf8');
    try {
      JSON.parse(text);
    } catch (e) {
      console.error(`${file}: not valid JSON: ${e.message}`);
      failed = true;
      return;
    }
    const ts = `dashboard_${i}.ts`;
    sources.set(ts, file);
    writeFileSync(
      join(run, ts),
      `import type { Dashboard } from '@grafana/schema';\nexport const d: Dashboard = ${text.trimEnd()};\n`,
    );
  });
  if (sources.size > 0) {
    const base = join(here, 'tsconfig.json');
    writeFileSync(
      join(run, 'tsconfig.json'),
      JSON.stringify({ extends: base, include: ['*.ts'] }, null, 2),
    );
    const r = spawnSync(process.execPath, [tsc, '--noEmit', '--strict', '--pretty', 'false', '-p', run], {
      encoding: 'utf8',
    });
    if (r.error) {
      console.error(`cannot run tsc: ${r.error.message}`);
      process.exit(2);
    }
    // tsc reports `dashboard_0.ts(12,5): error TS2353: ...`; name the JSON file and its line.
    const out = `${r.stdout}${r.stderr}`.replace(
      /^(?:.*[\\/])?(dashboard_\d+\.ts)\((\d+),(\d+)\)/gm,
      (_, ts, line, col) => `${sources.get(ts) ?? ts}:${Number(line) - LINE_OFFSET}:${col}`,
    );
    if (r.status !== 0) {
      process.stderr.write(out);
      failed = true;
    }
  }
} finally {
  rmSync(run, { recursive: true, force: true });
}
for (const file of sources.values()) {
  if (!failed) console.log(`${basename(file)}: a valid Grafana Dashboard`);
}
process.exit(failed ? 1 : 0);
