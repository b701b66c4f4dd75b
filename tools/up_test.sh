#!/usr/bin/env bash
# tools/up.sh's exit status on stubs (no build, no cluster): `bash` and `cmake` on PATH stand in
# for tools/setup.sh, the build and tools/cluster.sh (which writes cluster.env), and a fake
# BUILD_DIR/tools/dgserve exits with $FAKE_RC. The Sudoku demo passes only when the answer is
# solved (dgserve sudoku exit 0); a wrong answer (2) or an error (1) fails it with a message; the
# chat request is unchanged. A bad puzzle is refused before the cluster is touched; only a
# cluster up.sh started is restarted.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
REAL_BASH=$(command -v bash)
fails=0
mkdir -p "$T/bin" "$T/build/tools" "$T/run"
: > "$T/build/build.ninja"
cat > "$T/bin/bash" <<EOF
#!$REAL_BASH
case "\${1:-}" in
  tools/setup.sh) exit 0 ;;
  tools/cluster.sh)
    echo "cluster.sh \${*:2}" >> "\$RUN_DIR/calls"
    printf 'GATEWAY_GRPC=127.0.0.1:1\nGATEWAY_HTTP=127.0.0.1:2\nGATEWAY_METRICS=127.0.0.1:3\nPREFILL0_METRICS=127.0.0.1:4\nDENOISE0_METRICS=127.0.0.1:5\nSTARTED_BY=%s\n' "\$CLUSTER_STARTED_BY" > "\$RUN_DIR/cluster.env" ;;
  *) exec $REAL_BASH "\$@" ;;
esac
EOF
printf '#!/bin/sh\nexit 0\n' > "$T/bin/cmake"
cat > "$T/build/tools/dgserve" <<'EOF'
#!/bin/sh
if [ "$2" = --check ]; then  # dgserve sudoku --check: $CHECK_RC (0: the puzzle is valid)
  [ "${CHECK_RC:-0}" = 0 ] || echo "error: INVALID_ARGUMENT: bad puzzle: conflicting givens" >&2
  exit "${CHECK_RC:-0}"
fi
echo "dgserve $1"
[ "$FAKE_RC" = 2 ] && echo "not solved: row 1 has two 5s"
exit "$FAKE_RC"
EOF
chmod +x "$T/bin/bash" "$T/bin/cmake" "$T/build/tools/dgserve"
up() {  # $1: the fake dgserve's exit status, rest: up.sh's arguments; stdout+stderr in $T/out
  local rc=$1
  shift
  CHECK_RC=${CHECK_RC:-0} FAKE_RC=$rc PATH="$T/bin:$PATH" BUILD_DIR=$T/build RUN_DIR=$T/run "$REAL_BASH" tools/up.sh "$@" \
    > "$T/out" 2>&1
}
expect() {  # $1: description, $2: the exit status up.sh must give, $3: a regex its output must match
  local what=$1 want=$2 re=$3 got=0
  shift 3
  up "$@" || got=$?
  if [ "$got" = "$want" ] && grep -Eq "$re" "$T/out"; then
    echo "ok: $what"
  else
    echo "FAILED: $what (exit $got, want $want and /$re/):"
    sed 's/^/  | /' "$T/out"
    fails=$((fails + 1))
  fi
}
expect "a solved puzzle exits 0" 0 "the cluster keeps running" 0
expect "a wrong answer exits 2 and says the demo failed" 2 \
  "up.sh: FAILED: the cluster answered, but the answer does not solve the puzzle" 2
expect "a failed request exits 1" 1 "up.sh: FAILED: the Sudoku request failed .dgserve sudoku exit 1" 1
expect "the chat request exits 0" 0 "dgserve chat" 0 --chat
expect "-h prints the usage and exits 0" 0 "bash tools/up.sh --chat .PROMPT." 0 -h
expect "an unknown option exits 2 before anything starts" 2 "^up.sh: unknown option '--samples'" 0 \
  --samples 8
expect "two arguments exit 2" 2 "one PUZZLE or --chat PROMPT, got 2 arguments" 0 \
  .84561.3.65.7...2...7...15.7.8...3..39..5.2.....37..48.7.6.541..2.4.36...6..87... 8
expect "a puzzle of the wrong shape exits 1 before the cluster starts" 1 \
  "^up.sh: a puzzle is 81 cells.*\(5 cells after removing layout characters\)" 0 12345
# Nothing ran for the refused ones: the last run's output has no cluster line.
if grep -q "cluster up" "$T/out"; then
  echo "FAILED: a refused puzzle started the cluster"
  fails=$((fails + 1))
fi
# A refused puzzle leaves the running cluster alone: cluster.sh is not called.
no_cluster_call() {  # $1: description
  if [ -s "$T/run/calls" ]; then
    echo "FAILED: $1 called $(cat "$T/run/calls")"
    fails=$((fails + 1))
  fi
}
GOOD=.84561.3.65.7...2...7...15.7.8...3..39..5.2.....37..48.7.6.541..2.4.36...6..87...
# An explicitly empty prompt is refused (it sent the default prompt) before the cluster is touched.
rm -f "$T/run/calls"
expect "an empty --chat prompt exits 2" 2 "^up.sh: --chat PROMPT: the prompt is empty" 0 --chat ""
no_cluster_call "an empty --chat prompt"
expect "a blank --chat prompt exits 2" 2 "^up.sh: --chat PROMPT: the prompt is empty" 0 --chat " "
rm -f "$T/run/calls"
expect "80 cells are refused" 1 "^up.sh: a puzzle is 81 cells.*\(80 cells after removing" 0 \
  "${GOOD:1}"
no_cluster_call "80 cells"
expect "letters are refused" 1 "^up.sh: a puzzle is 81 cells.*the running cluster, if any, is left alone" 0 \
  "x${GOOD:1}"
no_cluster_call "letters"
CHECK_RC=1 expect "conflicting givens (dgserve sudoku --check) are refused before the cluster" 1 \
  "^error: INVALID_ARGUMENT: bad puzzle: conflicting givens" 0 "${GOOD/.84/884}"
grep -q "^up.sh: refused the puzzle (error above); the running cluster, if any, is left alone" \
  "$T/out" || { echo "FAILED: no up.sh line for the refused puzzle"; fails=$((fails + 1)); }
no_cluster_call "conflicting givens"
# The layout dgserve sudoku reads (rows apart, '|' between boxes) is a puzzle too.
expect "a puzzle with layout characters is accepted" 0 "the cluster keeps running" 0 \
  "${GOOD:0:27} | ${GOOD:27:27} | ${GOOD:54:27}"
# A cluster up.sh left running is restarted; one started by cluster.sh alone is not (cluster.sh
# refuses it).
rm -f "$T/run/calls"
echo STARTED_BY=up.sh > "$T/run/cluster.env"
expect "a cluster up.sh left running is restarted" 0 "the cluster keeps running" 0
grep -q -- "^cluster.sh start --restart " "$T/run/calls" ||
  { echo "FAILED: up.sh did not pass --restart: $(cat "$T/run/calls")"; fails=$((fails + 1)); }
rm -f "$T/run/calls"
echo STARTED_BY=cluster.sh > "$T/run/cluster.env"
expect "a cluster cluster.sh started is not replaced" 0 "the cluster keeps running" 0
grep -q -- "--restart" "$T/run/calls" &&
  { echo "FAILED: up.sh passed --restart for cluster.sh's cluster"; fails=$((fails + 1)); }
if [ "$fails" -ne 0 ]; then
  echo "up_test: $fails failed"
  exit 1
fi
echo "up_test: all passed"
