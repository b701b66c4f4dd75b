#!/usr/bin/env bash
# The prepared device check (issues #5, #14 and #33) for a machine with an NVIDIA GPU, in one
# bounded run (default 400 s, GPU_CHECK_SECONDS) that writes its report to $OUT (default gpu_check_out/):
# report.txt, one line per result, plus the logs of each step. Every step has a timeout taken
# from one overall deadline; a failed or timed-out step is reported and the next one runs; it
# kills only the processes it started (by PID). Exit status 0 only when every step that ran
# passed.
#
#   OUT=/some/dir bash tools/gpu_check.sh              # on the GPU machine
#   GPU_CHECK_DRY_RUN=1 OUT=/tmp/x bash tools/gpu_check.sh   # anywhere: the CPU-runnable parts
#   source gpubundle/env.sh; BUILD_DIR=gpubundle/build-gpu bash tools/gpu_check.sh
#                                  # binaries built elsewhere (tools/gpu_bundle.sh, for a GPU
#                                  # machine without dgserve's build dependencies)
#
# Steps (report.txt prefixes):
#  1. build (`build:`): configures BUILD_DIR (default build-gpu) with -DDGSERVE_CUDA_BACKEND=ON and
#     builds what is missing: the `gpu` tests first, then the cluster, then engine_bench and
#     attention_bench. A BUILD_DIR carried from elsewhere with everything in it skips this.
#     GPU_CHECK_BUILD_ONLY=1 stops after it (a first call that builds, a second that checks).
#  2. the `gpu` tests (`PASSED/FAILED/SKIPPED/CRASHED/TIMEOUT <binary> <test>`): each CUDA kernel
#     against the CPU code it mirrors (cuda_ops, cuda_gemm, cuda_attention, cuda_vocab: the fused
#     vocabulary pass and the former VocabStep, with the canvas-template masks,
#     cuda_backend_kernels), the whole CUDA backend against the CPU
#     backend (cuda_backend, masked steps included), and
#     NCCL: with one GPU the 1-rank self-send test (kvstore_nccl_self_send_test; NCCL refuses two
#     ranks of one communicator on one device).
#  3. the cluster (`cluster:`): a gateway, a prefill and a denoise worker as three processes on the
#     tiny-v512 test model; one /v1/completions request, seeded and nearly greedy (t_min 0.01,
#     t_max 0.02), on the CPU cluster (the reference), then on the GPU cluster (--device cuda on
#     both workers) once per KV transport (the prefill worker's --kv_transport;
#     GPU_CHECK_TRANSPORTS, default "cuda_ipc auto tcp"; the log line naming the transport it
#     chose is reported), and nccl across two GPUs where two exist. Same device, different
#     transport: the text must be identical (the KV bytes are the same). GPU against CPU:
#     reported MATCH or DIFFERS with the first differing canvas step. Both clusters run the same
#     GEMM input on both workers (GPU_CHECK_CLUSTER_GEMM_INPUT: bf16, the GPU's default, so the
#     CPU reference runs --cpu_gemm_input=bf16; or float32): the GPU then differs from the CPU
#     in float32 addition order only (the GEMMs, the kernels' own reductions), which can still
#     flip a bf16 rounding and then a sample at a near tie on a random checkpoint, so a
#     difference is a finding to look at, not a failure.
#  3b. (GPU_CHECK_SANITIZER=1) compute-sanitizer on the seven kernel test binaries and the
#     synthetic-weight fill kernels (cuda_synthetic_test's CudaTest.Fill*)
#     (`sanitizer:`), one error summary per binary and tool (GPU_CHECK_SANITIZER_TOOLS, default
#     memcheck; also racecheck, synccheck, initcheck).
# GPU_CHECK_STEPS picks the steps after the build (default "calibrate tests cluster sanitizer
# attention bench").
#  1b. calibrate (`calibrate:`, before the tests): the two ceilings, engine_bench --calibrate_only
#     (a 1 GiB device-to-device copy in GB/s, read + write; an 8192³ bf16 cuBLAS GEMM in TFLOP/s)
#     and the card's name.
#  3c. the attention kernels alone (`attention:`, issue 34 item 5): bench/attention_bench on the
#     full shape's attention (bench/configs/diffusiongemma-26b-a4b.json: 16 heads; sliding
#     layers head_dim 256, 8 KV heads, window 1024; full layers head_dim 512, 2 KV heads):
#     canvas attention (256-row canvases, each with its own context K/V) at 2k, 32k and 128k
#     context × batch 1 and 16, and the causal prefill of a 32k-token prompt in the backend's
#     8192-token chunks and whole, tensor-core kernels first, then the float32 ones for
#     comparison; one ATTN line per case with ms, TFLOP/s and % of the bf16 GEMM ceiling, GB/s
#     and % of the copy ceiling (both measured in the same process: the CEILINGS line). Bounded
#     by --device_budget_s (GPU_CHECK_ATTN_SECONDS, default 35): the cases that do not fit are
#     reported skipped (reason=budget), as those whose buffers do not fit (reason=device_memory).
#  4. the benchmarks (`bench:`, `table:`), all with weights generated on the device
#     (engine_bench --synthetic: no checkpoint written), --phase_timing, 16 steps per canvas
#     (GPU_CHECK_BENCH_STEPS), --cuda_gemm_input bf16 (GPU_CHECK_GEMM_INPUTS, e.g. "float32
#     bf16"): the real-width 2-layer slice (bench/configs/real-width-2-layers.json) at 2k and
#     32k context × batch 1 and 16; then the full 30-layer shape (bench/configs/
#     diffusiongemma-26b-a4b.json, about 52 GB of device memory; GPU_CHECK_FULL_SHAPE=0 leaves
#     it out) as a batch sweep 1, 2, 4, 8, 16, 32 at 2k context (one process: one weight fill,
#     one real 2k prefill, at most 6 s of timed steps per batch) and batch 1 and 16 at 32k (a
#     synthetic KV cache instead of the minutes-long 32k prefill; 4 steps) — a batch whose KV
#     copies and scratch do not fit in free device memory is reported skipped by engine_bench;
#     the 32k runs twice: `full-32k-*` with the float32 attention kernels
#     (--cuda_tensor_core_attention=false, float32 device KV mirror) and `full-32k-tc-*` with the
#     attention on the tensor cores and the bf16 device KV mirror (the default since issue 34;
#     the other runs take the default too);
#     and the step as served (`full-2k-graphs-*`: CUDA graphs replayed, no --phase_timing, whose
#     event brackets run the step eagerly) at batch 1 and 16, 2k context.
#     Each RESULT line: step, body and vocabulary times (body_ms=na vocab_ms=na in the runs
#     without --phase_timing), per-phase CUDA-event times and host gaps, launches and blocking host round trips per step, tokens/s at 16 steps, the weight
#     bytes per step ÷ step time as a share of the measured copy bandwidth (and of
#     GPU_MEM_BW_GBS: 4800 GB/s on an H200, 3350 on an H100 SXM), peak device memory
#     (cudaMemGetInfo; nvidia-smi sampled every 250 ms: gpu_memory.csv). The `table:` lines are
#     the kernel table: each phase's time, bytes, GB/s and TFLOP/s as % of the two ceilings.
#
# Device-time budget (at most 7 minutes of a device session; the binaries come prebuilt in the
# bundle of tools/gpu_bundle.sh, so no build runs on the device; GPU_CHECK_SECONDS=400 bounds
# the whole script, each step's timeout is taken from that one deadline):
#    5 s  nvidia-smi, the machine
#   10 s  calibrate (1 GiB copy ×6, 8192³ GEMM ×6, cuBLAS start)
#   80 s  the gpu tests (about 50 s on the H200 on 2026-12-04, plus cuda_synthetic_test)
#   50 s  the cluster (CPU reference + three transports)
#   50 s  compute-sanitizer memcheck on the kernel tests (GPU_CHECK_SANITIZER=1; off by default)
#   45 s  attention: attention_bench (≈ 5 s ceilings and start, 35 s of cases, its own budget)
#   35 s  bench: the 2-layer slice (2 processes, 2k with its prefill, 32k with a synthetic KV)
#  120 s  bench: 30 layers, 2k sweep (≈ 5 s start and fill, ≈ 7 s prefill, ≤ 6 s of steps plus a
#         warm-up step per batch: at today's ≈ 0.2 s/step at batch 1 and ≈ 6 s at batch 32)
#   35 s  bench: 30 layers, 32k (≈ 10 s host KV fill and upload, ≈ 2 s per step at batch 1;
#         batch 16 needs ≈ 230 GB of KV copies: reported skipped)
#  ≈ 380 s in all without the sanitizer (400 s deadline), inside 7 minutes; the steps left when the deadline comes are reported
#  SKIPPED, never overrun.
#
# Without a GPU (none found, or GPU_CHECK_DRY_RUN=1) the same steps run on the CPU where they can,
# each line marked "(dry run, cpu)": no build unless binaries are missing (BUILD_DIR defaults to
# build), the `gpu` tests that exist (they skip), the cluster with --device cpu over tcp, and the
# benchmarks on the tiny-v512 shape with small contexts (attention_bench_emu, engine_bench_emu:
# the emulated device where they are built). It checks the script, not the GPU.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPORT=$OUT/report.txt
# The logs of every step; packed into $OUT/logs.tar.gz at the end (the device tool brings back
# at most 8 files from $OUT).
LOGS=$OUT/logs
rm -rf "$LOGS" "$OUT/logs.tar.gz"
mkdir -p "$LOGS"
TOTAL_S=${GPU_CHECK_SECONDS:-400}
DEADLINE=$((SECONDS + TOTAL_S))
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dgserve_gpu_check.XXXXXX")
PID_FILE=$WORK/pids  # every background process this script started (subshells append too)
: > "$PID_FILE"
rc=0

