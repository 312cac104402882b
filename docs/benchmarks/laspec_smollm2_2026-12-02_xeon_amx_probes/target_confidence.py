"""Probe (2026-12-02, Intel Xeon with AMX): how sure is the target of its own greedy tokens on the bench's answers? (run from the repo root)"""
import torch, json
from hf_adaptive_spec import models
from hf_adaptive_spec.data import load_prompts, interleave_categories
torch.set_num_threads(2)
target, tok = models.load("smollm2-135m-instruct")
r = json.load(open("docs/benchmarks/laspec_smollm2_2026-12-02_xeon_amx_limit24/results.json"))
recs = [x for x in r["records"] if x["method"]=="plain"]
print(len(recs), recs[0].keys())
from hf_adaptive_spec.bench import encode_prompt
prompts = {p.id: p for ds in ("mtbench","humaneval") for p in load_prompts(ds)}
stats = {}
for rec in recs:
    p = prompts[rec["prompt_id"]]
    enc = encode_prompt(tok, p.messages, "cpu")
    ids = torch.cat([enc["input_ids"][0], torch.tensor(rec["tokens"])])
    with torch.no_grad():
        logits = target(ids[None]).logits[0].float()
    P = enc["input_ids"].shape[1]
    lp = logits[P-1:-1].softmax(-1)
    top2 = lp.topk(2, -1).values
    s = stats.setdefault(rec["dataset"], [])
    s.append(top2)
for ds, s in stats.items():
    t = torch.cat(s)
    pm = t[:,0]
    print(ds, "tokens", len(pm), "mean pmax %.3f" % pm.mean(), "median %.3f"%pm.median(), "frac pmax<0.5 %.3f"%(pm<0.5).float().mean(), "frac pmax>0.9 %.3f"%(pm>0.9).float().mean(), "mean top1+top2 %.3f"%t.sum(1).mean())
