#!/usr/bin/env bash
# Regenerates the Sudoku demo's splits deterministically (same binary logic, same files):
#   train.jsonl  30000 puzzles, seed 1, givens 22..50   (git-ignored; regenerate it)
#   valid.jsonl    300 puzzles, seed 2, givens 24..45
#   test.jsonl     600 puzzles, seed 3, givens 24..45
# then checks that no puzzle appears in two splits and that no valid/test solution grid appears
# in train (exit 1 otherwise).
#
#   tools/sudoku/make_splits.sh [OUT_DIR]     (default: tools/sudoku/data)
#   SUDOKU_GEN=/path/to/dgserve-sudoku-gen tools/sudoku/make_splits.sh
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$here/data}"
gen="${SUDOKU_GEN:-$root/build/tools/sudoku/dgserve-sudoku-gen}"
if [[ ! -x "$gen" ]]; then
  echo "make_splits.sh: generator '$gen' not found; build dgserve-sudoku-gen or set SUDOKU_GEN" >&2
  exit 1
fi
mkdir -p "$out"

start=$(date +%s.%N)
"$gen" --out "$out/train.jsonl" --count 30000 --seed 1 --min_givens 22 --max_givens 50
"$gen" --out "$out/valid.jsonl" --count 300 --seed 2 --min_givens 24 --max_givens 45
"$gen" --out "$out/test.jsonl" --count 600 --seed 3 --min_givens 24 --max_givens 45

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
splits = {}
for name in ("train", "valid", "test"):
    with open(f"{out}/{name}.jsonl") as f:
        splits[name] = [json.loads(line) for line in f]
puzzles = {n: {r["puzzle"] for r in rows} for n, rows in splits.items()}
solutions = {n: {r["solution"] for r in rows} for n, rows in splits.items()}
bad = []
for a, b in (("train", "valid"), ("train", "test"), ("valid", "test")):
    if both := puzzles[a] & puzzles[b]:
        bad.append(f"{len(both)} puzzle(s) in both {a} and {b}")
for n in ("valid", "test"):
    if both := solutions[n] & solutions["train"]:
        bad.append(f"{len(both)} {n} solution grid(s) also in train")
if bad:
    sys.exit("make_splits.sh: leak: " + "; ".join(bad))
print("make_splits.sh: splits disjoint: " +
      ", ".join(f"{n} {len(rows)}" for n, rows in splits.items()), file=sys.stderr)
PY
end=$(date +%s.%N)
awk -v s="$start" -v e="$end" 'BEGIN { printf "make_splits.sh: done in %.1f s\n", e - s }' >&2