report() { printf '%s\n' "$(printf '%s' "$*" | tr '\n' ' ')" | tee -a "$REPORT"; }  # one line each
FAILS=0
fail() { report "$*"; rc=1; FAILS=$((FAILS + 1)); }
# Seconds a step may take: at most $1, leaving $2 for the steps after it (never below 1).
budget() {
  local want=$1 left=$((DEADLINE - SECONDS - $2))
  ((left < want)) && want=$left
  ((want < 1)) && want=1
  echo "$want"
}
time_left() { echo $((DEADLINE - SECONDS)); }
# Ends the given PIDs (ours only): TERM, up to 5 s, then KILL.
stop_pids() {
  local p alive
  for p in "$@"; do kill -TERM "$p" 2>/dev/null; done
  for _ in $(seq 1 50); do
    alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    ((alive == 0)) && break
    sleep 0.1
  done
  for p in "$@"; do kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  return 0
}
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
  local all
  mapfile -t all < "$PID_FILE"
  ((${#all[@]} > 0)) && stop_pids "${all[@]}"
  rm -rf "$WORK"
  tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs 2>/dev/null && rm -rf "$LOGS"
}
trap cleanup EXIT
trap 'report "interrupted"; exit 130' INT TERM

: > "$REPORT"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')
report "dgserve gpu_check $(date -u +%FT%TZ), budget ${TOTAL_S}s, commit $commit"

# --- the machine ---------------------------------------------------------------------------------
NGPU=0
GPU_NAME=""
if timeout 20 nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1; then
  NGPU=$(timeout 10 nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  GPU_NAME=$(timeout 10 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  driver=$(grep -m1 -o 'Driver Version: [0-9.]*' "$LOGS/nvidia-smi.txt")
  report "nvidia-smi: $NGPU GPU(s): $GPU_NAME; $driver"
else
  report "nvidia-smi: not available"
fi
DRY=${GPU_CHECK_DRY_RUN:-0}
if [ "$NGPU" -lt 1 ] && [ "$DRY" != 1 ]; then
  report "no GPU found: running as a dry run on the CPU"
  DRY=1
fi
if [ "$DRY" = 1 ]; then
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}  # a shared CPU machine: no spinning threads
  DEVICE=cpu
  TAG=" (dry run, cpu)"
  BUILD_DIR=${BUILD_DIR:-build}
else
  DEVICE=cuda
  TAG=""
  BUILD_DIR=${BUILD_DIR:-build-gpu}
fi
case "$GPU_NAME" in
  *H200*) DEFAULT_BW=4800 ;;
  *H100*NVL*) DEFAULT_BW=3900 ;;
  *H100*) DEFAULT_BW=3350 ;;
  *) DEFAULT_BW=0 ;;
