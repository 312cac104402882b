"""Soft-label probe (2026-12-02, Intel Xeon with AMX), step 1: teacher-forced examples with the target's top-16 log-probabilities at
every position: 800 ChatGPT answers (`sharegpt_answers[-2800:-2000]`) to train, the bench's 48 plain greedy
answers to evaluate. Run from the repo root; step 2 is soft_labels_train.py."""
import json, os, sys, time, torch
import hf_adaptive_spec
from hf_adaptive_spec import models, load_drafter
from hf_adaptive_spec.training.cli import _prompts
from hf_adaptive_spec.training import data as D
from hf_adaptive_spec.drafters.laspec import gather_target_hidden
from hf_adaptive_spec.bench import encode_prompt
from hf_adaptive_spec.data import load_prompts
torch.set_num_threads(2)
TOPK = 16
os.makedirs("/tmp/probe_soft_labels", exist_ok=True)
target, tok = models.load("smollm2-135m-instruct")
drafter = load_drafter("laspec-smollm2-135m-instruct", target)
layer_ids = drafter.config.target_layer_ids

@torch.no_grad()
def soft_examples(items, batch_tokens=4096):
    """items: (ids, source, prompt_length) -> DrafterExamples with .soft_ids (L,K) .soft_logp (L,K)"""
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
    out_ex = [None] * len(items)
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order) and (stop - start + 1) * len(items[order[stop]][0]) <= batch_tokens:
            stop += 1
        chunk = order[start:stop]
        width = len(items[chunk[-1]][0])
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        am = torch.zeros_like(input_ids)
        for r, i in enumerate(chunk):
            n = len(items[i][0]); input_ids[r, :n] = items[i][0]; am[r, :n] = 1
        out = target(input_ids=input_ids, attention_mask=am, output_hidden_states=True, use_cache=False)
        hidden = gather_target_hidden(out.hidden_states, layer_ids).to(torch.float16)
        logp = out.logits.float().log_softmax(-1)
        top = logp.topk(TOPK, -1)
        labels = out.logits.argmax(-1)
        for r, i in enumerate(chunk):
            ids, source, pl = items[i]; n = len(ids)
            ex = D._example(ids, hidden[r, :n].clone(), labels[r, :n], source, pl)
            ex.soft_ids = top.indices[r, :n].to(torch.int32).clone()
            ex.soft_logp = top.values[r, :n].to(torch.float16).clone()
            out_ex[i] = ex
        start = stop
        print(f"\r{start}/{len(order)}", end="", flush=True)
    print()
    return out_ex

t = time.time()
spec = sys.argv[1] if len(sys.argv) > 1 else "sharegpt_answers[-2800:-2000]"
prompts = _prompts([spec])
items = []
for p in prompts:
    ids, pl = D._answered_ids(tok, p.messages, D.MAX_TEXT_TOKENS)
    items.append((ids, D.prompt_source(p), pl))
train = soft_examples(items)
print("train", len(train), sum(len(e) for e in train), "tokens", time.time() - t)
torch.save(train, "/tmp/probe_soft_labels/train.pt")
# eval: the bench's plain greedy answers to the 24 + 24 held-out prompts
r = json.load(open("docs/benchmarks/laspec_smollm2_2026-12-02_xeon_amx_limit24/results.json"))
prompts = {p.id: p for ds in ("mtbench", "humaneval") for p in load_prompts(ds)}
items = []
for rec in r["records"]:
    if rec["method"] != "plain": continue
    enc = encode_prompt(tok, prompts[rec["prompt_id"]].messages, "cpu")["input_ids"][0]
    items.append((torch.cat([enc, torch.tensor(rec["tokens"])]), rec["prompt_id"], len(enc)))
ev = soft_examples(items)
torch.save(ev, "/tmp/probe_soft_labels/eval.pt")
print("eval", len(ev), time.time() - t)
