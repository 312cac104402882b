"""Probe (2026-12-02, Intel Xeon with AMX): the shipped drafter's depth-1 guess against the target's confidence in the token it guesses
(teacher-forced on the bench's plain answers; needs /tmp/probe_soft_labels/eval.pt from soft_labels_data.py)."""
import torch, random
import hf_adaptive_spec
from hf_adaptive_spec import models, load_drafter
from hf_adaptive_spec.training.trainer import make_batch, _labelled_logits
torch.set_num_threads(2)
target, tok = models.load("smollm2-135m-instruct")
ev = torch.load("/tmp/probe_soft_labels/eval.pt", weights_only=False)
model = load_drafter("laspec-smollm2-135m-instruct", target)
B = model.config.block_size
for name, exs in (("mtbench", [e for e in ev if e.source.startswith("mtbench")]), ("humaneval", [e for e in ev if not e.source.startswith("mtbench")])):
    pm_all, hit_all, top3_all = [], [], []
    gen = random.Random(5)
    with torch.no_grad():
        for i in range(0, len(exs), 4):
            chosen = exs[i:i+4]
            batch = make_batch(chosen, B, 128, gen, "cpu")
            logits, keep, labels = _labelled_logits(model, batch, B)
            pos = batch["position_ids"]
            R = pos.shape[0]
            pmax = torch.stack([c.soft_logp[pos[r].clamp(max=len(c)-1), 0].float().exp() for r, c in enumerate(chosen)]).view(R, -1, B)
            depth1 = torch.zeros_like(keep); depth1[..., 0] = True
            sel = keep & depth1
            # logits rows ordered as keep.nonzero(); pick the depth-1 ones
            rows = sel[keep]
            lg = logits[rows]
            lab = labels[sel]
            hit_all.append(lg.argmax(-1) == lab)
            top3_all.append((lg.topk(3, -1).indices == lab[:, None]).any(-1))
            pm_all.append(pmax[sel])
    pm = torch.cat(pm_all); hit = torch.cat(hit_all).float(); t3 = torch.cat(top3_all).float()
    print(name, "n", len(pm), "depth-1 top1 %.3f top3 %.3f" % (hit.mean(), t3.mean()))
    for lo, hi in ((0, .3), (.3, .5), (.5, .7), (.7, .9), (.9, 1.01)):
        m = (pm >= lo) & (pm < hi)
        print(f"  target p_max [{lo:.1f},{min(hi,1):.1f}): share {m.float().mean():.3f}  drafter top1 {hit[m].mean():.3f}  top3 {t3[m].mean():.3f}")
