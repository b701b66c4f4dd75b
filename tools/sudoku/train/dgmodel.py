"""DiffusionGemma in PyTorch, for training the Sudoku demo model (issue #6).

The forward math follows ../shared/spec/diffusiongemma.md (the project's model spec) section by
section, in float32: §3.1 primitives, §3.2 the shared block (dense MLP + MoE, layer scalar on the
whole residual stream), §3.3 projections (full layers: no v_proj, V = rms_noscale(raw k)),
§3.4 the causal encoder pass that produces the KV cache, §3.5 the bidirectional decoder pass over
the canvas with self-conditioning and the sliding-window rule for the context. Parameter names
and shapes are the HF checkpoint's (§2.2), so `state_dict()` exports directly.

Shapes: prompt ids [B, P], canvas ids [B, C], logits [B, C, V] (float32, softcapped).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def bf16_round(x: float) -> float:
    """Rounds a python float to bfloat16 (round to nearest even), as HF does with embed_scale."""
    return float(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).float())


class Config:
    """The fields of config.json (text_config + canvas_length) the model needs."""

    def __init__(self, cfg: dict):
        t = cfg.get("text_config", cfg)
        self.vocab_size = t["vocab_size"]
        self.hidden_size = t["hidden_size"]
        self.num_layers = t["num_hidden_layers"]
        self.num_heads = t["num_attention_heads"]
        self.num_kv_heads = t["num_key_value_heads"]
        self.num_global_kv_heads = t["num_global_key_value_heads"]
        self.head_dim = t["head_dim"]
        self.global_head_dim = t["global_head_dim"]
        self.intermediate_size = t["intermediate_size"]
        self.num_experts = t["num_experts"]
        self.top_k = t["top_k_experts"]
        self.moe_intermediate_size = t["moe_intermediate_size"]
        self.sliding_window = t["sliding_window"]
        self.eps = t.get("rms_norm_eps", 1e-6)
        self.softcap = t.get("final_logit_softcapping", 30.0)
        rp = t.get("rope_parameters", {})
        self.theta_sliding = rp.get("sliding_attention", {}).get("rope_theta", 10000.0)
        self.theta_full = rp.get("full_attention", {}).get("rope_theta", 1e6)
        self.partial_rotary = rp.get("full_attention", {}).get("partial_rotary_factor", 0.25)
        lt = t.get("layer_types")
        if lt is None:
            lt = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                  for i in range(self.num_layers)]
        self.full = [x == "full_attention" for x in lt]
        self.canvas_length = cfg.get("canvas_length", 256)
        # §3.4: the embedding scale is applied as bf16(sqrt(H)); the router scale is a python float.
        self.embed_scale = bf16_round(math.sqrt(self.hidden_size))
        self.router_root = self.hidden_size ** -0.5


def rms(x, w=None, eps=1e-6):
    """§3.1.1 RMSNorm without the Gemma +1 offset; `w` None = the weightless flavour."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def gelu(x):
    """§3.1.2 tanh-approximate GELU."""
    return F.gelu(x, approximate="tanh")


