#!/usr/bin/env python3
"""PyTorch's graphed decode, the reference `cudagraph bench decode` is measured against (issue
29): a Hugging Face `AutoModelForCausalLM` read from a folder (bench/hf_models.py writes one),
on CUDA in --dtype, with a `StaticCache` and the single-token forward compiled with
`torch.compile(mode="reduce-overhead", dynamic=False)` -- what `generate(...,
cache_implementation="static")` does with a compiled forward, written as a plain loop so that
exactly the decode step is timed:

  per (prompt, batch): a StaticCache of max_cache_len = prompt + steps; random prompt ids
  (seeded); an eager prefill (logits of the last position only); then decode steps, each
  `torch.compiler.cudagraph_mark_step_begin()`, the compiled step (forward of one token per
  sequence, greedy argmax on the device) and the next ids copied into the input buffer.
  --warmup steps first (the first compiles, the next records the CUDA graph, the rest replay);
  then the cache is rewound to the prompt's end (its per-layer length tensors, or the
  cache_position we pass on transformers versions that take one) and --steps steps are timed
  with CUDA events, --repeats times; the median is reported.

Output (--json FILE, and a table on stdout): a JSON list with one object per (prompt, batch),
the fields `cudagraph bench decode --json` writes:
  prompt, batch        prompt tokens per sequence, sequences
  ms_per_step          median over the repeats of (elapsed of --steps steps) / steps
  tokens_per_s         batch * 1000 / ms_per_step
  capture_ms           wall time of the --warmup steps: compilation (a recompilation for each
                       new shape) and the CUDA graph's recording
  graph_mib            growth over those warm-up steps of the memory reserved in the caching
                       allocator's private pools (the CUDA graphs' pools), MiB; cudagraph
                       trees share one pool across shapes, so later buckets may show little
                       growth (memory the previous shape freed is not subtracted)
and, PyTorch's only: allocated_mib (memory_allocated growth over the warm-up), samples_ms
(every repeat's ms per step), warmup, repeats.

Fails (non-zero exit) when compilation fails, when inductor skipped CUDA graphs for the step
(its counter `cudagraph_skips`), when dynamo compiled again during the timed steps, when the
cache's length is not where it should be, or when the model's dtype is not --dtype.

usage: python3 bench/decode_torch.py --model DIR --dtype bf16 --batches 1,8,32,64
           --prompts 128,1024 --steps 64 --json FILE [--warmup 4] [--repeats 3] [--seed 0]
"""
import argparse
import inspect
import json
import statistics
import sys
import time