esac
BW=${GPU_MEM_BW_GBS:-$DEFAULT_BW}

# GPU_TESTS, CLUSTER_BINS, BENCH_BINS: the one list (tools/gpu_binaries.sh).
source tools/gpu_binaries.sh
# attention_bench exists only in a build with the CUDA kernels; the dry run runs
# attention_bench_emu where the tests are built, and builds neither.
[ "$DRY" = 1 ] || BENCH_BINS="$BENCH_BINS bench/attention_bench"
PER_TEST_S=${PER_TEST_S:-45}
# Time kept for the later steps while an earlier one runs.
RESERVE_TESTS=120
RESERVE_CLUSTER=90
RESERVE_BENCH=190  # the 2-layer slice and the full shape (see the budget above)
RESERVE_ATTN=45    # attention_bench (see the budget above)
RESERVE_LATER=$((RESERVE_ATTN + RESERVE_BENCH))  # what the steps before attention leave

# --- 1. build ------------------------------------------------------------------------------------
missing_of() {  # the binaries of "$@" not in BUILD_DIR, as target names
  local b
  for b in "$@"; do [ -x "$BUILD_DIR/$b" ] || basename "$b"; done
}
build_targets() {  # $1: what, $2: seconds, rest: target names
  local what=$1 limit=$2 t known=() unknown=()
  shift 2
  # Only targets this configuration has (kvstore_nccl_self_send_test needs NCCL; the cuda_*
  # tests need nvcc): one unknown target would fail the whole build command.
  for t in "$@"; do
    if grep -q -E "(^|[ /.])$t(:| |$)" "$WORK/targets.txt"; then known+=("$t"); else unknown+=("$t"); fi
  done
  ((${#unknown[@]} > 0)) && fail "build: no target ${unknown[*]} in $BUILD_DIR (see configure.log)"
  set -- "${known[@]}"
  [ $# -eq 0 ] && return 0
  local start=$SECONDS
  # shellcheck disable=SC2068
  if timeout "$limit" cmake --build "$BUILD_DIR" -j"$(nproc)" --target $@ >> "$LOGS/build.log" 2>&1; then
    report "build: $what built in $((SECONDS - start))s"
  else
    fail "build: $what failed or timed out after $((SECONDS - start))s (see build.log)"
  fi
}
# shellcheck disable=SC2086
need_tests=$(missing_of $GPU_TESTS | tr '\n' ' ')
# shellcheck disable=SC2086
need_cluster=$(missing_of $CLUSTER_BINS | tr '\n' ' ')
# shellcheck disable=SC2086
need_bench=$(missing_of $BENCH_BINS | tr '\n' ' ')
: > "$LOGS/build.log"
if [ -n "$need_tests$need_cluster$need_bench" ]; then
  configured=1
  if [ ! -f "$BUILD_DIR/build.ninja" ] && [ ! -f "$BUILD_DIR/Makefile" ]; then
    cuda_flags=()
    [ "$DRY" = 1 ] || cuda_flags=(-DCMAKE_CUDA_ARCHITECTURES=90 -DDGSERVE_CUDA_BACKEND=ON)
    gen=()
    command -v ninja > /dev/null && gen=(-G Ninja)
    timeout "$(budget 120 300)" cmake -S . -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      "${cuda_flags[@]}" > "$LOGS/configure.log" 2>&1 \
      || { fail "build: configure failed (see configure.log)"; configured=0; }
  fi
  if [ "$configured" = 1 ]; then
    timeout 60 cmake --build "$BUILD_DIR" --target help > "$WORK/targets.txt" 2>&1
    [ "$DRY" = 1 ] && need_tests=""  # the dry run runs the gpu tests that exist, builds none
    # shellcheck disable=SC2086
    build_targets "the gpu tests" \
      "$(budget 300 $((RESERVE_TESTS + RESERVE_CLUSTER + RESERVE_LATER)))" $need_tests
    # shellcheck disable=SC2086
    build_targets "the cluster" "$(budget 240 $((RESERVE_TESTS + RESERVE_CLUSTER)))" $need_cluster
    # shellcheck disable=SC2086
    build_targets "the benchmarks" "$(budget 120 $((RESERVE_TESTS + RESERVE_CLUSTER)))" $need_bench
  fi
  report "build: $(grep -c -i 'warning' "$LOGS/build.log") warning lines (see build.log)"
else
  report "build: all binaries present in $BUILD_DIR"
fi
if [ "${GPU_CHECK_BUILD_ONLY:-0}" = 1 ]; then
  report "GPU_CHECK_BUILD_ONLY: stopping after the build; exit $rc"
  exit $rc
fi
if [ -x "$BUILD_DIR/engine/cuda/cuda_ops_test" ]; then
  ldd "$BUILD_DIR/engine/cuda/cuda_ops_test" | grep "not found" > "$LOGS/missing_libraries.txt" \
    && report "missing shared libraries: $(tr '\n' ' ' < "$LOGS/missing_libraries.txt")"
fi

# --- 1b. calibrate: the two ceilings every later figure is judged against -------------------------
# engine_bench --calibrate_only: a 1 GiB device-to-device copy (GB/s, read + write) and an
# 8192³ bf16 cuBLAS GEMM (TFLOP/s); every full-shape run measures them again in its own process.
# The dry run calibrates the emulated device (engine_bench_emu, tiny sizes: no meaning).
calibrate_step() {
  local bin=$BUILD_DIR/bench/engine_bench args=(--device cuda --calibrate_only) line note=""
  if [ "$DRY" = 1 ]; then
    note=" (emulated device)"
    bin=$BUILD_DIR/bench/engine_bench_emu
    args+=(--calibrate_copy_mb 1 --calibrate_gemm_n 32)
  fi
  [ -x "$bin" ] || { report "calibrate: $(basename "$bin") missing in $BUILD_DIR: skipped$TAG"; return; }
  if timeout "$(budget 60 300)" "$bin" "${args[@]}" > "$LOGS/calibrate.log" 2>&1; then
    line=$(grep -m1 '^CEILINGS ' "$LOGS/calibrate.log")
    report "calibrate:$TAG ${line#CEILINGS }$note"
  else
    fail "calibrate: failed (see calibrate.log): $(tail -n 2 "$LOGS/calibrate.log" | cut -c1-300)"
  fi
}

# --- 2. the gpu tests ----------------------------------------------------------------------------
run_gtest() {  # $1: binary path relative to BUILD_DIR, $2: seconds
  local rel=$1 limit=$2 t status start last_run
  t=$(basename "$rel")
  local log="$LOGS/$t.log" bin="$BUILD_DIR/$rel"
  if [ ! -x "$bin" ]; then
    if [ "$DRY" = 1 ]; then report "SKIPPED $t: not built here$TAG"; else fail "MISSING $t"; fi
    return
  fi
  start=$SECONDS
  timeout "$limit" "$bin" --gtest_color=no > "$log" 2>&1
  status=$?
  # One line per finished test: "[       OK ] Suite.Name (12 ms)" and friends (the summary at
  # the end repeats names without the time; those lines are not matched).
  sed -n -E \
    -e "s/^\[       OK \] ([^ ]+) \(([0-9]+ ms)\)$/PASSED  $t \1 (\2)/p" \
    -e "s/^\[  FAILED  \] ([^ ]+) \(([0-9]+ ms)\)$/FAILED  $t \1 (\2)/p" \
    -e "s/^\[  SKIPPED \] ([^ ]+) \(([0-9]+ ms)\)$/SKIPPED $t \1 (\2)/p" "$log" |
    while read -r line; do report "$line$TAG"; done
  # Measurements a test prints (cuda_moe_test's "moe_bandwidth: key=value ...") go to the report.
  grep -E '^moe_bandwidth: ' "$log" | while read -r line; do report "$line$TAG"; done
  # A test that started but never finished: the binary crashed or ran out of time in it.
  last_run=$(grep -E '^\[ RUN      \] ' "$log" | tail -n 1 | sed -E 's/^\[ RUN      \] //')
  if [ -n "$last_run" ] && ! grep -q -E "^\[ *(OK|FAILED|SKIPPED) *\] $last_run( |$)" "$log"; then
    if [ "$status" = 124 ]; then report "TIMEOUT $t $last_run (after ${limit}s)"; else
      report "CRASHED $t $last_run (exit $status)"; fi
  fi
  report "$t: exit $status in $((SECONDS - start))s (log: $t.log)"
  [ "$status" = 0 ] || rc=1
}
# The steps after the build (GPU_CHECK_STEPS, default all: "calibrate tests cluster sanitizer
# attention bench").
STEPS=" ${GPU_CHECK_STEPS:-calibrate tests cluster sanitizer attention bench} "
wants() { [[ $STEPS == *" $1 "* ]]; }
wants calibrate && calibrate_step
tests_to_run=$GPU_TESTS
wants tests || tests_to_run=""
if [ "$NGPU" -ge 2 ] && wants tests; then  # two GPUs: NCCL is checked with two ranks in the cluster step
  tests_to_run=$(echo "$GPU_TESTS" | tr ' ' '\n' | grep -v nccl_self_send | tr '\n' ' ')
fi
num_left=$(echo "$tests_to_run" | wc -w)
for rel in $tests_to_run; do
  num_left=$((num_left - 1))
  run_gtest "$rel" "$(budget "$PER_TEST_S" $((num_left * 10 + RESERVE_CLUSTER + RESERVE_LATER)))"
done
count() { grep -c -E "$1" "$REPORT"; }
wants tests && report "gpu tests: $(count '^PASSED') passed, $(count '^FAILED') failed, $(count '^SKIPPED') skipped," \
  "$(count '^(CRASHED|TIMEOUT|MISSING)') crashed/timed out/missing$TAG"

# --- 3. the cluster ------------------------------------------------------------------------------
# Waits (at most $4 s) for the ports file $1 of process $2 (log $3); prints its gRPC port.
wait_ports() {
  local file=$1 pid=$2 log=$3 limit=$4 end=$((SECONDS + $4))
  while ((SECONDS < end)); do
    if [ -s "$file" ]; then sed -E 's/.*"grpc":([0-9]+).*/\1/' "$file"; return 0; fi
    kill -0 "$pid" 2>/dev/null || { echo "process exited: $(tail -n 3 "$log" | tr '\n' ' ')" >&2; return 1; }
    sleep 0.1
  done
  echo "no ports file after ${limit}s" >&2
  return 1
}
MODEL=$WORK/tiny-v512
make_model() {
  [ -f "$MODEL/model.safetensors" ] && return 0
  local src=tests/testdata/golden/tiny-v512
  printf '%s' '{"max_denoising_steps": 8, "max_new_tokens": 32, "t_min": 0.4, "t_max": 0.8,
    "stability_threshold": 1, "confidence_threshold": 0.005, "pad_token_id": 0,
    "eos_token_id": [1, 106, 50], "sampler_config": {"entropy_bound": 0.1}}' > "$WORK/gen.json"
  timeout 60 "$BUILD_DIR/tools/dgserve-mkmodel" --out "$MODEL" --seed 512 --config "$src/config.json" \
    --tokenizer "$src/tokenizer.json" --generation_config "$WORK/gen.json" > "$LOGS/mkmodel.log" 2>&1
}
# Seeded and nearly greedy (the API has no greedy mode: temperature is the sampler's schedule,
# here 0.02 → 0.01, so each position's sample is its argmax unless two logits are within a few
# hundredths of each other).
# Streamed with every denoising step's canvas (canvas_step_interval 1), so that the comparison
# is of token ids at every step, not only of the decoded text.
REQUEST='{"prompt": "The capital of France is", "max_tokens": 24, "seed": 11, "t_min": 0.01,
  "t_max": 0.02, "stream": true, "canvas_step_interval": 1}'
# Starts a cluster (name $1, device $2, kv transport $3, then env assignments for the prefill
# and denoise workers in $4 and $5), sends REQUEST, writes the token ids of every canvas step
# (one line each) to $WORK/$1.text, stops the cluster. Bounded by $6 seconds. Returns non-zero (with a reason on stderr) on failure.
run_cluster() {
  local name=$1 device=$2 transport=$3 penv=$4 denv=$5 limit=$6
  local end=$((SECONDS + limit)) dir=$WORK/$name mine=() dport pport http
  mkdir -p "$dir"
  local common=(--model "$MODEL" --internal_insecure)
  local gemm=(--cpu_gemm_input "${GPU_CHECK_CLUSTER_GEMM_INPUT:-bf16}"
    --cuda_gemm_input "${GPU_CHECK_CLUSTER_GEMM_INPUT:-bf16}")
  # --metrics_address= : no Prometheus exposer. prometheus-cpp's civetweb cannot start in a
  # binary that links cuBLAS 13 (top-level CMakeLists.txt), and the workers here link it.
  # shellcheck disable=SC2086
  env $denv "$BUILD_DIR/denoise_worker/dgserve-denoise-worker" "${common[@]}" "${gemm[@]}" \
    --device "$device" --metrics_address= --ports_file "$dir/denoise.ports" > "$LOGS/$name.denoise.log" 2>&1 &
  mine+=($!); echo $! >> "$PID_FILE"
  dport=$(wait_ports "$dir/denoise.ports" "${mine[0]}" "$LOGS/$name.denoise.log" $((end - SECONDS))) \
    || { echo "denoise worker did not start" >&2; stop_pids "${mine[@]}"; return 1; }
  # shellcheck disable=SC2086
  env $penv "$BUILD_DIR/prefill_worker/dgserve-prefill-worker" "${common[@]}" "${gemm[@]}" \
    --device "$device" --kv_transport "$transport" --denoise_workers "127.0.0.1:$dport" --metrics_address= \
    --ports_file "$dir/prefill.ports" > "$LOGS/$name.prefill.log" 2>&1 &
  mine+=($!); echo $! >> "$PID_FILE"
  pport=$(wait_ports "$dir/prefill.ports" "${mine[1]}" "$LOGS/$name.prefill.log" $((end - SECONDS))) \
    || { echo "prefill worker did not start" >&2; stop_pids "${mine[@]}"; return 1; }
  "$BUILD_DIR/gateway/dgserve-gateway" "${common[@]}" --prefill_workers "127.0.0.1:$pport" \
    --denoise_workers "127.0.0.1:$dport" --grpc_address 127.0.0.1:0 --http_address 127.0.0.1:0 \
    --metrics_address= --ports_file "$dir/gateway.ports" > "$LOGS/$name.gateway.log" 2>&1 &
  mine+=($!); echo $! >> "$PID_FILE"
  wait_ports "$dir/gateway.ports" "${mine[2]}" "$LOGS/$name.gateway.log" $((end - SECONDS)) > /dev/null \
    || { echo "gateway did not start" >&2; stop_pids "${mine[@]}"; return 1; }
  http=$(sed -E 's/.*"http":([0-9]+).*/\1/' "$dir/gateway.ports")
  while ((SECONDS < end)) && ! curl -sf --max-time 2 "http://127.0.0.1:$http/ready" > /dev/null; do
    sleep 0.2
  done
  local t=$((end - SECONDS))
  ((t < 1)) && t=1
  if ! curl -sS --max-time "$t" -H 'Content-Type: application/json' -d "$REQUEST" \
      "http://127.0.0.1:$http/v1/completions" > "$dir/response.json" 2> "$dir/curl.err"; then
    echo "request failed: $(cat "$dir/curl.err")" >&2
    stop_pids "${mine[@]}"
    return 1
  fi
  cp "$dir/response.json" "$LOGS/$name.response.sse"
  stop_pids "${mine[@]}"
  grep -o '"token_ids":\[[-0-9,]*\]' "$dir/response.json" > "$WORK/$name.text"
  if [ ! -s "$WORK/$name.text" ] || ! grep -q '^data: \[DONE\]' "$dir/response.json"; then
    echo "no canvas steps or no end of stream: $(head -c 300 "$dir/response.json")" >&2
    return 1
  fi
  return 0
}
# "MATCH (N canvas steps)" or "DIFFERS from canvas step N on": the token ids of clusters $1, $2.
compare_texts() {
  if cmp -s "$WORK/$1.text" "$WORK/$2.text"; then
    echo "MATCH ($(wc -l < "$WORK/$1.text") canvas steps)"
    return 0
  fi
  local n
  n=$(cmp "$WORK/$1.text" "$WORK/$2.text" 2>&1 | sed -n -E 's/.*line ([0-9]+).*/\1/p')
  echo "DIFFERS from canvas step ${n:-? (one stream is a prefix of the other)} on" \
    "($(wc -l < "$WORK/$1.text") and $(wc -l < "$WORK/$2.text") steps)"
  return 1
}
# The last canvas step's token ids (the end of the stream), shortened.
show() { tail -n 1 "$WORK/$1.text" | cut -c1-90; }
transport_line() {  # the transport the prefill worker chose ("KV to T over X"), if it logged one
  local line
  line=$(grep -m1 -E 'KV to .* over ' "$LOGS/$1.prefill.log" | sed -E 's/.*(KV to .*)/\1/')
  echo "${line:-no KV transport logged}" | cut -c1-160
}

cluster_step() {
  local step_end=$((DEADLINE - RESERVE_LATER))
  # shellcheck disable=SC2086
  if [ -n "$(missing_of $CLUSTER_BINS)" ]; then fail "cluster: binaries missing in $BUILD_DIR"; return; fi
  command -v curl > /dev/null || { fail "cluster: SKIPPED, curl not found"; return; }
  make_model || { fail "cluster: dgserve-mkmodel failed (see mkmodel.log)"; return; }
  local err
  if err=$(run_cluster cpu cpu tcp "" "" "$(budget 40 $((DEADLINE - step_end + 60)))" 2>&1); then
    report "cluster: cpu/tcp reference: PASS, last step $(show cpu)"
  else
    fail "cluster: cpu/tcp reference: FAILED: $err"
  fi
  local transports=${GPU_CHECK_TRANSPORTS:-cuda_ipc auto tcp}
  [ "$DRY" = 1 ] && transports=${GPU_CHECK_TRANSPORTS:-tcp}
  local tr name first=""
  for tr in $transports; do
    name="${DEVICE}_$tr"
    if ((SECONDS + 10 > step_end)); then fail "cluster: $name: SKIPPED, no time left"; continue; fi
    if err=$(run_cluster "$name" "$DEVICE" "$tr" "" "" "$(budget 60 $((DEADLINE - step_end)))" 2>&1); then
      report "cluster: $name$TAG: PASS, last step $(show "$name");" \
        "vs cpu: $(compare_texts cpu "$name"); $(transport_line "$name")"
      if [ -z "$first" ]; then
        first=$name
      else  # the same device, another transport: the KV bytes and so the text must be identical
        compare_texts "$first" "$name" > /dev/null \
          || fail "cluster: $name$TAG: FAILED: tokens differ from $first (same device, other" \
            "transport)"
      fi
    else
      fail "cluster: $name$TAG: FAILED: $err"
    fi
  done
  if [ "$NGPU" -ge 2 ]; then  # NCCL with two ranks: prefill on GPU 0, denoise on GPU 1
    name=cuda_nccl_2gpu
    if err=$(run_cluster "$name" cuda nccl "CUDA_VISIBLE_DEVICES=0" "CUDA_VISIBLE_DEVICES=1" \
        "$(budget 60 $((DEADLINE - step_end)))" 2>&1); then
      report "cluster: $name: PASS, last step $(show "$name");" \
        "vs cpu: $(compare_texts cpu "$name"); $(transport_line "$name")"
      if [ -n "$first" ]; then
        compare_texts "$first" "$name" > /dev/null \
          || fail "cluster: $name: FAILED: tokens differ from $first (other transport)"
      fi
    else
      fail "cluster: $name: FAILED: $err"
    fi
  elif [ "$DRY" != 1 ]; then
    report "cluster: one GPU: NCCL checked by kvstore_nccl_self_send_test above (two ranks need two GPUs)"
  fi
}
wants cluster && cluster_step

# --- 3b. compute-sanitizer (GPU_CHECK_SANITIZER=1) -------------------------------------------------
# memcheck on the kernel tests: out-of-bounds and misaligned device accesses, which neither the
# emulation nor a comparison with the CPU can see. One line per binary: its error summary.
sanitizer_step() {
  local san t rel limit summary tool
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null)
  [ -n "$san" ] || { report "sanitizer: compute-sanitizer not found"; return; }
  local filter
  for rel in engine/cuda/cuda_ops_test engine/cuda/cuda_gemm_test engine/cuda/cuda_attention_test \
      engine/cuda/cuda_attention_tc_test engine/cuda/cuda_vocab_test \
      engine/cuda/cuda_soft_embed_test \
      engine/cuda/cuda_backend_kernels_test engine/cuda/cuda_mma_test \
      engine/cuda/cuda_moe_test engine/cuda/cuda_moe_w4a16_test engine/cuda/cuda_nvfp4_test \
      engine/cuda/cuda_fp8_test \
      engine/cuda/cuda_synthetic_test; do
    t=$(basename "$rel")
    filter='*'
    [ "$t" = cuda_synthetic_test ] && filter='CudaTest.Fill*'  # the weight-fill kernels
    [ -x "$BUILD_DIR/$rel" ] || continue
    if (($(time_left) < RESERVE_LATER + 15)); then report "sanitizer: $t: SKIPPED, no time left"; continue; fi
    for tool in ${GPU_CHECK_SANITIZER_TOOLS:-memcheck}; do
      limit=$(budget 30 "$RESERVE_LATER")
      timeout "$limit" "$san" --tool "$tool" "$BUILD_DIR/$rel" --gtest_color=no \
        --gtest_filter="$filter" > "$LOGS/$t.$tool.log" 2>&1
      local status=$?
      summary=$(grep -m1 'ERROR SUMMARY' "$LOGS/$t.$tool.log" | sed 's/^=* *//')
      if [ "$status" = 124 ]; then report "sanitizer: $t: $tool TIMEOUT after ${limit}s"
      elif [ "$summary" = "ERROR SUMMARY: 0 errors" ]; then report "sanitizer: $t: $tool $summary"
      else fail "sanitizer: $t: $tool exit $status: ${summary:-no summary} (see $t.$tool.log)"; fi
    done
  done
}
[ "${GPU_CHECK_SANITIZER:-0}" = 1 ] && [ "$DRY" != 1 ] && wants sanitizer && sanitizer_step

# --- 3c. the attention kernels alone (issue 34 item 5) ---------------------------------------------
# bench/attention_bench on the full shape's attention: canvas attention (sliding and full layers,
# 2k / 32k / 128k context, batch 1 and 16) and the causal prefill of a 32k-token prompt (in the
# backend's 8192-token chunks, and whole), tensor-core kernels first, float32 after them. Every
# ATTN line is reported ("attention: kernel=... ms=... tflops=... pct_gemm=... gbs=... pct_copy=...
# status=ok|skipped|failed"), with the CEILINGS line the rates are judged against. The program
# stops starting cases at --device_budget_s (GPU_CHECK_ATTN_SECONDS, default 35); the step's
# timeout leaves room for its start and ceilings. The dry run: attention_bench_emu (the emulated
# device) on the tiny-v512 shape with tiny contexts, where the tests are built.
attention_step() {
  local bin=$BUILD_DIR/bench/attention_bench note="" attn_s=${GPU_CHECK_ATTN_SECONDS:-35}
  # shellcheck disable=SC2054  # commas inside flag values
  local args=(--config bench/configs/diffusiongemma-26b-a4b.json
    --kernels tc_canvas,tc_prefill,f32_canvas,f32_prefill --layers sliding,full
    --contexts 2048,32768,131072 --batches 1,16 --prompt 32768 --prefill_chunks 8192,0 --reps 5)
  if [ "$DRY" = 1 ]; then
    bin=$BUILD_DIR/bench/attention_bench_emu
    note=" (emulated device)"
    attn_s=20
    # shellcheck disable=SC2054
    args=(--config tests/testdata/golden/tiny-v512/config.json --contexts 0,20,40 --batches 1,2
      --prompt 24 --prefill_chunks 8,0 --reps 2 --calibrate_copy_mb 1 --calibrate_gemm_n 32)
  fi
  if [ ! -x "$bin" ]; then
    if [ "$DRY" = 1 ]; then
      report "attention: attention_bench_emu not built in $BUILD_DIR: skipped$TAG"
    else
      fail "attention: attention_bench missing in $BUILD_DIR"
    fi
    return
  fi
  if (($(time_left) < RESERVE_BENCH + 20)); then
    fail "attention: SKIPPED, $(time_left)s left"
    return
  fi
  local limit dev_s start=$SECONDS status line
  limit=$(budget $((attn_s + 25)) "$RESERVE_BENCH")
  dev_s=$((limit - 20))  # the cases' budget: the step's limit less start-up and ceilings
  ((dev_s > attn_s)) && dev_s=$attn_s
  ((dev_s < 5)) && dev_s=5
  echo "=== attention (limit ${limit}s): $bin ${args[*]} --device_budget_s $dev_s" >> "$LOGS/attention.log"
  timeout "$limit" "$bin" "${args[@]}" --device_budget_s "$dev_s" > "$WORK/attention.out" \
    2> "$WORK/attention.err"
  status=$?
  cat "$WORK/attention.out" "$WORK/attention.err" >> "$LOGS/attention.log"
  line=$(grep -m1 '^CEILINGS ' "$WORK/attention.out")
  [ -n "$line" ] && report "attention:$TAG ceilings ${line#CEILINGS }$note"
  while read -r line; do
    report "attention:$TAG ${line#ATTN }"
  done < <(grep '^ATTN ' "$WORK/attention.out")
  if [ "$status" = 124 ]; then
    fail "attention: TIMEOUT after ${limit}s (the lines above were printed before it)"
  elif [ "$status" != 0 ]; then
    fail "attention: FAILED (exit $status after $((SECONDS - start))s):" \
      "$(tail -n 2 "$WORK/attention.err" | cut -c1-300)"
  else
    report "attention: $(grep -c '^ATTN .*status=ok' "$WORK/attention.out") cases timed," \
      "$(grep -c '^ATTN .*status=skipped' "$WORK/attention.out") skipped in $((SECONDS - start))s$TAG"
  fi
}
wants attention && attention_step

# --- 4. the real-shape benchmarks ----------------------------------------------------------------
# Runs engine_bench once ($1: a label without spaces, $2: seconds, then its arguments): every RESULT line is
# reported, every PHASE line goes to the kernel table ($WORK/phases.txt); a failure is reported
# with the last lines of its standard error.
bench_run() {
  local label=$1 limit=$2 start=$SECONDS status line
  shift 2
  echo "=== $label (limit ${limit}s): $*" >> "$LOGS/bench.log"
  timeout "$limit" "$@" > "$WORK/bench.one" 2> "$WORK/bench.err"
  status=$?
  cat "$WORK/bench.one" "$WORK/bench.err" >> "$LOGS/bench.log"
  while read -r line; do
    report "bench: $label:$TAG ${line#RESULT }"
  done < <(grep '^RESULT ' "$WORK/bench.one")
  grep '^PHASE ' "$WORK/bench.one" | sed "s/^PHASE /$label /" >> "$WORK/phases.txt"
  if [ "$status" = 124 ]; then
    fail "bench: $label: TIMEOUT after ${limit}s"
  elif [ "$status" != 0 ]; then
    fail "bench: $label: FAILED (exit $status after $((SECONDS - start))s):" \
      "$(tail -n 2 "$WORK/bench.err" | cut -c1-300)"
  fi
  return "$status"
}
bench_step() {
  local bin=$BUILD_DIR/bench/engine_bench
  [ -x "$bin" ] || { fail "bench: engine_bench missing in $BUILD_DIR"; return; }
  : > "$WORK/phases.txt"
  local smi_pid=""
  if [ "$DRY" != 1 ]; then
    timeout "$(time_left)" nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits \
      -lms 250 > "$LOGS/gpu_memory.csv" 2>/dev/null &
    smi_pid=$!
    echo "$smi_pid" >> "$PID_FILE"
  fi
  # The GEMM input of the runs (--cuda_gemm_input; the issue-33 targets are for bf16
  # activations, float32 is the check mode): GPU_CHECK_GEMM_INPUTS, default bf16.
  local inputs=${GPU_CHECK_GEMM_INPUTS:-bf16} g steps=${GPU_CHECK_BENCH_STEPS:-16}
  local common=(--synthetic --steps "$steps" --mem_bandwidth_gbs "$BW" --phase_timing)
  local slice=bench/configs/real-width-2-layers.json full=bench/configs/diffusiongemma-26b-a4b.json
  local ctx_short=2048 ctx_long=32768 sweep=1,2,4,8,16,32 long_batches=1,16 dev=(--device "$DEVICE")
  if [ "$DRY" = 1 ]; then  # the script's path on the CPU: a tiny shape, small contexts
    slice=tests/testdata/golden/tiny-v512/config.json
    ctx_short=64 ctx_long=256 steps=2
    common=(--synthetic --steps 2 --mem_bandwidth_gbs "$BW")
    inputs=float32
  fi
  for g in $inputs; do
    # The real-width 2-layer slice (issue 5's reference runs), a batch 1 and 16 per context.
    if (($(time_left) < 60)); then
      fail "bench: 2-layer slice gemm_input $g: SKIPPED, $(time_left)s left"
    else
      if [ "$DRY" = 1 ]; then
        bench_run "tiny-${ctx_short}" "$(budget 120 30)" "$bin" "${dev[@]}" --config "$slice" \
          --context "$ctx_short" --batches 1,16 "${common[@]}"
      else
        bench_run "slice-2k-$g" "$(budget 60 30)" "$bin" "${dev[@]}" --config "$slice" \
          --context "$ctx_short" --batches 1,16 --cuda_gemm_input "$g" "${common[@]}"
        bench_run "slice-32k-$g" "$(budget 60 30)" "$bin" "${dev[@]}" --config "$slice" \
          --context "$ctx_long" --batches 1,16 --synthetic_kv --cuda_gemm_input "$g" "${common[@]}"
      fi
    fi
    # The full 30-layer shape, weights generated on the device (no checkpoint): the batch sweep
    # at 2k (real prefill) and batch 1 and 16 at 32k (synthetic KV cache) where memory allows.
    if [ "${GPU_CHECK_FULL_SHAPE:-1}" != 1 ]; then
      report "bench: full 30-layer shape: not run (GPU_CHECK_FULL_SHAPE=0)"
    elif (($(time_left) < 90)); then
      fail "bench: full 30-layer shape gemm_input $g: SKIPPED, $(time_left)s left (needs about 150)"
    elif [ "$DRY" = 1 ]; then  # the CPU cannot hold 30 layers: the sweep's path on the tiny shape
      bench_run "tiny-sweep-${ctx_long}" "$(budget 200 10)" "$bin" "${dev[@]}" \
        --config "$slice" --context "$ctx_long" --batches "$sweep" --step_budget_s 2 \
        "${common[@]}"
    else
      # First the step as served: CUDA graphs replayed (the sweep below times phases with
      # events, which runs every step eagerly).
      bench_run "full-2k-graphs-$g" "$(budget 50 120)" "$bin" "${dev[@]}" --config "$full" \
        --context "$ctx_short" --batches 1,16 --steps "$steps" --step_budget_s 4 \
        --synthetic_kv --cuda_gemm_input "$g" --synthetic --mem_bandwidth_gbs "$BW"
      bench_run "full-2k-$g" "$(budget 150 40)" "$bin" "${dev[@]}" --config "$full" \
        --context "$ctx_short" --batches "$sweep" --step_budget_s 6 --cuda_gemm_input "$g" \
        "${common[@]}"
      bench_run "full-32k-$g" "$(budget 90 5)" "$bin" "${dev[@]}" --config "$full" \
        --context "$ctx_long" --batches "$long_batches" --steps 4 --step_budget_s 8 \
        --synthetic_kv --cuda_gemm_input "$g" --synthetic --mem_bandwidth_gbs "$BW" --phase_timing \
        --cuda_tensor_core_attention=false
      # The same at 32k with the attention on the tensor cores (bf16 Q/K/V, the bf16 device KV
      # mirror: issue 34, the default): its phase_attn_ms and kv_device_bytes_per_seq against the
      # float32-attention run above.
      # (Only in the bf16 GEMM-input mode: float32 mode always runs the float32 kernels.)
      if [ "$g" != bf16 ]; then
        :
      elif (($(time_left) < 60)); then
        fail "bench: full-32k tensor-core attention gemm_input $g: SKIPPED, $(time_left)s left"
      else
        bench_run "full-32k-tc-$g" "$(budget 90 5)" "$bin" "${dev[@]}" --config "$full" \
          --context "$ctx_long" --batches "$long_batches" --steps 4 --step_budget_s 8 \
          --synthetic_kv --cuda_gemm_input "$g" --synthetic --mem_bandwidth_gbs "$BW" \
          --phase_timing --cuda_tensor_core_attention
        # The same with per-sequence K/V arrays instead of the device block pool (its block
        # tables in the attention kernels: phase_attn_ms against the run above).
        if (($(time_left) >= 90)); then
          bench_run "full-32k-tc-arrays-$g" "$(budget 90 5)" "$bin" "${dev[@]}" --config "$full" \
            --context "$ctx_long" --batches 16 --steps 4 --step_budget_s 8 --synthetic_kv \
            --cuda_gemm_input "$g" --synthetic --mem_bandwidth_gbs "$BW" --phase_timing \
            --cuda_tensor_core_attention --cuda_kv_block_size 0
        fi
      fi
    fi
  done
  # The emulated CUDA backend on the CPU (dry run only): --device cuda end to end on the tiny
  # shape: the synthetic device weights, the counters, the phase timer, the ceilings.
  if [ "$DRY" = 1 ]; then
    if [ -x "$BUILD_DIR/bench/engine_bench_emu" ]; then
      bench_run "emu-cuda-tiny" "$(budget 120 5)" "$BUILD_DIR/bench/engine_bench_emu" \
        --device cuda --config tests/testdata/golden/tiny-v512/config.json --synthetic \
        --context 64 --batches 1,2 --steps 2 --phase_timing --calibrate_copy_mb 1 \
        --calibrate_gemm_n 32 --cuda_gemm_input bf16 --cuda_tensor_core_attention=false
      bench_run "emu-cuda-tiny-graphs" "$(budget 120 5)" "$BUILD_DIR/bench/engine_bench_emu" \
        --device cuda --config tests/testdata/golden/tiny-v512/config.json --synthetic \
        --context 64 --batches 1,2 --steps 4 --calibrate_copy_mb 1 --calibrate_gemm_n 32 \
        --cuda_graphs
      bench_run "emu-cuda-tiny-tc" "$(budget 120 5)" "$BUILD_DIR/bench/engine_bench_emu" \
        --device cuda --config tests/testdata/golden/tiny-v512/config.json --synthetic \
        --context 64 --batches 1,2 --steps 2 --calibrate_copy_mb 1 --calibrate_gemm_n 32 \
        --cuda_tensor_core_attention
    else
      report "bench: engine_bench_emu not built in $BUILD_DIR: the emulated --device cuda run skipped$TAG"
    fi
  fi
  # The kernel table: each phase's CUDA-event time, what it reads and computes, and the share
  # of the measured ceilings (copy bandwidth, bf16 GEMM).
  if [ -s "$WORK/phases.txt" ]; then
    report "table: run | batch context phase ms GB GB/s %copy TFLOP/s %gemm$TAG"
    while read -r line; do
      report "table: $(echo "$line" | sed -E 's/ (batch|context|phase|ms|gb|gbs|pct_copy|tflops|pct_gemm)=/ /g')"
    done < "$WORK/phases.txt"
  fi
  if [ -n "$smi_pid" ]; then
    stop_pids "$smi_pid"
    local peak
    peak=$(awk -F', *' '$2 + 0 > m { m = $2 + 0 } END { print m + 0 }' "$LOGS/gpu_memory.csv")
    report "bench: peak device memory in use (nvidia-smi, every 250 ms): ${peak} MiB"
  fi
}
wants bench && bench_step

report "gpu_check: done in ${SECONDS}s of ${TOTAL_S}s;" \
  "$((FAILS + $(count '^(FAILED|CRASHED|TIMEOUT)'))) failures; exit $rc$TAG"
exit $rc
