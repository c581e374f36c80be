#!/usr/bin/env python3
"""Export PyTorch models for cudagraph: weights (safetensors), description (JSON), test I/O.

Writes, for an MLP and a small CNN built as ``nn.Sequential`` with a fixed seed:

- ``NAME.safetensors``: ``model.state_dict()`` as PyTorch saves it
  (``safetensors.torch.save_file``; names ``0.weight``, ``0.bias``, ...);
- ``NAME.json``: the model description cudagraph builds the model from
  (see ``crates/cudagraph-nn/src/io/``);
- ``NAME.io.safetensors``: ``input`` (fixed, seeded), ``output`` (PyTorch's forward on the
  chosen device, fp32, TF32 off) and ``reference`` (the forward in float64 on the CPU, stored
  as f32).

With the default output directory these are the fixtures of
``crates/cudagraph-nn/tests/gpu_io.rs``. Serve any exported model with
``cudagraph serve --model DIR/NAME``.

If the ``safetensors`` package is missing, the files are written by this script itself in the
same format (8-byte little-endian header length, JSON header, raw little-endian data).

Usage: python3 bench/export_pytorch.py [--out DIR] [--device cuda|cpu] [--no-safetensors-package]
"""

import argparse
import json
import os
import struct
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "crates", "cudagraph-nn", "tests", "data", "pytorch")


def write_safetensors(tensors, path, metadata=None):
    """The safetensors format by hand: {name: (shape, flat list of floats)} as F32."""
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    blobs = []
    for name in sorted(tensors):
        shape, values = tensors[name]
        n = 1
        for d in shape:
            n *= d
        if n != len(values):
            raise ValueError(f"{name}: {len(values)} values for shape {shape}")
        blob = struct.pack(f"<{n}f", *values)
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def save(tensors, path, use_package):
    """Saves {name: torch.Tensor} as F32 safetensors (the package if allowed and present)."""
    import torch

    cpu = {k: v.detach().to(torch.float32).cpu().contiguous() for k, v in tensors.items()}
    if use_package:
        try:
            from safetensors.torch import save_file

            save_file(cpu, path, metadata={"format": "pt"})
            return "safetensors"
        except ImportError:
            pass
    write_safetensors(
        {k: (list(v.shape), v.flatten().tolist()) for k, v in cpu.items()},
        path,
        metadata={"format": "pt"},
    )
    return "built-in writer"


def describe(model, input_shape):
    """The cudagraph model description of an nn.Sequential."""
    from torch import nn

    layers = []
    for i, m in enumerate(model):
        if isinstance(m, nn.Linear):
            if m.bias is None:
                layers.append({"linear": {"in": m.in_features, "out": m.out_features, "bias": False}})
            else:
                layers.append({"linear": [m.in_features, m.out_features]})
        elif isinstance(m, nn.Conv2d):
            k, s, p = m.kernel_size, m.stride, m.padding
            if (
                k[0] != k[1]
                or s[0] != s[1]
                or not isinstance(p, tuple)
                or p[0] != p[1]
                or m.dilation != (1, 1)
                or m.groups != 1
                or m.padding_mode != "zeros"
            ):
                raise ValueError(f"layer {i}: only square, undilated, ungrouped Conv2d is supported")
            layers.append(
                {
                    "conv2d": {
                        "in": m.in_channels,
                        "out": m.out_channels,
                        "kernel": k[0],
                        "stride": s[0],
                        "padding": p[0],
                        "bias": m.bias is not None,
                    }
                }
            )
        elif isinstance(m, nn.ReLU):
            layers.append("relu")
        elif isinstance(m, nn.MaxPool2d):
            k = m.kernel_size if isinstance(m.kernel_size, int) else m.kernel_size[0]
            s = m.stride if isinstance(m.stride, int) else m.stride[0]
            if m.padding not in (0, (0, 0)) or m.dilation not in (1, (1, 1)) or m.ceil_mode:
                raise ValueError(f"layer {i}: only MaxPool2d without padding/dilation/ceil_mode")
            layers.append({"max_pool2d": {"kernel": k, "stride": s}})
        elif isinstance(m, nn.Flatten):
            if m.start_dim != 1 or m.end_dim != -1:
                raise ValueError(f"layer {i}: only nn.Flatten() (start_dim=1) is supported")
            layers.append("flatten")
        else:
            raise ValueError(f"layer {i}: {type(m).__name__} is not supported by cudagraph")
    return {"input": list(input_shape), "layers": layers}


def models():
    import torch
    from torch import nn

    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    cnn = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(288, 32),
        nn.ReLU(),
        nn.Linear(32, 10, bias=False),
    )
    return [("mlp", mlp, (64,), 16), ("cnn", cnn, (1, 28, 28), 8)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: the test fixtures)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument(
        "--no-safetensors-package",
        action="store_true",
        help="write the files with the built-in writer even if safetensors is installed",
    )
    args = ap.parse_args()

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    for name, model, input_shape, rows in models():
        model = model.eval()
        x = torch.randn((rows, *input_shape), generator=gen)
        with torch.no_grad():
            out = model.to(device)(x.to(device)).float().cpu()
            ref = model.to("cpu").double()(x.double()).float()
            model = model.float()
        base = os.path.join(args.out, name)
        how = save(model.state_dict(), base + ".safetensors", not args.no_safetensors_package)
        with open(base + ".json", "w") as f:
            json.dump(describe(model, input_shape), f, indent=2)
            f.write("\n")
        save(
            {"input": x, "output": out, "reference": ref},
            base + ".io.safetensors",
            not args.no_safetensors_package,
        )
        diff = (out.double() - ref.double()).norm() / ref.double().norm()
        print(
            f"{name}: {base}.{{json,safetensors,io.safetensors}} ({how}); input {list(x.shape)}, "
            f"output {list(out.shape)} on {device}; |{device} - f64| / |f64| = {diff:.2e}"
        )
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"{total} bytes in {args.out}")
    if total >= 1 << 20:
        sys.exit("fixtures exceed 1 MB")


if __name__ == "__main__":
    main()
