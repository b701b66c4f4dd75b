"""Checks dgmodel.py against the golden traces of an independent implementation
(tests/testdata/golden, llama.cpp in float32): teacher-forced steps of every case of tiny-v512,
each step fed the recorded canvas and the recorded previous-step logits for self-conditioning.

  python3 tools/sudoku/train/check_golden.py MODEL_DIR [GOLDEN_DIR]

MODEL_DIR is the tiny-v512 checkpoint made by `dgserve-mkmodel --seed 512 --config
tests/testdata/golden/tiny-v512/config.json --out MODEL_DIR`. Exits 1 if any step's logits
differ by more than the golden index's tolerance.
"""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import dgmodel  # noqa: E402
import safetensors_io  # noqa: E402


def main():
    model_dir = sys.argv[1]
    golden = sys.argv[2] if len(sys.argv) > 2 else "tests/testdata/golden/tiny-v512"
    cfg = dgmodel.Config(json.load(open(os.path.join(model_dir, "config.json"))))
    model = dgmodel.DiffusionGemma(cfg)
    model.load_hf_state(safetensors_io.load(os.path.join(model_dir, "model.safetensors")))
    model.eval()
    V, C = cfg.vocab_size, cfg.canvas_length
    worst = 0.0
    nsteps = 0
    for case in ["short", "long", "two_blocks", "early_stop"]:
        c = json.load(open(os.path.join(golden, "cases", case + ".json")))
        logits = np.fromfile(os.path.join(golden, "cases", case + ".logits.f32"),
                             dtype=np.float32).reshape(-1, C, V)
        for b in c["blocks"]:
            ctx = torch.tensor([b["context_ids"]])
            with torch.no_grad():
                cache = model.encode(ctx)
                prev = None
                for s in b["steps"]:
                    fed = torch.tensor([s["fed"]])
                    sc = None
                    if prev is not None and int(s["sc_use"]):
                        z = torch.from_numpy(prev) / float(s["sc_temperature"])
                        sc = torch.softmax(z, -1)[None]
                    out = model.decode(fed, cache, sc)[0].numpy()
                    ref = logits[int(s["logits_index"])]
                    worst = max(worst, float(np.abs(out - ref).max()))
                    nsteps += 1
                    prev = ref
    print(f"golden tiny-v512: {nsteps} teacher-forced steps, max |logit diff| = {worst:.3g}")
    sys.exit(0 if worst < 1e-3 else 1)


if __name__ == "__main__":
    main()
