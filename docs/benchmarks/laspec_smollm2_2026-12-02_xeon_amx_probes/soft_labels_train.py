"""Soft-label probe (2026-12-02, Intel Xeon with AMX), step 2: fine-tune the shipped drafter 900 steps (same data, order and schedule)
with per-position loss (1 - lam) * CE(target argmax) + lam * CE(target top-16, renormalised), acceptance-aware
weights as in the trainer; teacher-forced chain tau on the bench's answers. `python soft_labels_train.py 900 0,0.5,1`."""
import math, random, sys, time, json, torch
import hf_adaptive_spec
from hf_adaptive_spec import models, load_drafter
from hf_adaptive_spec.training.trainer import make_batch, _labelled_logits, evaluate_acceptance
from hf_adaptive_spec.training.losses import acceptance_weighted_mean
torch.set_num_threads(2)
target, tok = models.load("smollm2-135m-instruct")
train = torch.load("/tmp/probe_soft_labels/train.pt", weights_only=False)
ev = torch.load("/tmp/probe_soft_labels/eval.pt", weights_only=False)
ev_mt = [e for e in ev if e.source.startswith("mtbench")]
ev_he = [e for e in ev if not e.source.startswith("mtbench")]
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 900
LAMBDAS = [float(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0.0, 0.5, 1.0]
LR = 2e-4

def evaluate(model):
    mt = evaluate_acceptance(model, ev_mt, 4, anchors=128)
    he = evaluate_acceptance(model, ev_he, 4, anchors=128)
    return {"mt": round(mt["tau_chain"], 4), "mt_top1": [round(x, 3) for x in mt["top1"]],
            "he": round(he["tau_chain"], 4), "he_top1": [round(x, 3) for x in he["top1"]]}

def soft_batch(chosen, batch, B):
    pos = batch["position_ids"]  # (R, A*B)
    R = pos.shape[0]
    ids = torch.stack([c.soft_ids[pos[r].clamp(max=len(c) - 1)] for r, c in enumerate(chosen)])  # (R, A*B, K)
    lp = torch.stack([c.soft_logp[pos[r].clamp(max=len(c) - 1)] for r, c in enumerate(chosen)])
    return ids.view(R, -1, B, ids.shape[-1]).long(), lp.view(R, -1, B, lp.shape[-1]).float()

def run(lam):
    model = load_drafter("laspec-smollm2-135m-instruct", target)
    B = model.config.block_size
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    warm = max(1, STEPS // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                              0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, STEPS - warm)))))
    gen = random.Random(0)
    t = time.time()
    for step in range(STEPS):
        chosen = [train[gen.randrange(len(train))] for _ in range(8)]
        batch = make_batch(chosen, B, 32, gen, "cpu")
        sid, slp = soft_batch(chosen, batch, B)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, keep, labels = _labelled_logits(model, batch, B)
        logq = logits.float().log_softmax(-1)
        hard = -logq.gather(1, labels[keep][:, None]).squeeze(1)
        ce = hard
        if lam > 0:
            idx = model.draft_vocab_index(sid[keep])  # (K, 16), -1 outside the draft vocabulary
            p = slp[keep].exp() * (idx >= 0)
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
            soft = -(p * logq.gather(1, idx.clamp_min(0))).sum(-1)
            ce = (1 - lam) * hard + lam * soft
        accept = torch.zeros(keep.shape)
        accept[keep] = torch.exp(-hard.detach())
        per = torch.zeros(keep.shape).masked_scatter(keep, ce)
        loss = acceptance_weighted_mean(per.view(-1, B), accept.view(-1, B), keep.view(-1, B))
        opt.zero_grad(); loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); sched.step()
        if step % 100 == 0:
            print(f"lam {lam} step {step} loss {loss.item():.3f} {time.time()-t:.0f}s", flush=True)
    model.eval()
    return model, time.time() - t

results = {}
base = load_drafter("laspec-smollm2-135m-instruct", target)
results["shipped"] = evaluate(base); print("shipped", results["shipped"], flush=True)
for lam in LAMBDAS:
    model, secs = run(lam)
    results[f"lam{lam}"] = {**evaluate(model), "seconds": round(secs)}
    print(f"lam {lam}", results[f"lam{lam}"], flush=True)
    model.save_pretrained(f"/tmp/probe_soft_labels/arm_lam{lam}")
json.dump(results, open(f"/tmp/probe_soft_labels/results_{STEPS}.json", "w"), indent=1)
