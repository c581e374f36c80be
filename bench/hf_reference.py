#!/usr/bin/env python3
"""Hugging Face's logits for `cudagraph bench parity` (issue 29's correctness target).

For --rows rows of random prompt ids of different lengths (--prompt-lens, default 57,128,20,
cycled when there are more rows), each row alone (no padding, batch 1):
  1. greedy generation of --decode-steps tokens with transformers' own KV cache (a DynamicCache,
     eager): prefill the prompt, then one token per step, the next token the argmax of the last
     logits (ties: the lowest id, as torch.argmax);
  2. a teacher-forced forward over prompt + generated ids in one call, whose logits are saved.
The model runs on --device (default cuda) in --dtype (its weights cast to it; f32 with TF32 off).

Writes --out, a safetensors file holding for each row b:
  ids.{b}      I32 [len_b]          prompt ids then the generated ids (len_b = prompt + steps)
  logits.{b}   F32 [len_b, vocab]   the teacher-forced logits (row t predicts id t+1)
  logits_f32.{b}  F32 [len_b, vocab]  (bf16 and f16 only) the same forward in f32 arithmetic
                                   from the same 16-bit weights, for context: how far the
                                   16-bit reference itself is from it
  logits_math.{b} F32 [len_b, vocab] (bf16 and f16 only, on CUDA) the teacher-forced forward
                                   with PyTorch's math backend of scaled_dot_product_attention
                                   instead of the one it picks (flash attention): how far two
                                   of transformers' own 16-bit paths are apart, for context
and the metadata (all strings): rows, prompt_lens (comma-separated), decode_steps, dtype.
The consumer prefills ids[:prompt_len], feeds ids[prompt_len:] one step at a time and compares
every logit row, alone and with all rows batched.

Also prints, per row, how many generated tokens differ from the argmax of the teacher-forced
logits and the smallest top-2 margin among them (both forwards are Hugging Face's, so these
are transformers' own incremental-vs-full differences). Exits non-zero on any error.

usage: python3 bench/hf_reference.py --model DIR --out FILE --dtype bf16|f32 --rows 3
           --decode-steps 32 [--prompt-lens 57,128,20] [--seed 0] [--device cuda]
"""
import argparse
import os
import sys

import torch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def die(msg):
    print(f"hf_reference.py: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--prompt-lens", default="57,128,20")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no progress bars in the logs

    lens = [int(x) for x in args.prompt_lens.split(",") if x.strip()]
    if args.rows < 1 or not lens or min(lens) < 1 or args.decode_steps < 1:
        die("need --rows >= 1, --decode-steps >= 1 and prompt lengths >= 1")
    lens = [lens[b % len(lens)] for b in range(args.rows)]
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        die("no CUDA device (use --device cpu to run on the CPU)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dt = DTYPES[args.dtype]

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dt, attn_implementation="sdpa")
    # Only the device: `.to(dtype=...)` would also cast the float32 buffers from_pretrained
    # keeps (the rotary inverse frequencies), which Hugging Face's own loading does not do.
    model = model.to(device=dev).eval()
    got = {t.dtype for t in model.parameters()}
    if got != {dt}:
        die(f"model parameters are {got}, wanted {dt}")
    # The same weights in f32 (exact: every 16-bit value is an f32), for the context logits.
    exact = None
    if dt != torch.float32:
        exact = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
        exact = exact.to(device=dev).eval()
    vocab = model.config.vocab_size
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit is not None and max(lens) + args.decode_steps > limit:
        die(f"prompt {max(lens)} + {args.decode_steps} steps exceeds the model's {limit} positions")

    # transformers 5.x renamed past_key_values to cache (the old name still works, with a warning).
    import inspect
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def cache_of(out):
        c = getattr(out, "cache", None)
        return c if c is not None else getattr(out, "past_key_values", None)

    gen = torch.Generator().manual_seed(args.seed)
    tensors = {}
    with torch.no_grad():
        for b, n in enumerate(lens):
            prompt = torch.randint(0, vocab, (1, n), generator=gen).to(dev)
            out = model(input_ids=prompt, use_cache=True)
            past = cache_of(out)
            if past is None:
                die("the model returned no KV cache")
            nxt = out.logits[:, -1, :].float().argmax(dim=-1, keepdim=True)
            generated = [nxt]
            for _ in range(args.decode_steps - 1):
                out = model(input_ids=nxt, use_cache=True, **{cache_arg: past})
                past = cache_of(out)
                nxt = out.logits[:, -1, :].float().argmax(dim=-1, keepdim=True)
                generated.append(nxt)
            ids = torch.cat([prompt] + generated, dim=1)
            if ids.shape != (1, n + args.decode_steps):
                die(f"row {b}: ids of shape {tuple(ids.shape)}")
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            if logits.shape != (n + args.decode_steps, vocab):
                die(f"row {b}: logits of shape {tuple(logits.shape)}, wanted {(n + args.decode_steps, vocab)}")
            if not torch.isfinite(logits).all():
                die(f"row {b}: non-finite logits")
            # Generated token t (at ids[n + t]) against the teacher-forced argmax of row n + t - 1.
            tf = logits[n - 1:n - 1 + args.decode_steps]
            top2 = tf.topk(2, dim=-1).values
            margin = (top2[:, 0] - top2[:, 1])
            differ = (tf.argmax(dim=-1) != ids[0, n:]).nonzero().flatten().tolist()
            note = ""
            if differ:
                note = f"; smallest top-2 margin there {margin[differ].min().item():.3g}"
            print(f"row {b}: prompt {n}, {args.decode_steps} generated; {len(differ)} generated tokens differ "
                  f"from the teacher-forced argmax{note}; smallest top-2 margin {margin.min().item():.3g}; "
                  f"|logits| max {logits.abs().max().item():.3g}")
            tensors[f"ids.{b}"] = ids[0].to(torch.int32).cpu().contiguous()
            tensors[f"logits.{b}"] = logits.cpu().contiguous()
            if exact is not None:
                tensors[f"logits_f32.{b}"] = exact(input_ids=ids, use_cache=False).logits[0].float().cpu().contiguous()
            if exact is not None and dev.type == "cuda":
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel([SDPBackend.MATH]):
                    alt = model(input_ids=ids, use_cache=False).logits[0].float()
                tensors[f"logits_math.{b}"] = alt.cpu().contiguous()

    meta = {
        "rows": str(args.rows),
        "prompt_lens": ",".join(str(n) for n in lens),
        "decode_steps": str(args.decode_steps),
        "dtype": args.dtype,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file(tensors, args.out, metadata=meta)
    print(f"{args.out}: {meta}")


if __name__ == "__main__":
    main()
