"""Trains the Sudoku demo model (issue #6): a small DiffusionGemma (both layer types, MoE,
self-conditioning) with the uniform-state objective of the official fine-tuning recipe, then
exports the HF checkpoint layout dgserve loads.

  python3 tools/sudoku/train/train.py --data tools/sudoku/data --out /tmp/sudoku_run \
      --steps 6000 --batch 64
  python3 tools/sudoku/train/train.py --export /tmp/sudoku_run/last.pt --out models/sudoku

Objective, per example: t ~ U(0, 1); every canvas token is replaced by a uniformly random token
of the whole vocabulary with probability t; cross-entropy of the decoder's logits against the
clean canvas at every canvas position. On half the steps self-conditioning is trained: a first
decoder pass without it, its logits divided by a temperature drawn from [t_min, t_max] and
rounded like the sampler does (bf16), softmaxed and detached, feed the second pass.

Data layout (see tools/sudoku/sudoku.h): prompt = <bos> + 9 lines of 9 characters ('.' blank)
each ending in '\\n' (91 tokens); canvas = the solution in the same layout + <eos> (91 tokens).
Augmentation keeps every puzzle unique-solution: digit relabelling, band/row and stack/column
permutations, transposition.
"""
import argparse
import csv
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import dgmodel  # noqa: E402
import safetensors_io  # noqa: E402
import sudoku_vocab as vocab  # noqa: E402

CANVAS = 91


def model_config(args) -> dict:
    H = args.hidden
    layer_types = ["full_attention" if c == "F" else "sliding_attention" for c in args.layers]
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": CANVAS,
        "dtype": "bfloat16",
        "eos_token_id": [1, 106],
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "diffusion_gemma_text", "vocab_size": vocab.VOCAB_SIZE,
            "hidden_size": H, "num_hidden_layers": len(layer_types),
            "num_attention_heads": args.heads, "num_key_value_heads": args.heads // 2,
            "num_global_key_value_heads": 1, "head_dim": args.head_dim,
            "global_head_dim": 2 * args.head_dim, "layer_types": layer_types,
            "sliding_window": 128,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}},
            "max_position_embeddings": 4096, "intermediate_size": 2 * H,
            "num_experts": args.experts, "top_k_experts": 2, "moe_intermediate_size": H,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "final_logit_softcapping": 30.0, "attention_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": True, "use_bidirectional_attention": "vision",
            "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1, "dtype": "bfloat16",
        },
    }


GENERATION_CONFIG = {
    "max_new_tokens": CANVAS, "max_denoising_steps": 48,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1, "confidence_threshold": 0.005,
    "eos_token_id": [1, 106, 50], "pad_token_id": 0,
}


def load_split(path: str):
    puzzles, solutions = [], []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            puzzles.append([0 if c in ".0" else int(c) for c in r["puzzle"]])
            solutions.append([int(c) for c in r["solution"]])
    return torch.tensor(puzzles, dtype=torch.long), torch.tensor(solutions, dtype=torch.long)


def augment(p, s, gen):
    """Random validity-preserving transforms of [B, 81] puzzle/solution grids."""
    B = p.shape[0]
    digit = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(9, generator=gen) + 1])
                         for _ in range(B)])
    p = torch.gather(digit, 1, p)
    s = torch.gather(digit, 1, s)

    def line_perm():
        band = torch.randperm(3, generator=gen)
        return torch.cat([band[b] * 3 + torch.randperm(3, generator=gen) for b in range(3)])
    rows = torch.stack([line_perm() for _ in range(B)])   # [B, 9]
    cols = torch.stack([line_perm() for _ in range(B)])
    idx = rows[:, :, None] * 9 + cols[:, None, :]         # [B, 9, 9]
    tr = torch.rand(B, generator=gen) < 0.5
    idx = torch.where(tr[:, None, None], idx.transpose(1, 2), idx).reshape(B, 81)
    return torch.gather(p, 1, idx), torch.gather(s, 1, idx)


def grid_ids(g, blank_id):
    """[B, 81] digits (0 = blank) → [B, 90] ids of the 9-line layout."""
    B = g.shape[0]
    ids = torch.where(g == 0, torch.full_like(g, blank_id), g + 109)
    nl = torch.full((B, 9, 1), vocab.NEWLINE, dtype=torch.long)
    return torch.cat([ids.view(B, 9, 9), nl], dim=2).view(B, 90)


def make_batch(p, s):
    B = p.shape[0]
    prompt = torch.cat([torch.full((B, 1), vocab.BOS, dtype=torch.long), grid_ids(p, 109)], 1)
    canvas = torch.cat([grid_ids(s, 109), torch.full((B, 1), vocab.EOS, dtype=torch.long)], 1)
    return prompt, canvas


def sc_probs(logits, temperature):
    """What the sampler feeds back (spec §3.5 step 2): softmax(bf16(z)), z = logits / T."""
    z = (logits / temperature).to(torch.bfloat16).float()
    return torch.softmax(z, -1).to(torch.bfloat16).float()