def inv_freq(cfg: Config, full: bool) -> torch.Tensor:
    """§3.1.4: [d/2] frequencies; full layers rotate only the first partial·d/2 pairs."""
    if not full:
        d = cfg.head_dim
        return 1.0 / (cfg.theta_sliding ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    d = cfg.global_head_dim
    k = int(cfg.partial_rotary * d // 2)
    f = torch.zeros(d // 2)
    f[:k] = 1.0 / (cfg.theta_full ** (torch.arange(0, 2 * k, 2, dtype=torch.float32) / d))
    return f


def rope(x, pos, freqs):
    """§3.1.4 NeoX rotate-half RoPE. x [B, T, n, d], pos [T] (int), freqs [d/2]."""
    ang = pos.float()[:, None] * freqs[None, :]           # [T, d/2]
    cos = torch.cos(ang)[None, :, None, :]
    sin = torch.sin(ang)[None, :, None, :]
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Layer(nn.Module):
    """One transformer block (§3.2, §3.3). Parameter names follow the HF checkpoint."""

    def __init__(self, cfg: Config, full: bool):
        super().__init__()
        H = cfg.hidden_size
        self.full = full
        self.hd = cfg.global_head_dim if full else cfg.head_dim
        self.nkv = cfg.num_global_kv_heads if full else cfg.num_kv_heads
        self.nh = cfg.num_heads
        self.cfg = cfg
        ones = lambda n: nn.Parameter(torch.ones(n))
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = ones(H)
        self.self_attn = nn.Module()
        sa = self.self_attn
        sa.q_proj = nn.Linear(H, self.nh * self.hd, bias=False)
        sa.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        if not full:
            sa.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        sa.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        # QK-norm replaces the 1/sqrt(d) scaling (§3.1.5); start the product at that scale.
        sa.q_norm = nn.Module()
        sa.q_norm.weight = nn.Parameter(torch.full((self.hd,), self.hd ** -0.25))
        sa.k_norm = nn.Module()
        sa.k_norm.weight = nn.Parameter(torch.full((self.hd,), self.hd ** -0.25))
        for n in ["post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                  "post_feedforward_layernorm_2", "post_feedforward_layernorm"]:
            m = nn.Module()
            m.weight = ones(H)
            setattr(self, n, m)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.router = nn.Module()
        self.router.proj = nn.Linear(H, cfg.num_experts, bias=False)
        self.router.scale = ones(H)
        self.router.per_expert_scale = ones(cfg.num_experts)
        E, Fm = cfg.num_experts, cfg.moe_intermediate_size
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(E, 2 * Fm, H) * 0.02)
        self.experts.down_proj = nn.Parameter(torch.randn(E, H, Fm) * 0.02)

    def kv(self, a, pos):
        """§3.3: K (k_norm + RoPE) and V (weightless norm; full layers: of the raw k)."""
        B, T, _ = a.shape
        sa = self.self_attn
        k = sa.k_proj(a).view(B, T, self.nkv, self.hd)
        v = k if self.full else sa.v_proj(a).view(B, T, self.nkv, self.hd)
        K = rope(rms(k, sa.k_norm.weight, self.cfg.eps), pos, inv_freq(self.cfg, self.full))
        V = rms(v, None, self.cfg.eps)
        return K, V

    def attend(self, a, pos, K, V, mask):
        """§3.1.5: scores = Q·Kᵀ (scale 1), additive mask [Tq, Tk], fp32 softmax, GQA."""
        B, T, _ = a.shape
        sa = self.self_attn
        q = sa.q_proj(a).view(B, T, self.nh, self.hd)
        q = rope(rms(q, sa.q_norm.weight, self.cfg.eps), pos, inv_freq(self.cfg, self.full))
        g = self.nh // self.nkv
        Kx = K.repeat_interleave(g, dim=2)                    # [B, Tk, nh, d]
        Vx = V.repeat_interleave(g, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, Kx) + mask
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("bhqk,bkhd->bqhd", p, Vx).reshape(B, T, self.nh * self.hd)
        return sa.o_proj(o)

    def ffn(self, h1):
        """§3.2 steps 4–6 (without the layer scalar): dense branch + MoE branch."""
        cfg = self.cfg
        m = self.mlp
        x = rms(h1, self.pre_feedforward_layernorm.weight, cfg.eps)
        d = m.down_proj(gelu(m.gate_proj(x)) * m.up_proj(x))
        d = rms(d, self.post_feedforward_layernorm_1.weight, cfg.eps)
        r = rms(h1, None, cfg.eps) * self.router.scale * cfg.router_root
        p = torch.softmax(self.router.proj(r), dim=-1)        # [B, T, E]
        top, idx = torch.topk(p, cfg.top_k, dim=-1)
        w = top / top.sum(-1, keepdim=True)
        w = w * self.router.per_expert_scale[idx]
        xe = rms(h1, self.pre_feedforward_layernorm_2.weight, cfg.eps)
        B, T, H = xe.shape
        flat = xe.reshape(B * T, H)
        y = torch.zeros_like(flat)
        Fm = cfg.moe_intermediate_size
        idx_f, w_f = idx.reshape(B * T, -1), w.reshape(B * T, -1)
        for e in range(cfg.num_experts):  # only the tokens routed to expert e
            rows, slot = (idx_f == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            gu = flat[rows] @ self.experts.gate_up_proj[e].t()
            act = gelu(gu[:, :Fm]) * gu[:, Fm:]
            ye = (act @ self.experts.down_proj[e].t()) * w_f[rows, slot][:, None]
            y = y.index_add(0, rows, ye)
        y = y.view(B, T, H)
        y = rms(y, self.post_feedforward_layernorm_2.weight, cfg.eps)
        return rms(d + y, self.post_feedforward_layernorm.weight, cfg.eps)


class DiffusionGemma(nn.Module):
    """The text model: tied embedding / LM head, layers, final norm, self-conditioning MLP."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList([Layer(cfg, f) for f in cfg.full])
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(H))
        sc = nn.Module()
        sc.pre_norm = nn.Module()
        sc.pre_norm.weight = nn.Parameter(torch.ones(H))
        sc.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        sc.up_proj = nn.Linear(H, cfg.intermediate_size, bias=False)
        sc.down_proj = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.self_conditioning = sc
        # Decoder (model.decoder.layers.i.layer_scalar) and encoder scalars are separate buffers.
        self.dec_scalar = nn.Parameter(torch.ones(cfg.num_layers))
        self.enc_scalar = nn.Parameter(torch.ones(cfg.num_layers))
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)

    def _sliding_bias(self, full, tq, tk, allowed):
        return torch.zeros(tq, tk).masked_fill(~allowed, float("-inf"))

    def encode(self, ids):
        """§3.4 encoder pass over the prompt [B, P] → per-layer (K, V) for the decoder."""
        cfg = self.cfg
        B, P = ids.shape
        pos = torch.arange(P)
        h = self.embed_tokens(ids) * cfg.embed_scale
        qi, kj = pos[:, None], pos[None, :]
        causal = kj <= qi
        masks = {False: self._sliding_bias(False, P, P, causal & (qi - kj < cfg.sliding_window)),
                 True: self._sliding_bias(True, P, P, causal)}
        cache = []
        for i, layer in enumerate(self.layers):
            a = rms(h, layer.input_layernorm.weight, cfg.eps)
            K, V = layer.kv(a, pos)
            cache.append((K, V))
            if i == len(self.layers) - 1:
                break  # the last layer's output is not needed, only its K/V
            o = layer.attend(a, pos, K, V, masks[layer.full])
            h1 = h + rms(o, layer.post_attention_layernorm.weight, cfg.eps)
            h = (h1 + layer.ffn(h1)) * self.enc_scalar[i]
        return cache

    def decode(self, canvas, cache, sc_probs=None):
        """§3.5 decoder pass: canvas [B, C], cache from encode(), sc_probs [B, C, V] (the
        previous step's softmax(bf16(z)), or None = zero) → softcapped logits [B, C, V]."""
        cfg = self.cfg
        B, C = canvas.shape
        P = cache[0][0].shape[1]
        pos = torch.arange(P, P + C)
        E = self.embed_tokens.weight
        e = self.embed_tokens(canvas) * cfg.embed_scale
        sc = self.self_conditioning
        if sc_probs is None:
            soft = torch.zeros_like(e)
        else:
            soft = (sc_probs @ E) * cfg.embed_scale
        u = rms(soft, sc.pre_norm.weight, cfg.eps)
        sig = sc.down_proj(gelu(sc.gate_proj(u)) * sc.up_proj(u))
        h = rms(e + sig, None, cfg.eps)
        # §3.5 step 5: full layers see all context; sliding layers the last min(P, W-1) tokens.
        ctx = torch.arange(P)
        keep = ctx >= P - (cfg.sliding_window - 1)
        slide = torch.cat([torch.zeros(P).masked_fill(~keep, float("-inf")), torch.zeros(C)])
        masks = {False: slide[None, :].expand(C, P + C), True: torch.zeros(C, P + C)}
        for i, layer in enumerate(self.layers):
            a = rms(h, layer.input_layernorm.weight, cfg.eps)
            Kc, Vc = layer.kv(a, pos)
            K = torch.cat([cache[i][0], Kc], dim=1)
            V = torch.cat([cache[i][1], Vc], dim=1)
            o = layer.attend(a, pos, K, V, masks[layer.full])
            h1 = h + rms(o, layer.post_attention_layernorm.weight, cfg.eps)
            h = (h1 + layer.ffn(h1)) * self.dec_scalar[i]
        h = rms(h, self.norm.weight, cfg.eps)
        logits = h @ E.t()
        return cfg.softcap * torch.tanh(logits / cfg.softcap)

    # ---- HF names (§2.2) ----
    def hf_state(self):
        """name → float32 tensor, with the checkpoint's names and shapes."""
        out = {}
        p = "model.decoder."
        for name, t in self.named_parameters():
            if name in ("dec_scalar", "enc_scalar"):
                continue
            n = name.replace("self_conditioning.", "self_conditioning.")
            out[p + n] = t.detach()
        for i in range(self.cfg.num_layers):
            out[f"{p}layers.{i}.layer_scalar"] = self.dec_scalar[i:i + 1].detach()
            out[f"model.encoder.language_model.layers.{i}.layer_scalar"] = \
                self.enc_scalar[i:i + 1].detach()
        return out

    def load_hf_state(self, tensors: dict):
        """Loads tensors named as in the checkpoint (float32 or bf16)."""
        p = "model.decoder."
        own = dict(self.named_parameters())
        with torch.no_grad():
            for name, t in own.items():
                if name in ("dec_scalar", "enc_scalar"):
                    continue
                t.copy_(tensors[p + name].float())
            for i in range(self.cfg.num_layers):
                self.dec_scalar[i] = tensors[f"{p}layers.{i}.layer_scalar"].float()[0]
                self.enc_scalar[i] = \
                    tensors[f"model.encoder.language_model.layers.{i}.layer_scalar"].float()[0]
