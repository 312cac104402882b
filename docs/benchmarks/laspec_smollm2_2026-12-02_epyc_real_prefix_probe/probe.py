"""Probe: does a block drafter trained with a real-token prefix in the block (k real columns, then MASK)
predict deeper tokens better when fed its own earlier guesses (autoregressive / 2-pass) than MASK-only?
Teacher-forced on the target's greedy answers to held-out MT-Bench / HumanEval prompts.

Usage: python probe.py SECONDS [ARM ...] (arms: fixed1, random; default both). results.json came from
`probe.py 600` before the mask_or_ar_tau column was added; results_union_rerun.json from `probe.py 556 random`."""
import json, random, sys, time
import torch
import hf_adaptive_spec
from hf_adaptive_spec.training import trainer as T
from hf_adaptive_spec.training import cli as C
from hf_adaptive_spec.training.data import build_examples, save_examples, load_examples
from hf_adaptive_spec.drafters import laspec as L
from pathlib import Path

torch.set_num_threads(2)
SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 600
OUT = Path("/tmp/probe_real_prefix")
target, tok = C._load_target("smollm2-135m-instruct")
target.eval()
ckpt = Path(hf_adaptive_spec.__file__).parent / "checkpoints" / "laspec-smollm2-135m-instruct"
base = L.LaSpecDrafterModel.from_pretrained(ckpt, dtype=torch.float32)
layer_ids = base.config.target_layer_ids
B = base.config.block_size

def cached(name, specs, **kw):
    path = OUT / f"{name}.pt"
    if path.exists():
        return load_examples(path)
    t = time.time()
    ex = build_examples(target, tok, layer_ids, prompts=C._prompts(specs), progress=False, **kw)
    save_examples(ex, path)
    print(name, len(ex), "examples", round(time.time() - t), "s", flush=True)
    return ex

train = cached("train", ["sharegpt_answers[-2000:-1400]"])
mt = cached("mt", ["mtbench[:24]"], max_new_tokens=128)
he = cached("he", ["humaneval[:24]"], max_new_tokens=128)

# ---- patches: REAL[k] -> block columns < k hold the real tokens (teacher-forced), the rest MASK
STATE = {"k": None, "mode": "fixed1"}
_orig_make_batch = T.make_batch
def make_batch(examples, block_size, anchors, generator, device):
    batch = _orig_make_batch(examples, block_size, anchors, generator, device)
    rows = len(examples)
    ids = batch["input_ids"].view(rows, anchors, block_size)
    pos = batch["position_ids"].view(rows, anchors, block_size).cpu()
    for r, ex in enumerate(examples):
        ids[r] = ex.input_ids[pos[r].clamp(max=len(ex) - 1)].to(ids.device)
    if STATE["mode"] == "random":
        k = torch.randint(1, block_size + 1, (rows, anchors), generator=None)
    else:
        k = torch.full((rows, anchors), STATE["fixed"], dtype=torch.long)
    STATE["k"] = k.to(ids.device)
    return batch
T.make_batch = make_batch

def _embed_block(self, input_ids, embedding, dtype, block_length):
    batch, length = input_ids.shape
    col = torch.arange(length, device=input_ids.device) % block_length
    k = STATE["k"]
    if k is None or k.shape[0] != batch:
        real = (col == 0)[None].expand(batch, -1)
    else:
        real = col[None, :] < k.repeat_interleave(block_length, dim=1)  # (B, L)
    with torch.no_grad():
        mask_id = 0 if self.mask_embedding is not None else self.config.mask_token_id
        ids = torch.where(real, input_ids, mask_id)
        embedded = embedding(ids).to(dtype)
    if self.input_proj is not None:
        embedded = self.input_proj(embedded)
    if self.mask_embedding is None:
        return embedded
    return torch.where(real[..., None], embedded, self.mask_embedding.to(dtype))
L.LaSpecDrafterModel._embed_block = _embed_block

@torch.no_grad()
def rights(model, examples, k, seed=1234, anchors=64):
    """(N, B) right flags per anchor with k real columns (same anchors for every k: same seed)."""
    STATE["mode"], STATE["fixed"] = "fixed", k
    gen = random.Random(seed)
    out = []
    for s in range(0, len(examples), 4):
        batch = make_batch(examples[s:s + 4], B, anchors, gen, model.device)
        logits, keep, lab = T._labelled_logits(model, batch, B)
        right = torch.zeros_like(keep)
        right[keep] = logits.argmax(-1) == lab[keep]
        labelled = batch["labels"] != -100
        right = right & labelled
        out.append(right.view(-1, B))
    return torch.cat(out)

def report(name, model):
    model.eval()
    res = {}
    for set_name, ex in (("mt", mt), ("he", he)):
        r = {k: rights(model, ex, k) for k in range(1, B + 1)}
        mask_accepted = r[1].long().cumprod(-1).sum(-1)  # the MASK block's chain
        ar = torch.stack([r[k][:, k - 1] for k in range(1, B + 1)], -1)  # one pass per depth, own guesses fed back
        ar_accepted = ar.long().cumprod(-1).sum(-1)
        two = torch.cat([r[1][:, :1], r[2][:, 1:]], -1)  # depth 1 from the MASK block, depths 2-4 from [bonus, d1]
        two_accepted = two.long().cumprod(-1).sum(-1)
        union = torch.maximum(mask_accepted, ar_accepted)  # both chains as two branches of one tree
        tau = lambda accepted: 1 + accepted.float().mean().item()
        res[set_name] = {"mask_tau": tau(mask_accepted), "mask_or_ar_tau": tau(union), "two_pass_tau": tau(two_accepted),
                         "ar_tau": tau(ar_accepted),
                         "mask_top1": r[1].float().mean(0).tolist(), "ar_top1_cond": ar.float().mean(0).tolist()}
    print(name, json.dumps(res), flush=True)
    return res

results = {}
base.attach_target(target)
results["v8"] = report("v8", base)
for arm in sys.argv[2:] if len(sys.argv) > 2 else ["fixed1", "random"]:
    model = L.LaSpecDrafterModel.from_pretrained(ckpt, dtype=torch.float32).attach_target(target)
    model.train()
    STATE["mode"], STATE["fixed"] = ("random", 1) if arm == "random" else ("fixed", 1)
    cfg = T.TrainConfig(steps=100000, learning_rate=2e-4, batch_sequences=8, anchors=32, checkpoint_every=0,
                        eval_every=0, max_seconds=SECONDS)
    t = time.time()
    hist = T.train_drafter(model, train, train[:8], cfg, progress=False, log=lambda *a: None)
    print(arm, "trained", hist["config"].get("steps_run"), "steps in", round(time.time() - t), "s", flush=True)
    results[arm] = report(arm, model)
json.dump(results, open(OUT / ("probe_" + "_".join(sys.argv[2:] or ["fixed1", "random"]) + ".json"), "w"), indent=1)