@torch.no_grad()
def solve(model, p, steps=48, beta=0.1, t_min=0.4, t_max=0.8, use_sc=True, seed=0):
    """The entropy-bound sampler (spec §4.2) on a batch → (argmax canvases [B, C], steps [B])."""
    gen = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab_size
    prompt, _ = make_batch(p, p)
    cache = model.encode(prompt)
    B = p.shape[0]
    x = torch.randint(0, V, (B, CANVAS), generator=gen)
    A = x.clone()
    prev_a = torch.full_like(x, -1)
    done = torch.zeros(B, dtype=torch.bool)
    nsteps = torch.zeros(B, dtype=torch.long)
    sc = None
    for cur in range(steps, 0, -1):
        T = t_min + (t_max - t_min) * cur / steps
        z = model.decode(x, cache, sc) / T
        logp = torch.log_softmax(z, -1)
        pr = logp.exp()
        H = -(pr * logp).sum(-1)
        a = z.argmax(-1)
        d = torch.multinomial(pr.view(-1, V), 1, generator=gen).view(B, CANVAS)
        Hs, order = torch.sort(H, dim=1)
        acc_sorted = (torch.cumsum(Hs, 1) - Hs) <= beta
        acc = torch.zeros_like(acc_sorted).scatter(1, order, acc_sorted)
        x_new = torch.where(acc, d, torch.randint(0, V, (B, CANVAS), generator=gen))
        stop = (a == prev_a).all(1) & (H.mean(1) < 0.005)
        live = ~done
        nsteps += live.long()
        A = torch.where(live[:, None], a, A)
        x = torch.where(live[:, None], x_new, x)
        new_sc = sc_probs(z * T, T) if use_sc else None
        sc = new_sc if sc is None or new_sc is None else torch.where(live[:, None, None], new_sc, sc)
        prev_a = a
        done |= stop
        if done.all():
            break
    return A, nsteps


def evaluate(model, p, s, **kw):
    A, n = solve(model, p, **kw)
    digits = A[:, :90].reshape(-1, 9, 10)[:, :, :9].reshape(-1, 81) - 109
    blank = p == 0
    correct = (digits == s) & blank
    solved = (digits == s).all(1)
    return {"solved": solved.float().mean().item(),
            "cell_acc": (correct.sum() / blank.sum()).item(), "steps": n.float().mean().item()}


def export(model, cfg_dict, out):
    os.makedirs(out, exist_ok=True)
    tensors = {k: v.to(torch.bfloat16) for k, v in model.hf_state().items()}
    safetensors_io.save(os.path.join(out, "model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f, indent=2)
    vocab.write(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="tools/sudoku/data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head_dim", type=int, default=32)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--layers", default="SSFSSF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--bench", type=int, default=0, help="time this many steps and exit")
    ap.add_argument("--export", default="", help="export a training checkpoint to --out")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    if args.export:
        ck = torch.load(args.export)
        cfg_dict = ck["config"]
        model = dgmodel.DiffusionGemma(dgmodel.Config(cfg_dict))
        model.load_state_dict(ck["model"])
        export(model, cfg_dict, args.out)
        print(f"exported step {ck['step']} to {args.out}")
        return

    cfg_dict = model_config(args)
    model = dgmodel.DiffusionGemma(dgmodel.Config(cfg_dict))
    nparam = sum(t.numel() for t in model.parameters())
    print(f"parameters: {nparam:,}", flush=True)
    decay = [t for n, t in model.named_parameters() if t.dim() >= 2]
    other = [t for n, t in model.named_parameters() if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    start = 0
    if args.resume:
        ck = torch.load(args.resume)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"]
    tp, ts = load_split(os.path.join(args.data, "train.jsonl")) if not args.bench else (None, None)
    if args.bench:
        vp, vs = load_split(os.path.join(args.data, "test.jsonl"))
        tp, ts = vp, vs
    else:
        vp, vs = load_split(os.path.join(args.data, "valid.jsonl"))
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(args.seed)
    V = model.cfg.vocab_size
    warm = 200
    total = args.bench or args.steps
    log = open(os.path.join(args.out, "loss.csv"), "a", newline="")
    w = csv.writer(log)
    t0 = time.time()
    for step in range(start, total):
        lr = args.lr * (step + 1) / warm if step < warm else \
            args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm))))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, tp.shape[0], (args.batch,), generator=gen)
        p, s = augment(tp[idx], ts[idx], gen)
        prompt, canvas = make_batch(p, s)
        t = torch.rand(args.batch, 1, generator=gen)
        noisy = torch.where(torch.rand(canvas.shape, generator=gen) < t,
                            torch.randint(0, V, canvas.shape, generator=gen), canvas)
        model.train()
        cache = model.encode(prompt)
        use_sc = torch.rand(1, generator=gen).item() < 0.5
        sc = None
        if use_sc:
            with torch.no_grad():
                first = model.decode(noisy, [(k.detach(), v.detach()) for k, v in cache])
                temp = 0.4 + 0.4 * torch.rand(args.batch, 1, 1, generator=gen)
                sc = sc_probs(first, temp)
        logits = model.decode(noisy, cache, sc)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), canvas.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        w.writerow([step, f"{loss.item():.5f}", int(use_sc), f"{lr:.6f}", f"{time.time() - t0:.1f}"])
        if step % 50 == 0:
            log.flush()
            print(f"step {step} loss {loss.item():.4f} sc {int(use_sc)} lr {lr:.5f} "
                  f"{time.time() - t0:.0f}s", flush=True)
        last = step + 1 == total
        if not args.bench and ((step + 1) % args.eval_every == 0 or last):
            model.eval()
            ck = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                  "config": cfg_dict}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            r = evaluate(model, vp[:100], vs[:100])
            print(f"eval step {step + 1}: {r}", flush=True)
            with open(os.path.join(args.out, "eval.jsonl"), "a") as f:
                f.write(json.dumps({"step": step + 1, **r}) + "\n")
    if args.bench:
        print(f"{(time.time() - t0) / args.bench:.3f} s/step")


if __name__ == "__main__":
    main()
