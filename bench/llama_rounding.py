#!/usr/bin/env python3
"""Where bf16 Llama logits differ from Hugging Face's: transformers' Llama forward re-done
step by step in PyTorch with each rounding point switchable (docs/transformers.md, "Precision").

Reads a Llama-family folder (bench/hf_models.py, e.g. --shape llama-tiny --dtype bf16) and a
bf16 reference from bench/hf_reference.py over it. For every variant below it runs the
teacher-forced forward of each reference row and prints the worst error (the parity measure:
|a - b| over the row's largest |b|, as `cudagraph bench parity`) against transformers' bf16
logits from the file and against an f32 forward of the same weights, and how many rows are
over 2e-2. The variant "transformers" (every switch as transformers has it) must reproduce the
file exactly (0 error); the others say how much each rounding point moves the logits.

Variants: residual adds rounded once (the product added in f32, then rounded) instead of
transformers' product-rounded-then-sum; logits left in f32; attention without rounding its
probabilities; probabilities rounded relative to the row's final maximum; our attention kernel
(lane groups of 32 strided keys with their own running maxima, splits of 64 keys); flash
attention's scheme (a block-wide running maximum moved every A keys, restarted every B keys
as a split would: "tiles A, splits B").

Needs a GPU (cuda), torch and transformers. Exits non-zero on any error.

usage: python3 bench/llama_rounding.py --model DIR --reference FILE
"""
import argparse

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--model", required=True)
ap.add_argument("--reference", required=True)
args = ap.parse_args()
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
dev = "cuda"
m = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).eval()
c = m.config
L, H, Hkv, D, d = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
G, eps = H // Hkv, c.rms_norm_eps
sd = dict(m.state_dict())
rot_mod = m.model.rotary_emb
inv_freq = rot_mod.inv_freq.float()
asc = getattr(rot_mod, "attention_scaling", 1.0)
R = load_file(args.reference)
rows = len([k for k in R if k.startswith("ids.")])


