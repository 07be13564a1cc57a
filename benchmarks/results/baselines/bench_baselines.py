"""Decode tokens/s of baselines vs epikv at one budget on the embedded model, one process, one run each."""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from epikv.engine import generate
from epikv.models import load_model
from epikv.failure import detect_all
torch.set_num_threads(2)
lm = load_model("smollm2")
prompt = "Explain step by step how to compute the sum of the first 100 positive integers, then give the answer."
rows = []
for pol in ["full", "epikv", "h2o", "tova", "raas", "rkv"]:
    r = generate(lm.model, lm.tokenizer, [prompt], policy=pol, budget=256 if pol != "full" else None,
                 max_new_tokens=300, chat=True, eos_token_ids=[])
    row = dict(policy=pol, budget=r.stats["budget"], tau=r.stats["tau"], prompt_tokens=r.prompt_tokens[0],
               new_tokens=r.stats["new_tokens"][0], decode_tokens_per_s=round(r.stats["tokens_per_s"], 2),
               max_cache_tokens=r.stats["max_cache_tokens"], evictions=r.stats["evictions"],
               failures=detect_all(r)[0].as_dict())
    print(json.dumps(row), flush=True)