import torch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def die(msg):
    print(f"decode_torch.py: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--prompts", default="128,1024")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--no-fullgraph", action="store_true", help="allow graph breaks in the compiled step")
    p.add_argument("--mode", default="reduce-overhead", help="torch.compile mode (the reference: reduce-overhead)")
    p.add_argument("--device", default="cuda", help="cuda; cpu (with --mode default) only to smoke-test the script")
    args = p.parse_args()
    if args.warmup < 3:
        die("--warmup must be at least 3 (compile, record, replay)")
    if args.steps < args.warmup:
        die("--steps must be at least --warmup (the warm-up steps use the cache's positions too)")

    import transformers
    from transformers import AutoModelForCausalLM, StaticCache
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no progress bars in the logs

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        die("no CUDA device")
    dt = DTYPES[args.dtype]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(0) if cuda else dev}, torch.compile mode {args.mode}", file=sys.stderr)

    # Recompilation for each (prompt, batch) shape is expected: let dynamo keep them all.
    for name, value in (("cache_size_limit", 256), ("recompile_limit", 256),
                        ("accumulated_cache_size_limit", 4096), ("accumulated_recompile_limit", 4096)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dt, attn_implementation="sdpa")
    model = model.to(dev).eval()
    got = {t.dtype for t in model.parameters()}
    if got != {dt}:
        die(f"model parameters are {got}, wanted {dt}")
    vocab = model.config.vocab_size
    fwd_params = inspect.signature(model.forward).parameters
    keep = {}
    if "logits_to_keep" in fwd_params:
        keep = {"logits_to_keep": 1}
    elif "num_logits_to_keep" in fwd_params:
        keep = {"num_logits_to_keep": 1}
    else:
        die("the model's forward takes neither logits_to_keep nor num_logits_to_keep")
    # transformers 5.x renamed past_key_values to cache (the old name still works, with a
    # warning); later 5.x releases track the cache's length in the cache (a device tensor per
    # layer) and dropped cache_position. Pass what this version's forward names.
    cache_arg = "cache" if "cache" in fwd_params else "past_key_values"
    takes_position = "cache_position" in fwd_params

    def make_cache(max_len, batch):
        try:
            return StaticCache(config=model.config, max_cache_len=max_len)
        except TypeError:  # transformers before the lazily allocated StaticCache
            return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len,
                               device=dev, dtype=dt)

    def forward(ids, pos, cache):
        kw = {cache_arg: cache}
        if takes_position:
            kw["cache_position"] = pos
        return model(input_ids=ids, use_cache=True, **kw, **keep)

    def step(ids, pos, cache):
        return forward(ids, pos, cache).logits[:, -1, :].argmax(dim=-1, keepdim=True)

    def rewind(cache, pos, length):
        """Back to `length` cached positions: our position tensor and, where transformers keeps
        the length in the cache itself, each layer's (in place: their addresses are static)."""
        pos.fill_(length)
        for layer in getattr(cache, "layers", []):
            n = getattr(layer, "cumulative_length", None)
            if isinstance(n, torch.Tensor):
                n.fill_(length)
            elif n is not None:
                layer.cumulative_length = length

    def cached_length(cache):
        n = cache.get_seq_length()
        return int(n.item()) if isinstance(n, torch.Tensor) else int(n)

    compiled = torch.compile(step, mode=args.mode, fullgraph=not args.no_fullgraph, dynamic=False)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def skips():
        from torch._dynamo.utils import counters
        return int(counters["inductor"].get("cudagraph_skips", 0))

    def graph_pool_bytes():
        # Segments of private pools (CUDA graph pools) in the allocator's snapshot; the default
        # pool is (0, 0).
        if not cuda:
            return 0
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                   if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))

    def graphs():
        from torch._dynamo.utils import counters
        return int(counters["stats"].get("unique_graphs", 0))

    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for prompt in ints(args.prompts):
        for batch in ints(args.batches):
            max_len = prompt + args.steps
            limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
            if limit is not None and max_len > limit:
                die(f"prompt {prompt} + {args.steps} steps exceeds the model's {limit} positions")
            cache = make_cache(max_len, batch)
            prompt_ids = torch.randint(0, vocab, (batch, prompt), generator=gen).to(dev)
            with torch.no_grad():
                out = forward(prompt_ids, torch.arange(prompt, device=dev), cache)
                ids = out.logits[:, -1, :].argmax(dim=-1, keepdim=True).contiguous()
            del out
            if cached_length(cache) != prompt:
                die(f"after the prefill the cache holds {cached_length(cache)} positions, not {prompt}")
            pos = torch.tensor([prompt], device=dev, dtype=torch.long)

            def run_step():
                torch.compiler.cudagraph_mark_step_begin()
                nxt = compiled(ids, pos, cache)
                ids.copy_(nxt)
                pos.add_(1)

            sync()
            skips0 = skips()
            pool0 = graph_pool_bytes()
            allocated0 = torch.cuda.memory_allocated() if cuda else 0
            t0 = time.perf_counter()
            with torch.no_grad():
                for _ in range(args.warmup):
                    run_step()
            sync()
            capture_ms = (time.perf_counter() - t0) * 1e3
            graph_mib = (graph_pool_bytes() - pool0) / 2**20
            allocated_mib = ((torch.cuda.memory_allocated() if cuda else 0) - allocated0) / 2**20
            if skips() != skips0:
                die(f"inductor skipped CUDA graphs for prompt {prompt}, batch {batch} "
                    "(run with TORCH_LOGS=perf_hints to see why)")

            graphs0 = graphs()
            samples = []
            with torch.no_grad():
                for _ in range(args.repeats):
                    rewind(cache, pos, prompt)
                    sync()
                    if cuda:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        run_step()
                    if cuda:
                        end.record()
                        sync()
                        samples.append(start.elapsed_time(end) / args.steps)
                    else:
                        samples.append((time.perf_counter() - t) * 1e3 / args.steps)
            if graphs() != graphs0 or skips() != skips0:
                die(f"the step was compiled again (or ran without CUDA graphs) during the timed steps "
                    f"for prompt {prompt}, batch {batch}: raise --warmup, or see TORCH_LOGS=recompiles")
            for name, last in (("our position", int(pos.item())), ("the cache's length", cached_length(cache))):
                if last != prompt + args.steps:
                    die(f"{name} ended at {last}, expected {prompt + args.steps}")
            ms = statistics.median(samples)
            row = {
                "prompt": prompt,
                "batch": batch,
                "ms_per_step": ms,
                "tokens_per_s": batch * 1000.0 / ms,
                "capture_ms": capture_ms,
                "graph_mib": graph_mib,
                "allocated_mib": allocated_mib,
                "samples_ms": samples,
                "warmup": args.warmup,
                "repeats": args.repeats,
            }
            rows.append(row)
            print(f"prompt {prompt:5d} batch {batch:3d}: {ms:8.3f} ms/step {row['tokens_per_s']:10.0f} tok/s "
                  f"capture {capture_ms:9.0f} ms graph {graph_mib:8.1f} MiB", flush=True)
            del cache, prompt_ids, ids, pos
            sync()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
