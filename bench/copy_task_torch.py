#!/usr/bin/env python3
"""PyTorch training the model and task of `cudagraph train copy`
(crates/cudagraph-cli/src/copy_task.rs) with the same hyper-parameters: a GPT-2-shaped decoder
(token and position embeddings, pre-norm blocks: LayerNorm, qkv Linear, causal attention
(scaled_dot_product_attention), projection, residual; LayerNorm, Linear 4h, GELU (tanh),
projection, residual; final LayerNorm, lm_head tied to the token embedding), GPT-2's
initialisation (normal 0.02, residual projections 0.02/sqrt(2·layers)), learning to repeat a
block of random tokens (targets: the next token in the repeated half, token 0 elsewhere).

The whole step — zero_grad(set_to_none=True), forward under torch.autocast(bf16) (or f32),
cross-entropy, backward, clip_grad_norm_, AdamW(capturable=True) — is captured into one
torch.cuda.graph after three warm-up steps on a side stream, and replayed; every step's batch
is copied into the static inputs first. TF32 off. µs per step: the intervals between progress
lines, each ended by a synchronisation (the reads of the loss and logits left out), as ours.

usage: python3 bench/copy_task_torch.py [--layers 4] [--hidden 256] [--heads 4] [--seq 32]
       [--vocab 64] [--batch 32] [--steps 3000] [--lr 1e-3] [--clip 1.0] [--dtype bf16|f32]
       [--seed 0] [--log-every 100] [--eager]
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=4)
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--seq", type=int, default=32)
p.add_argument("--vocab", type=int, default=64)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--steps", type=int, default=3000)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--clip", type=float, default=1.0)
p.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--log-every", type=int, default=100)
p.add_argument("--eager", action="store_true")
a = p.parse_args()


class Block(nn.Module):
    def __init__(self, h, heads, layers):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(h)
        self.c_attn = nn.Linear(h, 3 * h)
        self.attn_proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.c_fc = nn.Linear(h, 4 * h)
        self.mlp_proj = nn.Linear(4 * h, h)
        std = 0.02 / math.sqrt(2 * layers)
        for lin, s in [(self.c_attn, 0.02), (self.attn_proj, std), (self.c_fc, 0.02), (self.mlp_proj, std)]:
            nn.init.normal_(lin.weight, 0.0, s)
            nn.init.zeros_(lin.bias)

    def forward(self, x):
        b, t, h = x.shape
        qkv = self.c_attn(self.ln_1(x))
        q, k, v = qkv.split(h, dim=2)
        shape = (b, t, self.heads, h // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab, positions, h, heads, layers):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(positions, h)
        nn.init.normal_(self.wte.weight, 0.0, 0.02)
        nn.init.normal_(self.wpe.weight, 0.0, 0.02)
        self.blocks = nn.ModuleList(Block(h, heads, layers) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, ids, pos):
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.ln_f(x), self.wte.weight).float()


def sequences(gen, batches):
    block = torch.randint(1, a.vocab, (batches, a.batch, a.seq), generator=gen)
    seq = torch.cat([block, block], dim=2)
    tgt = torch.zeros_like(seq)
    t = 2 * a.seq
    tgt[..., a.seq - 1:t - 1] = seq[..., a.seq:t]
    return seq.cuda(), tgt.cuda()


def accuracy(logits, tgt):
    t = 2 * a.seq
    pred = logits.view(-1, t, a.vocab).argmax(-1)[:, a.seq - 1:t - 1]
    want = tgt.view(-1, t)[:, a.seq - 1:t - 1]
    return int((pred == want).sum()), want.numel()


torch.manual_seed(a.seed)
dev = torch.device("cuda")
t = 2 * a.seq
model = Gpt(a.vocab, t, a.hidden, a.heads, a.layers).to(dev)
params = list(model.parameters())
n_params = sum(p.numel() for p in params)
opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                        capturable=not a.eager)
gen = torch.Generator().manual_seed(a.seed)
all_ids, all_tgt = sequences(gen, a.steps)
ids = torch.zeros(a.batch, t, dtype=torch.long, device=dev)
tgt = torch.zeros(a.batch, t, dtype=torch.long, device=dev)
pos = torch.arange(t, device=dev).expand(a.batch, t)
dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32


def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=a.dtype == "bf16"):
        logits = model(ids, pos)
    loss = F.cross_entropy(logits.view(-1, a.vocab), tgt.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, a.clip)
    opt.step()
    return loss, logits


mode = "eager" if a.eager else "torch.cuda.graph"
print(f"#### copy task, PyTorch {torch.__version__} {mode} ({a.layers} layers, hidden {a.hidden}, "
      f"{a.heads} heads, {a.seq} + {a.seq} tokens, vocab {a.vocab}, batch {a.batch}, {a.steps} steps, "
      f"AdamW lr {a.lr}, clip {a.clip}, {a.dtype}{' autocast' if a.dtype == 'bf16' else ''})")
print(f"- {n_params} parameters")
ids.copy_(all_ids[0])
tgt.copy_(all_tgt[0])
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        step()
torch.cuda.current_stream().wait_stream(side)
torch.cuda.synchronize()
graph = None
if not a.eager:
    t0 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    print(f"- graph capture: {(time.perf_counter() - t0) * 1e3:.1f} ms")
busy = 0.0
mark = time.perf_counter()
for i in range(a.steps):
    ids.copy_(all_ids[i])
    tgt.copy_(all_tgt[i])
    if graph is not None:
        graph.replay()
        loss, logits = out
    else:
        loss, logits = step()
    if (i + 1) % a.log_every == 0 or i + 1 == a.steps:
        torch.cuda.synchronize()
        busy += time.perf_counter() - mark
        c, n = accuracy(logits, tgt)
        print(f"step {i + 1:>6}/{a.steps}  loss {loss.item():.4f}  accuracy {100.0 * c / n:.2f}% "
              f"(batch, repeated half)", flush=True)
        mark = time.perf_counter()
us = busy * 1e6 / a.steps
eval_gen = torch.Generator().manual_seed(a.seed ^ 0x5EEDCAFE)
correct = total = 0
with torch.no_grad():
    for _ in range(8):
        e_ids, e_tgt = sequences(eval_gen, 1)
        with torch.autocast("cuda", dtype=dtype, enabled=a.dtype == "bf16"):
            logits = model(e_ids[0], pos)
        c, n = accuracy(logits, e_tgt[0])
        correct += c
        total += n
print(f"final accuracy: {100.0 * correct / total:.2f}% ({correct}/{total} tokens of the repeated "
      f"half, fresh sequences)")
print(f"{'eager' if a.eager else 'torch.cuda.graph'}: {us:.1f} us/step ({a.steps} steps, batch copies included)")
