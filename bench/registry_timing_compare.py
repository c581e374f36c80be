#!/usr/bin/env python3
"""Compares the sweep points of bench/device-s8a.sh: ours under CUDAGRAPH_REGISTRY_TIMING=chain,
single and both (ours-MODE-1.json, ours-MODE-2.json) against PyTorch (pytorch-1.json,
pytorch-2.json), each side at the faster of its two runs: geometric mean of ours / PyTorch and
the points above PyTorch per mode, then the points where the modes chose different engines.

usage: cd DIR && python3 bench/registry_timing_compare.py
"""
import json,math,sys
def load(f):
    d=json.load(open(f)); 
    return {(r['id'],r['mode']):r for r in d['rows']}
P=[load(f'pytorch-{i}.json') for i in (1,2)]
modes=('chain','single','both')
O={m:[load(f'ours-{m}-{i}.json') for i in (1,2)] for m in modes}
keys=list(P[0].keys())
def gm(xs): return math.exp(sum(map(math.log,xs))/len(xs))
for m in modes:
    rs=[];worse=[]
    for k in keys:
        p=min(P[0][k]['graph_us'],P[1][k]['graph_us'])
        o=min(O[m][0][k]['graph_us'],O[m][1][k]['graph_us'])
        rs.append(o/p)
        if o>p: worse.append((k,o,p,O[m][0][k]['engine']))
    print(m, 'geomean %.3f'%gm(rs), 'worse', len(worse))
    for w in worse: print('   ',w)
# per point: show cases where modes differ in engine
print("points where engines differ")
for k in keys:
    es=[O[m][0][k]['engine'] for m in modes]
    if len(set(es))>1:
        ts=['%.1f/%.1f'%(O[m][0][k]['graph_us'],O[m][1][k]['graph_us']) for m in modes]
        p='%.1f/%.1f'%(P[0][k]['graph_us'],P[1][k]['graph_us'])
        print(k, ' | '.join(f'{m}:{e} {t}' for m,e,t in zip(modes,es,ts)), '| pt', p)
