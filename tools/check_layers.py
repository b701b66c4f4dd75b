#!/usr/bin/env python3
"""Fails when a source file includes a project header from a layer above its own.

The layers, from the bottom (README.md, "Layers"):

  0 common/          status macros, bf16, hashing, status conversion at the edges
  1 proto/           the generated gRPC/protobuf code
  2 engine/          the model: no gRPC, protobuf or Prometheus inside (engine/model/ shared by
                     the backends, engine/cpu/ and engine/cuda/ the backends: one layer)
  3 kvstore/         KV block pool, prefix index, KV transports
  4 service/         gRPC server plumbing, internal authentication, proto <-> engine conversions
  5 worker/          what the processes that load the model share
  6 gateway/, prefill_worker/, denoise_worker/   the processes: none includes another
  7 tools/, bench/, tests/, deploy/               programs and cross-component tests

A file may include headers of its own layer and of the layers below. The three process folders
share a layer but may not include one another. Includes are the quoted `#include "dir/..."`
form; system and third-party headers (<...>, "absl/...", "grpcpp/...") are not project
folders and are ignored.

  python3 tools/check_layers.py            # checks every tracked .h/.cc/.cu/.cuh file
  python3 tools/check_layers.py FILE...    # checks the given files
Exit status 1 and one line per violation (file:line: what) when the order is broken.
"""
import pathlib
import re
import subprocess
import sys

LAYERS = {
    "common": 0,
    "proto": 1,
    "engine": 2,
    "kvstore": 3,
    "service": 4,
    "worker": 5,
    "gateway": 6,
    "prefill_worker": 6,
    "denoise_worker": 6,
    "tools": 7,
    "bench": 7,
    "tests": 7,
    "deploy": 7,
}
PROCESSES = {"gateway", "prefill_worker", "denoise_worker"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([A-Za-z0-9_]+)/')
SOURCE = re.compile(r"\.(h|cc|cu|cuh)$")


def violations(root: pathlib.Path, rel: str):
    """Yields "file:line: message" for every include in `rel` that runs up a layer."""
    own = rel.split("/", 1)[0]
    if own not in LAYERS:
        return
    text = (root / rel).read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        m = INCLUDE.match(line)
        if not m or m.group(1) not in LAYERS:
            continue
        target = m.group(1)
        if target == own:
            continue
        if LAYERS[target] > LAYERS[own]:
            yield (f"{rel}:{number}: {own}/ (layer {LAYERS[own]}) includes {target}/ "
                   f"(layer {LAYERS[target]}), a layer above it")
        elif own in PROCESSES and target in PROCESSES:
            yield f"{rel}:{number}: process folder {own}/ includes another process folder, {target}/"


def main(argv):
    root = pathlib.Path(__file__).resolve().parent.parent
    if len(argv) > 1:
        files = [str(pathlib.Path(f).resolve().relative_to(root)) for f in argv[1:]]
    else:
        listed = subprocess.run(["git", "-C", str(root), "ls-files"], check=True,
                                capture_output=True, text=True).stdout.splitlines()
        files = [f for f in listed if SOURCE.search(f)]
    found = [v for f in files if SOURCE.search(f) for v in violations(root, f)]
    for v in found:
        print(v)
    print(f"check_layers: {len(files)} files, {len(found)} includes running up a layer")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
