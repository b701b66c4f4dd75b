#!/usr/bin/env bash
# README command 1: installs and builds if needed, starts the local cluster on loopback —
# gateway, one prefill worker, one denoise worker, as separate processes — with the embedded
# default model, sends it a real request, prints the answer and leaves the cluster running.
#
#   bash tools/up.sh [PUZZLE]          the Sudoku model (models/sudoku, trained by the project,
#                                      in the repository) solves PUZZLE (81 characters, '.' for
#                                      blanks; default: a held-out test puzzle), the grid
#                                      rendered as its canvas converges; exit 2 when the
#                                      answer does not solve it (the cluster keeps running)
#   bash tools/up.sh --chat [PROMPT]   the random tiny-g3 model (models/default, generated with
#                                      the real Gemma tokenizer) answers a chat request (PROMPT
#                                      left out: a default one; an empty PROMPT is refused)
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '6,13p' "$0" | sed 's/^# \{0,1\}//'; }
MODE=sudoku
case "${1:-}" in
  -h | --help)
    usage
    exit 0
    ;;
  --chat) MODE=chat && shift ;;
  -*)
    echo "up.sh: unknown option '$1' (more choices, e.g. --samples: build/tools/dgserve sudoku --help)" >&2
    usage >&2
    exit 2
    ;;
esac
if [ $# -gt 1 ]; then
  echo "up.sh: one PUZZLE or --chat PROMPT, got $# arguments (quote a prompt; more choices, e.g." \
    "--samples: build/tools/dgserve sudoku --help against the running cluster)" >&2
  usage >&2
  exit 2
fi
# PROMPT is optional: left out, the default prompt is sent; an empty one is refused (a chat turn
# with no text), before anything is built or started.
if [ "$MODE" = chat ] && [ $# -eq 1 ] && [ -z "${1//[[:space:]]/}" ]; then
  echo "up.sh: --chat PROMPT: the prompt is empty; give some text, or leave PROMPT out for the" \
    "default prompt; the running cluster, if any, is left alone" >&2
  exit 2
fi
# A puzzle is checked before anything is installed, built, stopped or started: its shape here
# (as dgserve sudoku reads it: 81 cells, 1-9 or '.'/'0', layout characters ' |-+' ignored), the
# rest (conflicting givens, no solution) by `dgserve sudoku --check` once it is built, before the
# cluster is touched.
if [ "$MODE" = sudoku ] && [ $# -eq 1 ]; then
  cells=${1//[[:space:]|+-]/}
  if ! [[ "$cells" =~ ^[0-9.]{81}$ ]]; then
    echo "up.sh: a puzzle is 81 cells, 1-9 with '.' or '0' for blanks; got '$1' (${#cells} cells" \
      "after removing layout characters); the running cluster, if any, is left alone" >&2
    exit 1
  fi
fi
BUILD_DIR=${BUILD_DIR:-build}
if [ "$MODE" = chat ]; then MODEL_DIR=${MODEL_DIR:-models/default}; else MODEL_DIR=${MODEL_DIR:-models/sudoku}; fi
RUN_DIR=${RUN_DIR:-run/cluster}
HTTP_PORT=${DGSERVE_HTTP_PORT:-8000}
GRPC_PORT=${DGSERVE_GRPC_PORT:-50051}
# A held-out test puzzle (tools/sudoku/data/test.jsonl id 3-2, 36 givens) that the shipped model
# solves with the template (in 27 denoising steps with seeds 1-3; see models/sudoku/README.md for how
# often it solves others).
PUZZLE_DEFAULT=.84561.3.65.7...2...7...15.7.8...3..39..5.2.....37..48.7.6.541..2.4.36...6..87...
ARG=${1:-}

bash tools/setup.sh  # quick when everything is installed
[ -f "$BUILD_DIR/build.ninja" ] || cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j"$(nproc)" --target dgserve dgserve-mkmodel dgserve-gateway \
  dgserve-prefill-worker dgserve-denoise-worker  # incremental
if [ "$MODE" = sudoku ] && [ -n "$ARG" ] &&
  ! "$BUILD_DIR/tools/dgserve" sudoku --check "$ARG" > /dev/null; then
  echo "up.sh: refused the puzzle (error above); the running cluster, if any, is left alone" >&2
  exit 1
fi
# A cluster up.sh left running in RUN_DIR is replaced (--restart); cluster.sh refuses to replace
# one started otherwise (by cluster.sh itself), naming it and how to stop it. cluster.sh makes
# models/default on first use.
restart=()
if grep -qx 'STARTED_BY=up.sh' "$RUN_DIR/cluster.env" 2>/dev/null; then restart=(--restart); fi
CLUSTER_STARTED_BY=up.sh BUILD_DIR=$BUILD_DIR MODEL_DIR=$MODEL_DIR RUN_DIR=$RUN_DIR \
  bash tools/cluster.sh start ${restart[@]+"${restart[@]}"} --http-port "$HTTP_PORT" \
  --grpc-port "$GRPC_PORT"
# shellcheck disable=SC1091
. "$RUN_DIR/cluster.env"
echo "cluster up ($MODEL_DIR): OpenAI HTTP http://$GATEWAY_HTTP/v1 · gRPC $GATEWAY_GRPC ·" \
  "metrics: gateway $GATEWAY_METRICS, prefill $PREFILL0_METRICS, denoise $DENOISE0_METRICS" \
  "(logs in $RUN_DIR)"
if [ "$MODE" = chat ]; then
  PROMPT=${ARG:-Why is the sky blue?}
  echo "request: $PROMPT"
  "$BUILD_DIR/tools/dgserve" chat --gateway "$GATEWAY_GRPC" --prompt "$PROMPT" --seed 1
else
  PUZZLE=${ARG:-$PUZZLE_DEFAULT}
  echo "request: solve $PUZZLE"
  rc=0
  "$BUILD_DIR/tools/dgserve" sudoku --gateway "$GATEWAY_GRPC" --model "$MODEL_DIR" --seed 1 \
    "$PUZZLE" || rc=$?
  # 0 = solved. 2 = the cluster answered but the grid does not solve the puzzle (dgserve sudoku
  # names the first fault above); 1 = a bad puzzle or a failed request. Both fail the command
  # (exit 2 resp. 1); the cluster is left running either way.
  if [ "$rc" -ne 0 ]; then
    if [ "$rc" -eq 2 ]; then
      echo "up.sh: FAILED: the cluster answered, but the answer does not solve the puzzle" \
        "(the 'not solved:' line above names the first fault). The model solves only some" \
        "puzzles: models/sudoku/README.md has its rates by difficulty" >&2
    else
      echo "up.sh: FAILED: the Sudoku request failed (dgserve sudoku exit $rc, error above)" >&2
    fi
    echo "the cluster keeps running; stop it with: RUN_DIR=$RUN_DIR bash tools/cluster.sh stop" >&2
    exit "$rc"
  fi
fi
echo "the cluster keeps running; stop it with: RUN_DIR=$RUN_DIR bash tools/cluster.sh stop"