def fwd(ids, resid="hf", attn="sdpa", logits="bf16", dt=torch.bfloat16):
    """The logits of one row; resid "fused" adds in f32, attn: sdpa, f32, pfinal, ours-now, tileA-B."""
    W = lambda n: sd[n].to(dt)
    T = ids.shape[0]
    x = W("model.embed_tokens.weight")[ids]
    pos = torch.arange(T, device=dev)
    fr = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat([fr, fr], -1)
    cos, sin = (emb.cos() * asc).to(dt), (emb.sin() * asc).to(dt)
    def rms(h, w):
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        return w * hf.to(dt)
    lin = lambda h, w: h @ w.T
    lin32 = lambda h, w: h.float() @ w.float().T
    def rot(t):
        t1, t2 = t[..., : D // 2], t[..., D // 2:]
        return t * cos + torch.cat([-t2, t1], -1) * sin
    mask = torch.ones(T, T, device=dev, dtype=torch.bool).tril()
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms(x, W(p + "input_layernorm.weight"))
        q = lin(h, W(p + "self_attn.q_proj.weight")).view(T, H, D).transpose(0, 1)
        k = lin(h, W(p + "self_attn.k_proj.weight")).view(T, Hkv, D).transpose(0, 1)
        v = lin(h, W(p + "self_attn.v_proj.weight")).view(T, Hkv, D).transpose(0, 1)
        q, k = rot(q), rot(k)
        k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
        if attn == "sdpa":
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        elif attn == "ours-now":
            # lane groups (32, key j in group j % 32 of its split) with their own running max;
            # splits: used = ceil(L / 64), chunk = ceil(L / used) rounded up to 32 keys
            s = (q.float() @ k.float().transpose(-1, -2)) * (D ** -0.5)
            s = s.masked_fill(~mask, float("-inf"))
            vf = v.float()
            outs = []
            for r in range(T):
                Lk = r + 1
                used = -(-Lk // 64)
                chunk = -(-(-(-Lk // used)) // 32) * 32
                sr = s[:, r, :Lk]
                jj = torch.arange(Lk, device=dev)
                prev = jj - 32
                same = (prev >= 0) & ((prev // chunk) == (jj // chunk))
                sp = torch.where(same[None, :], sr[:, prev.clamp(min=0)], torch.full_like(sr, float("-inf")))
                cm = torch.maximum(sr, sp)
                M = sr.amax(-1, keepdim=True)
                w = torch.exp(sr - cm).to(dt).float() * torch.exp(cm - M)
                l_ = torch.exp(sr - M).sum(-1, keepdim=True)
                outs.append((w[:, None, :] @ vf[:, :Lk])[:, 0] / l_)
            o = torch.stack(outs, 1).to(dt)
        elif attn.startswith("tile"):
            # tileA-B: running max over tiles of A keys, restarted (a split) every B keys
            a_, b_ = [int(z) for z in attn[4:].split("-")]
            s = (q.float() @ k.float().transpose(-1, -2)) * (D ** -0.5)
            s = s.masked_fill(~mask, float("-inf"))
            vf = v.float()
            parts = []
            ninf = torch.full(s.shape[:-1], float("-inf"), device=dev)
            m_, l_, acc = ninf.clone(), torch.zeros_like(ninf), torch.zeros(*s.shape[:-1], D, device=dev)
            for t0 in range(0, T, a_):
                if t0 > 0 and t0 % b_ == 0:
                    parts.append((m_, l_, acc))
                    m_, l_, acc = ninf.clone(), torch.zeros_like(ninf), torch.zeros_like(acc)
                sb = s[..., t0:t0 + a_]
                mn = torch.maximum(m_, sb.amax(-1))
                safe = torch.where(torch.isinf(mn), torch.zeros_like(mn), mn)
                corr = torch.where(torch.isinf(m_), torch.zeros_like(m_), torch.exp(m_ - safe))
                pp = torch.exp(sb - safe[..., None])
                l_ = l_ * corr + pp.sum(-1)
                acc = acc * corr[..., None] + pp.to(dt).float() @ vf[:, t0:t0 + a_]
                m_ = mn
            parts.append((m_, l_, acc))
            M = torch.stack([z[0] for z in parts]).amax(0)
            num = torch.zeros_like(acc); den = torch.zeros_like(l_)
            for (mm, ll, aa) in parts:
                w = torch.where(torch.isinf(mm), torch.zeros_like(mm), torch.exp(mm - M))
                num = num + w[..., None] * aa; den = den + w * ll
            o = (num / den[..., None]).to(dt)
        else:
            s = (q.float() @ k.float().transpose(-1, -2)) * (D ** -0.5)
            s = s.masked_fill(~mask, float("-inf"))
            mx = s.amax(-1, keepdim=True)
            e = torch.exp(s - mx)
            l = e.sum(-1, keepdim=True)
            pe = e.to(dt).float() if (attn == "pfinal") else e
            o = ((pe @ v.float()) / l).to(dt)
        o = o.transpose(0, 1).reshape(T, H * D)
        if resid == "hf":
            x = x + lin(o, W(p + "self_attn.o_proj.weight"))
        else:
            x = (x.float() + lin32(o, W(p + "self_attn.o_proj.weight"))).to(dt)
        h = rms(x, W(p + "post_attention_layernorm.weight"))
        g = lin(h, W(p + "mlp.gate_proj.weight"))
        u = lin(h, W(p + "mlp.up_proj.weight"))
        a = F.silu(g) * u
        if resid == "hf":
            x = x + lin(a, W(p + "mlp.down_proj.weight"))
        else:
            x = (x.float() + lin32(a, W(p + "mlp.down_proj.weight"))).to(dt)
    h = rms(x, W("model.norm.weight"))
    head = "lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"
    return (lin(h, W(head)).float() if logits == "bf16" else lin32(h, W(head)))


def err(a, b):
    """Per row: the largest |a - b| over the row's largest |b|."""
    return (a - b).abs().amax(-1) / b.abs().amax(-1)


variants = {
    "transformers": dict(),
    "logits f32": dict(logits="f32"),
    "residual adds rounded once": dict(resid="fused"),
    "attention probabilities not rounded": dict(attn="f32"),
    "probabilities vs the final maximum": dict(attn="pfinal"),
    "our kernel (lane groups, splits 64)": dict(attn="ours-now"),
    "our kernel, logits f32": dict(attn="ours-now", logits="f32"),
    "tiles 128 (no splits)": dict(attn="tile128-100000"),
    "tiles 64 (no splits)": dict(attn="tile64-100000"),
    "tiles 128, splits 128": dict(attn="tile128-128"),
    "tiles 128, splits 128, logits f32": dict(attn="tile128-128", logits="f32"),
    "tiles 64, splits 64": dict(attn="tile64-64"),
}
vs_hf = {k: [] for k in variants}
vs_f32 = {k: [] for k in list(variants) + ["transformers' bf16 file"]}
with torch.no_grad():
    for b in range(rows):
        ids = R[f"ids.{b}"].to(dev).long()
        hf_file = R[f"logits.{b}"].to(dev)
        t = fwd(ids, resid="fused", attn="f32", logits="f32", dt=torch.float32)
        vs_f32["transformers' bf16 file"].append(err(hf_file, t))
        for k, kw in variants.items():
            y = fwd(ids, **kw)
            vs_hf[k].append(err(y, hf_file))
            vs_f32[k].append(err(y, t))
print(f"{'variant':40s} {'vs transformers':>15s} {'rows>2e-2':>9s} {'vs f32':>12s} {'rows>2e-2':>9s}")
for k in vs_f32:
    et = torch.cat(vs_f32[k])
    if k in vs_hf:
        e = torch.cat(vs_hf[k])
        a, n = f"{e.max().item():15.3e}", f"{(e > 2e-2).sum().item():9d}"
    else:
        a, n = f"{'':15s}", f"{'':9s}"
    print(f"{k:40s} {a} {n} {et.max().item():12.3e} {(et > 2e-2).sum().item():9d}")
