import json, sys
def load(d): return {(r["trace_id"], r["policy"], r["budget"]): r for r in map(json.loads, open(d + "/results.jsonl"))}
a, b = load(sys.argv[1]), load(sys.argv[2])
M = {"seconds", "wall_s", "tokens_per_s", "peak_mem_mib", "peak_mem_kind"}
assert a.keys() == b.keys(), (len(a), len(b))
worst = {}
for k in a:
    assert a[k].keys() == b[k].keys()
    for f, v in a[k].items():
        if f in M: continue
        if isinstance(v, float): worst[f] = max(worst.get(f, 0), abs(v - b[k][f]))
        else: assert v == b[k][f], (k, f, v, b[k][f])
print(len(a), "records; max |diff| over float fields:", max(worst.values()), {f: f"{x:.1e}" for f, x in worst.items() if x})
