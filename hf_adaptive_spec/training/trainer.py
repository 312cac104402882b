"""Training a LaSpec drafter on target-made data (`training.data`), with accelerate.

Each step takes `batch_sequences` sequences and `anchors` random block anchors in each; all blocks of a
sequence run in ONE drafter forward (`forward_block(..., block_length=B)`: a block sees the target states
before its anchor, and itself causally). The loss is the acceptance-aware cross-entropy of docs/algorithms.md
section 2 (`loss="acceptance"`) or plain cross-entropy (`loss="ce"`), over block positions whose prefix is the
target's own greedy continuation.

The same code runs on one CPU or under `accelerate launch` on several GPUs (the drafter and optimizer go
through `Accelerator.prepare`; the frozen target stays outside it, on each process's device).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.laspec import LaSpecDrafterModel
from .checkpointing import resume_state, save_checkpoint
from .losses import acceptance_weighted_mean
from .schedule import warmup_cosine

__all__ = ["TrainConfig", "make_batch", "evaluate_acceptance", "train_drafter"]

LOSSES = ("acceptance", "ce")


@dataclass
class TrainConfig:
    """Training settings.

    Args:
        steps (`int`): optimizer steps (600).
        learning_rate (`float`): AdamW peak rate, linear warm-up over 5% of the steps, cosine decay (1e-3).
        weight_decay (`float`): AdamW weight decay (0.0).
        batch_sequences (`int`): sequences per step (4).
        anchors (`int`): block anchors per sequence (32).
        loss (`str`): "acceptance" (acceptance-aware) or "ce" (plain cross-entropy).
        checkpoint_every (`int`): save a resumable checkpoint every N steps (0: only at the end) (200).
        eval_every (`int`): held-out acceptance every N steps (0: only at the end) (100).
        seed (`int`): data order and initialisation (0).
        max_grad_norm (`float`): gradient clipping (1.0).
        max_seconds (`float`): a time budget for the steps, evaluations included (0: none). After the first
            `probe_steps` steps, fewer steps are planned if `steps` would not fit, and the schedule's warm-up
            and cosine decay follow the planned count (re-planned at each evaluation if running late).
        probe_steps (`int`): steps run before planning under `max_seconds`; the last two thirds are timed (the
            first steps pay one-off costs: on a GPU they took 3x longer than the rest) (30).
    """

    steps: int = 600
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    batch_sequences: int = 4
    anchors: int = 32
    loss: str = "acceptance"
    checkpoint_every: int = 200
    eval_every: int = 100
    seed: int = 0
    max_grad_norm: float = 1.0
    max_seconds: float = 0.0
    probe_steps: int = 30

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"TrainConfig.loss must be one of {LOSSES}, got {self.loss!r}.")
        if self.steps < 1 or self.batch_sequences < 1 or self.anchors < 1:
            raise ValueError("TrainConfig needs steps, batch_sequences and anchors >= 1.")
        if self.max_seconds < 0 or self.probe_steps < 1:
            raise ValueError("TrainConfig needs max_seconds >= 0 and probe_steps >= 1.")


def make_batch(examples: list, block_size: int, anchors: int, generator: random.Random, device,
               without_image: bool = False) -> dict:
    """Tensors for one step: `examples` padded to one length, `anchors` blocks per sequence (`without_image`:
    the context leaves out each example's image positions, `LaSpecDrafterConfig.context_without_image`).

    Returns a dict with `input_ids` `(R, A * B)`, `position_ids` `(R, A * B)`, `context` hidden `(R, L, F)`,
    `context_mask` `(R, L)`, `labels` `(R, A, B)` (-100 = not trained), and when an example has an image,
    `visual_embeds` `(R, A, M, H)` / `visual_mask` `(R, A, M)`: each anchor's selected visual tokens.
    """
    length = max(len(example) for example in examples)
    rows = len(examples)
    feature = examples[0].hidden.shape[-1]
    hidden = torch.zeros(rows, length, feature, dtype=torch.float32)
    context_mask = torch.zeros(rows, length, dtype=torch.bool)
    input_ids = torch.zeros(rows, anchors * block_size, dtype=torch.long)
    position_ids = torch.zeros(rows, anchors * block_size, dtype=torch.long)
    labels = torch.full((rows, anchors, block_size), -100, dtype=torch.long)
    offsets = torch.arange(block_size)
    with_images = [example for example in examples if example.visual_slots is not None]
    if with_images:  # each block sees the visual tokens the loop would select for its anchor
        num_visual = with_images[0].visual_slots.shape[1]
        visual_embeds = torch.zeros(rows, anchors, num_visual, with_images[0].visual_embeds.shape[-1])
        visual_mask = torch.zeros(rows, anchors, num_visual, dtype=torch.bool)
    for row, example in enumerate(examples):
        n = len(example)
        hidden[row, :n] = example.hidden.float()
        context_mask[row, :n] = True
        if without_image and example.image_positions is not None:
            context_mask[row, :n] &= ~example.image_positions
        low = example.prompt_length if 1 <= example.prompt_length < n else 1  # blocks start in the answer
        starts = [generator.randrange(low, n) for _ in range(anchors)] if n > 1 else [0] * anchors
        starts = torch.tensor(starts)
        input_ids[row].view(anchors, block_size)[:, 0] = example.input_ids[starts]
        positions = starts[:, None] + offsets  # (A, B)
        position_ids[row] = positions.flatten()
        # position k predicts the token after p + k; trained while p+1..p+k are the target's greedy tokens
        inside = positions < n
        clipped = positions.clamp(max=n - 1)
        greedy_prefix = torch.ones_like(inside)
        greedy_prefix[:, 1:] = example.on_policy[clipped[:, 1:] - 1]
        trained = (inside & greedy_prefix).cumprod(-1).bool()  # stops at the first miss
        labels[row] = torch.where(trained, example.labels[clipped], labels[row])
        if with_images and example.visual_slots is not None:
            for a, p in enumerate(starts.tolist()):
                if p > 0:
                    slots = example.visual_slots[p - 1]  # picked by the query of the position before the anchor
                    visual_mask[row, a] = slots >= 0
                    visual_embeds[row, a] = example.visual_embeds[slots.clamp_min(0)].float()
    batch = {"input_ids": input_ids.to(device), "position_ids": position_ids.to(device), "context": hidden.to(device),
             "context_mask": context_mask.to(device), "labels": labels.to(device)}
    if with_images:
        batch["visual_embeds"], batch["visual_mask"] = visual_embeds.to(device), visual_mask.to(device)
    return batch


def _labelled_logits(drafter, batch: dict, block_size: int) -> tuple:
    """The drafter's logits at the labelled block positions only: `(K, V)`, the `(R, A, B)` mask of those
    positions, and the `(R, A, B)` labels indexed like the logits' last dimension.

    The LM head (the target's, a vocabulary wide) is most of a step's cost, and positions without a label
    (past an off-policy token, past the end) need none. A drafter with a draft vocabulary is trained, and
    scored, over those tokens only (what decoding drafts from; ~2x faster steps with 16384 of SmolLM2's 49152
    tokens): a label outside it counts as no label, so the acceptance-aware weights end the chain there."""
    model = drafter.module if hasattr(drafter, "module") else drafter
    context = model.encode_context(batch["context"])
    out = model.forward_block(batch["input_ids"], context, context_mask=batch["context_mask"],
                              position_ids=batch["position_ids"], block_length=block_size, output_logits=False,
                              visual_embeds=batch.get("visual_embeds"), visual_mask=batch.get("visual_mask"))
    rows = out.last_hidden_state.shape[0]
    hidden = out.last_hidden_state.view(rows, -1, block_size, out.last_hidden_state.shape[-1])  # (R, A, B, H)
    labels = batch["labels"]
    if model.draft_vocab is None:
        keep = labels != -100
        return model.logits_from_hidden(hidden[keep]), keep, labels
    labels = model.draft_vocab_index(labels)  # -1: no label, or a token that cannot be drafted
    keep = labels >= 0
    return model.draft_vocab_logits(hidden[keep]), keep, labels


def _loss(logits: torch.Tensor, keep: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    """The loss from labelled logits `(K, V)` and labels ([`_labelled_logits`]); equals `acceptance_aware_loss` (or
    cross-entropy) over the full `(R * A, B, V)` logits with -100 labels elsewhere (tested)."""
    cross_entropy = F.cross_entropy(logits.float(), labels[keep], reduction="none")  # (K,)
    if kind == "ce":
        return cross_entropy.mean()
    accept = torch.zeros(keep.shape, dtype=torch.float32, device=logits.device)
    accept[keep] = torch.exp(-cross_entropy.detach())  # greedy a_k = q_k(t_k); 0 where there is no label
    per_position = torch.zeros_like(accept).masked_scatter(keep, cross_entropy)
    block = keep.shape[-1]
    return acceptance_weighted_mean(per_position.view(-1, block), accept.view(-1, block), keep.view(-1, block))


@torch.no_grad()
def evaluate_acceptance(drafter, examples: list, block_size: int, anchors: int = 64, seed: int = 1234,
                        device=None) -> dict:
    """Held-out greedy acceptance of the drafter's chain, teacher-forced.

    For random anchors, the number of leading block positions whose argmax equals the target's greedy token
    (positions without a label end the count; with a draft vocabulary, the argmax is over it and a token
    outside it is a miss, as in decoding). Returns `{"accepted": mean accepted per block,
    "tau_chain": 1 + accepted, "top1": per-position accuracy list}`.
    """
    model = drafter.module if hasattr(drafter, "module") else drafter
    was_training = model.training
    model.eval()
    device = device or model.device
    generator = random.Random(seed)
    total, count = 0.0, 0
    hits = torch.zeros(block_size)
    seen = torch.zeros(block_size)
    for start in range(0, len(examples), 4):
        batch = make_batch(examples[start : start + 4], block_size, anchors, generator, device,
                           without_image=model.config.context_without_image)
        logits, keep, drafted_labels = _labelled_logits(model, batch, block_size)
        right = torch.zeros_like(keep)  # (R, A, B); a label the drafter cannot draft stays a miss
        right[keep] = logits.argmax(-1) == drafted_labels[keep]
        labelled = batch["labels"] != -100
        total += float(right.long().cumprod(-1).sum(-1).float().sum())
        count += labelled.shape[0] * labelled.shape[1]
        hits += right.sum((0, 1)).float().cpu()
        seen += labelled.sum((0, 1)).float().cpu()
    model.train(was_training)
    accepted = total / max(count, 1)
    return {"accepted": accepted, "tau_chain": 1.0 + accepted, "top1": (hits / seen.clamp_min(1)).tolist()}


def train_drafter(drafter: LaSpecDrafterModel, train_examples: list, eval_examples: list, config: TrainConfig,
                  out_dir=None, resume: bool = False, accelerator=None, progress: bool = True, log=print) -> dict:
    """Train `drafter` (attached to its target) in place; returns the history.

    Args:
        drafter ([`LaSpecDrafterModel`]): attached to the target (`attach_target`).
        train_examples, eval_examples: [`DrafterExample`] lists.
        config ([`TrainConfig`]).
        out_dir (path, *optional*): where checkpoints (`checkpoint-N/`) and the final model go.
        resume (`bool`): continue from the latest checkpoint in `out_dir`.
        accelerator (`accelerate.Accelerator`, *optional*): created if not given.

    Returns:
        dict with `history` (step, loss, lr, seconds), `evals` (step, accepted, tau_chain, top1) and `config`
        (with `steps_run`: the steps planned, fewer than `config.steps` under `max_seconds`).
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    if not train_examples:
        raise ValueError("train_drafter needs at least one training example.")
    if not drafter.has_target:
        raise ValueError("Attach the drafter to its target first: drafter.attach_target(target).")
    accelerator = accelerator or Accelerator()
    block_size = drafter.config.block_size
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=config.learning_rate,
                                  weight_decay=config.weight_decay)
    total = config.steps  # planned steps: fewer than config.steps when max_seconds says so

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, total))
    model, optimizer = accelerator.prepare(drafter, optimizer)
    out_dir = Path(out_dir) if out_dir is not None else None
    state, start_step, history, evals = resume_state(out_dir, resume, log)
    generator = random.Random(config.seed * 1000 + accelerator.process_index)
    if state is not None:
        accelerator.unwrap_model(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        total = state.get("total", config.steps)
        generator.setstate(state["random"])

    model.train()
    bar = tqdm(desc=f"train ({config.loss})", disable=not progress, initial=start_step, total=total)
    started = time.perf_counter()

    def plan(done: int, per_step: float) -> int:
        """Steps that fit in what is left of max_seconds at `per_step` seconds each (never below done + 1);
        the smallest plan of all processes, so that they stop together."""
        left = config.max_seconds - (time.perf_counter() - started)
        planned = max(done + 1, min(total, done + int(0.95 * left / per_step)))
        return int(accelerator.gather(torch.tensor([planned], device=accelerator.device)).min())

    warm_steps, warm_time = config.probe_steps // 3, started
    step = start_step
    without_image = (drafter.module if hasattr(drafter, "module") else drafter).config.context_without_image
    while step < total:
        chosen = [train_examples[generator.randrange(len(train_examples))] for _ in range(config.batch_sequences)]
        batch = make_batch(chosen, block_size, config.anchors, generator, accelerator.device,
                           without_image=without_image)
        with accelerator.autocast():
            logits, keep, labels = _labelled_logits(model, batch, block_size)
            loss = _loss(logits, keep, labels, config.loss)
        optimizer.zero_grad()
        accelerator.backward(loss)
        if config.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        history.append({"step": step + 1, "loss": loss.item(), "lr": scheduler.get_last_lr()[0],
                        "seconds": time.perf_counter() - started})
        scheduler.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update(1)
        step = done = step + 1
        if done - start_step == warm_steps:
            warm_time = time.perf_counter()  # the first steps pay one-off costs (allocator, kernels): not timed
        if config.max_seconds and done - start_step == config.probe_steps:
            total = plan(done, (time.perf_counter() - warm_time) / (config.probe_steps - warm_steps))
            bar.total = total
            if total < config.steps:
                log(f"max_seconds {config.max_seconds:g}: planning {total} steps (not {config.steps})")
        if eval_examples and (done == total or (config.eval_every and done % config.eval_every == 0)):
            result = evaluate_acceptance(model, eval_examples, block_size, device=accelerator.device)
            evals.append({"step": done, **result})
            log(f"step {done}: loss {loss.item():.3f}, held-out tau_chain {result['tau_chain']:.3f}")
            if config.max_seconds and done < total and done - start_step > config.probe_steps:
                per_step = (time.perf_counter() - started) / (done - start_step)  # evaluations included
                if (replanned := plan(done, per_step)) < total:
                    total = bar.total = replanned
                    log(f"max_seconds {config.max_seconds:g}: running late, now planning {total} steps")
        if out_dir is not None and accelerator.is_main_process and (
                done == total or (config.checkpoint_every and done % config.checkpoint_every == 0)):
            save_checkpoint(out_dir, done, {
                "model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "step": done, "history": history, "evals": evals,
                "random": generator.getstate(), "config": asdict(config), "total": total}, evals)
    bar.close()
    model.eval()
    return {"history": history, "evals": evals, "config": {**asdict(config), "steps_run": total}}
