"""For every product the engine registry measured with our register-blocked kernels among its
candidates (`reg64:S`, `reg128:S`): the engine chosen, the best register-blocked time and the
best other time. Usage: python3 bench/registry_reg.py ENGINES.json..."""
import json
import sys

keys = won = 0
for path in sys.argv[1:]:
    table = json.load(open(path))
    for key, e in sorted(table["entries"].items()):
        for x in e["timings"]:
            if x["engine"].startswith("reg") and not x.get("us"):
                print(f"FAILED {key} {x['engine']}: {x.get('error')}")
        timed = [x for x in e["timings"] if x.get("us")]
        regs = [x for x in timed if x["engine"].startswith("reg")]
        if not regs:
            continue
        others = [x for x in timed if not x["engine"].startswith("reg")]
        keys += 1
        won += e["engine"].startswith("reg")
        r = min(regs, key=lambda x: x["us"])
        line = f"{key} -> {e['engine']}; best reg {r['engine']}={r['us']:.2f}"
        if others:
            b = min(others, key=lambda x: x["us"])
            line += f"; best other {b['engine']}={b['us']:.2f} ({r['us'] / b['us']:.2f}x)"
        print(line)
print(f"products with register-blocked candidates: {keys}; chosen: {won}")
