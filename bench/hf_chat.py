#!/usr/bin/env python3
"""A chat turn as transformers runs it, against `cudagraph generate --chat` (`bash bench/device.sh chat`).

Two modes.

--model DIR --out EXPECTED.json: gives a model folder (bench/hf_models.py writes none) a
tokenizer and a chat template, then runs one conversation the way a transformers user does:
  1. a byte-level BPE trained on a fixed English text with the model's vocabulary size and
     Llama 3's special tokens (<|begin_of_text|>, <|start_header_id|>, <|end_header_id|>,
     <|eot_id|>, <|end_of_text|>), and a chat template in the form of Llama 3's (a system turn,
     `trim`, slicing the messages, `raise_exception` for other roles); saved with
     save_pretrained, so the folder holds tokenizer.json, tokenizer_config.json and
     chat_template.jinja as checkpoints on the Hub do;
  2. AutoTokenizer.from_pretrained(DIR).apply_chat_template([system, user],
     add_generation_prompt=True): the rendered text and its token ids;
  3. --steps greedy tokens from the model in f32 (TF32 off; one full forward per step, so no
     cache is involved), with each step's top-2 margin over the row's largest logit, and the
     reply decoded without special tokens.
Writes EXPECTED.json: text, prompt_ids, tokens, margins, reply.

--check EXPECTED.json --stdout OURS.out --stderr OURS.err: reads what
`cudagraph generate --model DIR --dtype f32 --chat USER --system SYSTEM --show-prompt
--ignore-eos --greedy --max-new-tokens STEPS` printed (USER and SYSTEM: the `user` and `system` fields
of EXPECTED.json) and compares: the rendered conversation, the prompt
ids, the generated ids up to the first step whose margin is within --tol (1e-4, the f32
tolerance), and the decoded reply where every token was compared. Prints one line per check
and exits non-zero on a difference.

usage: python3 bench/hf_chat.py --model DIR --out EXPECTED.json [--steps 16]
       python3 bench/hf_chat.py --check EXPECTED.json --stdout OURS.out --stderr OURS.err
"""
import argparse
import json
import os
import re
import sys

SYSTEM = "You are a careful assistant. Answer in one short sentence."
USER = "  What do graphs of GPU kernels save, and when should a decode loop use them?  "

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Conversation roles must be user or assistant') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CORPUS = (
    "A CUDA graph records a sequence of kernel launches once and replays it with a single launch. "
    "Decode loops of language models launch hundreds of small kernels for every token, so the "
    "time spent launching them can exceed the time the kernels run. Capturing one decode step "
    "per batch size, with the inputs in static buffers and the cache positions in device memory, "
    "lets every later token cost one launch. The assistant answers questions about graphs, "
    "streams, memory pools, attention, caches, tokens and models in short clear sentences. "
)


def die(msg):
    print(f"hf_chat.py: {msg}", file=sys.stderr)
    sys.exit(1)


def ids_of(enc):
    """apply_chat_template's tokenized result: a list, or a mapping holding input_ids."""
    if isinstance(enc, list):
        return [int(t) for t in enc]
    return [int(t) for t in enc["input_ids"]]


def expected(args):
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([CORPUS] * 8, trainer)
    if bpe.get_vocab_size() > vocab:
        die(f"the tokenizer has {bpe.get_vocab_size()} tokens, the model {vocab}")
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(args.model)

    tok = AutoTokenizer.from_pretrained(args.model)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = ids_of(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
    seq, tokens, margins = list(prompt), [], []
    with torch.no_grad():
        for _ in range(args.steps):
            logits = model(torch.tensor([seq], device=args.device)).logits[0, -1].double()
            top = torch.topk(logits, 2)
            scale = float(logits.abs().max())
            margins.append(float(top.values[0] - top.values[1]) / max(scale, 1e-30))
            t = int(top.indices[0])
            tokens.append(t)
            seq.append(t)
    reply = tok.decode(tokens, skip_special_tokens=True)
    with open(args.out, "w") as f:
        json.dump(
            {"system": SYSTEM, "user": USER, "text": text, "prompt_ids": prompt, "tokens": tokens,
             "margins": margins, "reply": reply},
            f,
            indent=1,
        )
    print(f"transformers: {len(prompt)} prompt ids, {len(tokens)} greedy tokens, smallest margin {min(margins):.2e}")
    files = sorted(f for f in os.listdir(args.model) if f.startswith(("tokenizer", "chat_template", "special_tokens")))
    print(f"tokenizer files: {' '.join(files)}")


def check(args):
    with open(args.check) as f:
        exp = json.load(f)
    with open(args.stdout) as f:
        # The generated ids on the first line, then the decoded reply (which may hold newlines).
        first, _, rest = f.read().partition("\n")
    reply = rest[:-1] if rest.endswith("\n") else rest
    with open(args.stderr) as f:
        err = f.read()
    bad = 0

    def report(ok, what):
        nonlocal bad
        bad += 0 if ok else 1
        print(f"{'ok  ' if ok else 'DIFF'} {what}")

    m = re.search(r"conversation as the chat template renders it:\n(.*)\nprompt ids \((\d+)\): ([0-9,]*)\n", err, re.S)
    if not m:
        die("no rendered conversation and prompt ids in the stderr of cudagraph generate --show-prompt")
    text, ids = m.group(1), [int(t) for t in m.group(3).split(",") if t]
    report(text == exp["text"], f"rendered conversation, {len(exp['text'])} characters")
    report(ids == exp["prompt_ids"], f"prompt ids, {len(exp['prompt_ids'])} ({len(ids)} ours)")
    ours = [int(t) for t in first.split(",") if t.strip()]
    n = len(exp["tokens"])
    for i, margin in enumerate(exp["margins"]):
        if margin <= args.tol:
            n = i
            break
    same = ours[:n] == exp["tokens"][:n]
    report(same, f"greedy tokens, {n} of {len(exp['tokens'])} compared (up to the first margin within {args.tol:g})")
    if n == len(exp["tokens"]):
        report(reply == exp["reply"], "decoded reply")
    if bad:
        print(f"transformers: {exp['tokens']}\nours:         {ours}")
    print(f"chat: {'ok' if bad == 0 else f'{bad} difference' + ('s' if bad > 1 else '')}")
    sys.exit(1 if bad else 0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--check")
    p.add_argument("--stdout")
    p.add_argument("--stderr")
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args()
    if args.check:
        if not (args.stdout and args.stderr):
            die("--check needs --stdout and --stderr")
        check(args)
    elif args.model and args.out:
        expected(args)
    else:
        die("give --model DIR --out FILE, or --check FILE --stdout FILE --stderr FILE")


if __name__ == "__main__":
    main()
