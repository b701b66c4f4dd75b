#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz/ with clang under ASan + UBSan in the sanitizer
# tree (build-asan/, configured by tools/configure_sanitize.sh, which tools/sanitize.sh then
# builds the tests in) and runs each for a bounded time over its seed corpus; fails on any finding
# (a crash, a sanitizer report, a broken invariant, a leak, an out-of-memory or a timeout).
#
#   bash tests/fuzz/run_fuzz.sh                 # every harness, FUZZ_SECONDS (60) each
#   FUZZ_SECONDS=600 bash tests/fuzz/run_fuzz.sh fuzz_kv_receiver
#
# Environment: FUZZ_SECONDS (per harness, default 60), FUZZ_BUILD_DIR (default build-asan),
# FUZZ_JOBS (build parallelism, default nproc), FUZZ_PARALLEL (harnesses run at once, default
# nproc), FUZZ_RSS_MB (libFuzzer -rss_limit_mb, 2048), each a whole number >= 1;
# FUZZ_PRINT_PLAN=1 checks them and the harness names, prints the build jobs and harnesses at a
# time, and exits.
# New inputs found during a run go to $FUZZ_BUILD_DIR/corpus/<harness> (the seed corpus in the
# tree is read only); crash inputs to $FUZZ_BUILD_DIR/findings/<harness>/.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_EACH=${FUZZ_SECONDS:-60}
BUILD_DIR=${FUZZ_BUILD_DIR:-build-asan}
# The cores this process may use. nproc honours OMP_NUM_THREADS (and OMP_THREAD_LIMIT), which the
# harnesses' environment sets to 1 below: counted without them, before that.
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
JOBS=${FUZZ_JOBS:-$CORES}
RSS_MB=${FUZZ_RSS_MB:-2048}
# One harness per core at a time (FUZZ_PARALLEL, default nproc): each is single-threaded, so two
# on two cores give every harness its full FUZZ_SECONDS in half the wall time.
PARALLEL=${FUZZ_PARALLEL:-$CORES}
ALL=(fuzz_openai_completions fuzz_openai_chat fuzz_tokenizer_json fuzz_tokenizer_encode
     fuzz_chat_template fuzz_safetensors_file fuzz_safetensors_index fuzz_model_config
     fuzz_gateway_request fuzz_kv_receiver)
if [ $# -gt 0 ]; then FUZZERS=("$@"); else FUZZERS=("${ALL[@]}"); fi

# Settings and names are checked before anything is built or run (exit 1): libFuzzer reads
# -max_total_time=0 as "no limit", so a FUZZ_SECONDS of 0 or a word would fuzz forever.
die() { echo "run_fuzz.sh: $*" >&2; exit 1; }
for var in FUZZ_SECONDS:"$SECONDS_EACH" FUZZ_JOBS:"$JOBS" FUZZ_RSS_MB:"$RSS_MB" \
           FUZZ_PARALLEL:"$PARALLEL"; do
  [[ "${var#*:}" =~ ^[1-9][0-9]*$ ]] || die "${var%%:*} must be a whole number >= 1, not '${var#*:}'"
done
for f in "${FUZZERS[@]}"; do
  [[ " ${ALL[*]} " == *" $f "* ]] || die "unknown harness '$f' (harnesses: ${ALL[*]})"
done
if [ "${FUZZ_PRINT_PLAN:-0}" = 1 ]; then  # for the test of this script: what it would run at once
  echo "fuzz plan: build jobs $JOBS, harnesses at a time $PARALLEL"
  exit 0
fi
bash tools/configure_sanitize.sh "$BUILD_DIR"
cmake --build "$BUILD_DIR" -j"$JOBS" --target dgserve_fuzzers

export DGSERVE_SOURCE_DIR="$PWD"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
export OMP_NUM_THREADS=1
# run_one HARNESS: runs it, then writes its result line(s) to $BUILD_DIR/findings/HARNESS.result
# (exit status: 0 no finding).
run_one() {
  local f=$1
  local seeds="tests/fuzz/corpus/$f" work="$BUILD_DIR/corpus/$f" findings="$BUILD_DIR/findings/$f"
  local log="$BUILD_DIR/findings/$f.log" result="$BUILD_DIR/findings/$f.result"
  mkdir -p "$work" "$findings"
  local dict=()
  [ -f "tests/fuzz/dict/$f.dict" ] && dict=(-dict="tests/fuzz/dict/$f.dict")
  if "$BUILD_DIR/tests/fuzz/$f" "$work" "$seeds" "${dict[@]}" -max_total_time="$SECONDS_EACH" \
       -rss_limit_mb="$RSS_MB" -timeout=25 -max_len=16384 -print_final_stats=1 \
       -artifact_prefix="$findings/" >"$log" 2>&1; then
    { grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" |
        tr '\n' ' ' | sed "s/^/fuzz: $f: /"; echo; } >"$result"
    return 0
  fi
  { echo "fuzz: $f FAILED (log $log, inputs in $findings/):"; tail -n 60 "$log"; } >"$result"
  return 1
}
failed=()
pids=()
names=()
# report_oldest: waits for the oldest running harness and prints its result.
report_oldest() {
  local f=${names[0]} pid=${pids[0]}
  if ! wait "$pid"; then failed+=("$f"); fi
  cat "$BUILD_DIR/findings/$f.result"
  pids=("${pids[@]:1}")
  names=("${names[@]:1}")
}
mkdir -p "$BUILD_DIR/findings"
for f in "${FUZZERS[@]}"; do
  [ ${#pids[@]} -ge "$PARALLEL" ] && report_oldest
  echo "fuzz: $f for ${SECONDS_EACH}s"
  run_one "$f" &
  pids+=($!)
  names+=("$f")
done
while [ ${#pids[@]} -gt 0 ]; do report_oldest; done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: findings in ${failed[*]}"
  exit 1
fi
echo "fuzz: no findings in ${#FUZZERS[@]} harnesses"
