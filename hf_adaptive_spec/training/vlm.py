"""Training the scenes VLM (`hf_adaptive_spec.scenes.vlm`): a vision tower and projector under SmolLM2, whose
linear layers learn low-rank updates (LoRA) in the last stage.

Three stages, all on seeded random train scenes (`hf_adaptive_spec.scenes.dataset`):

1. **tower**: the vision tower alone, as a classifier: its patch features (the ones the projector reads),
   averaged over each quadrant and each on its own (`patch_weight`), predict that quadrant's colour and shape
   through two linear heads. End-to-end
   language-model loss alone stalls: the tower must first learn to see.
2. **align**: the projector (and the tower, slowly) learn to write, in every row of patches of a quadrant, the
   input embeddings of the four words that name it (" Top" / " Bottom", " left" / " right", its colour, its
   shape; first token of each), so that the image reads to the frozen language model like a short text
   ("Top left red circle Top right blue triangle ..."), which it can copy from. No language-model forward:
   cheap. Without it, the language-model loss alone reached 41% of colours after 2,000 samples.
3. **lm**: tower + projector + the language model's low-rank updates (`lora_rank`; 0 keeps it frozen), on the
   language-model loss of the assistant's answers (the scene's description, or the answer to one question
   about one position), plus the stage-1 classification loss (`aux_weight`) and the stage-2 alignment loss
   (`align_weight`), so that neither is forgotten. With the language model frozen, 3,200 samples reached 35%
   of held-out colours: even an image that reads exactly like the description's words does not make the frozen
   SmolLM2 answer in the description's format (0% with oracle embeddings in the image's place).

Runs on one CPU or under `accelerate launch`; checkpoints (`checkpoint-N/`) hold the trained parts, the heads
and the optimizer, and `resume` continues from the latest one.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..chat_template import chat_text, encode_chat
from ..scenes.dataset import COLORS, DESCRIBE_REQUEST, POSITIONS, SHAPES, make_scenes, scene_messages
from .checkpointing import resume_state, save_checkpoint
from .schedule import warmup_cosine

__all__ = ["QuadrantHeads", "VLMTrainConfig", "evaluate_scenes", "parse_description", "train_scenes_vlm"]


@dataclass
class VLMTrainConfig:
    """Settings of `train_scenes_vlm` (defaults: the shipped run)."""

    tower_steps: int = 1500
    tower_batch: int = 64
    tower_lr: float = 2e-3
    align_steps: int = 300
    align_batch: int = 64
    align_lr: float = 2e-3
    align_weight: float = 0.5
    lm_steps: int = 300
    lm_batch: int = 8
    lm_lr: float = 1e-3
    lm_tower_lr: float = 2e-4
    lora_rank: int = 16  # low-rank updates of the language model's linear layers in the lm stage (0: frozen)
    lora_alpha: float = 32.0
    lora_lr: float = 1e-3
    aux_weight: float = 0.5
    patch_weight: float = 0.5  # classification of every patch (not only of quadrant means), in all stages
    describe_fraction: float = 0.5  # share of LM samples that ask for the description (the rest: one question)
    bf16: bool = True  # autocast the LM stage to bfloat16 (CPUs with AMX / GPUs)
    eval_scenes: int = 48
    eval_every: int = 0  # LM steps between held-out evaluations (0: only at the end)
    checkpoint_every: int = 100
    seed: int = 0


class QuadrantHeads(nn.Module):
    """Colour and shape logits of each quadrant from the tower's patch features (the projector's input)."""

    def __init__(self, hidden_size: int, grid: int):
        super().__init__()
        self.grid = grid
        self.color = nn.Linear(hidden_size, len(COLORS))
        self.shape = nn.Linear(hidden_size, len(SHAPES))

    def forward(self, patches: torch.Tensor, per_patch: bool = False) -> tuple:
        """Colour and shape logits of each quadrant's mean feature, (B, 4, C) in POSITIONS order; with
        `per_patch`, of every patch of each quadrant, (B, 4, patches per quadrant, C)."""
        batch, _, hidden = patches.shape
        half = self.grid // 2
        grid = patches.reshape(batch, 2, half, 2, half, hidden)  # (B, row half, row, col half, col, H)
        if per_patch:
            quadrants = grid.permute(0, 1, 3, 2, 4, 5).reshape(batch, 4, half * half, hidden)
        else:
            quadrants = grid.mean(dim=(2, 4)).reshape(batch, 4, hidden)  # (B, 4, H): TL, TR, BL, BR
        return self.color(quadrants), self.shape(quadrants)


def _patch_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """(B, 64, H) patch features as the projector sees them (the configured layer, CLS dropped)."""
    tower = model.model.vision_tower
    out = tower(pixel_values, output_hidden_states=True)
    return out.hidden_states[model.config.vision_feature_layer][:, 1:]


def _targets(scenes: list, device) -> tuple:
    colors = torch.tensor([[COLORS.index(c) for c, _ in s.objects] for s in scenes], device=device)
    shapes = torch.tensor([[SHAPES.index(h) for _, h in s.objects] for s in scenes], device=device)
    return colors, shapes  # (B, 4) each


def _aux_loss(heads, features, scenes, patch_weight: float = 0.0) -> tuple:
    """Classification loss of the quadrants' mean features (+ `patch_weight` x that of every single patch, so
    that each patch carries its whole quadrant's colour and shape) and the mean features' accuracy."""
    color_logits, shape_logits = heads(features)
    colors, shapes = _targets(scenes, features.device)
    loss = nn.functional.cross_entropy(color_logits.flatten(0, 1), colors.flatten()) + \
        nn.functional.cross_entropy(shape_logits.flatten(0, 1), shapes.flatten())
    if patch_weight:
        patch_colors, patch_shapes = heads(features, per_patch=True)
        count = patch_colors.shape[2]
        loss = loss + patch_weight * (
            nn.functional.cross_entropy(patch_colors.flatten(0, 2), colors.repeat_interleave(count, 1).flatten())
            + nn.functional.cross_entropy(patch_shapes.flatten(0, 2), shapes.repeat_interleave(count, 1).flatten()))
    right = ((color_logits.argmax(-1) == colors).float().mean().item(),
             (shape_logits.argmax(-1) == shapes).float().mean().item())
    return loss, right


def align_token_ids(scenes: list, tokenizer, grid: int) -> torch.Tensor:
    """`(B, grid * grid)` the word token each patch should read as (row-major patches): in every row of a
    quadrant's patches, its position words, colour and shape (first token of each, repeated to fill the row)."""
    def first(word: str) -> int:
        return tokenizer(" " + word, add_special_tokens=False)["input_ids"][0]

    half = grid // 2
    rows = []
    for scene in scenes:
        ids = torch.empty(grid, grid, dtype=torch.long)
        for (name, column, row), (color, shape) in zip(POSITIONS, scene.objects):
            vertical, horizontal = name.split()
            words = [first(vertical.capitalize()), first(horizontal), first(color), first(shape)]
            line = torch.tensor([words[i % len(words)] for i in range(half)])
            ids[row * half:(row + 1) * half, column * half:(column + 1) * half] = line[None, :]
        rows.append(ids.flatten())
    return torch.stack(rows)


def _align_loss(model, features: torch.Tensor, scenes: list, tokenizer) -> torch.Tensor:
    """Mean squared distance of the projected patches to their word embeddings, relative to the embeddings'
    mean squared norm."""
    grid = model.config.vision_config.image_size // model.config.vision_config.patch_size
    ids = align_token_ids(scenes, tokenizer, grid).to(features.device)
    target = model.get_input_embeddings()(ids).float()  # (B, P, H_text)
    projected = model.model.multi_modal_projector(features).float()  # (B, P, H_text)
    return (projected - target).pow(2).mean() / target.pow(2).mean()


def _lm_batch(processor, scenes: list, rng: random.Random, describe_fraction: float) -> tuple:
    """Left-padded inputs of `scenes` with one request each; labels mark the assistant's answer only.

    Returns (inputs, labels (B, K), K): the answer (+ end-of-turn token) sits in the last K positions of every
    row, so logits are needed for those only."""
    tokenizer = processor.tokenizer
    prompts, answers = [], []
    for scene in scenes:
        if rng.random() < describe_fraction:
            request, answer = DESCRIBE_REQUEST, scene.description
        else:
            request, answer = scene.questions[rng.randrange(len(scene.questions))]
        prompts.append(chat_text(processor, scene_messages(request)))
        answers.append(answer + "<|im_end|>")
    texts = [p + a for p, a in zip(prompts, answers)]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        inputs = processor(text=texts, images=[s.image for s in scenes], return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    answer_ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]
    keep = max(len(a) for a in answer_ids) + 1  # logits at position t predict token t + 1
    labels = torch.full((len(scenes), keep), -100, dtype=torch.long)
    for row, ids in enumerate(answer_ids):
        labels[row, keep - len(ids):] = torch.tensor(ids)
        if inputs["input_ids"][row, -len(ids):].tolist() != ids:
            raise ValueError(f"the answer {answers[row]!r} does not tokenize the same inside the prompt.")
    return inputs, labels, keep


def _lm_loss(model, inputs, labels, keep) -> torch.Tensor:
    logits = model(**inputs, logits_to_keep=keep).logits  # (B, keep, V): positions -keep .. -1
    # logits at position t predict token t + 1: shift by one inside the kept window
    predicted = logits[:, :-1].float()
    target = labels[:, 1:].to(predicted.device)
    return nn.functional.cross_entropy(predicted.flatten(0, 1), target.flatten(), ignore_index=-100)


_DESCRIPTION = re.compile(r"(top left|top right|bottom left|bottom right):\s*an?\s+(\w+)\s+(\w+)", re.IGNORECASE)


def parse_description(text: str) -> dict:
    """``{position: (colour, shape)}`` read from a generated description (positions it does not name are
    missing)."""
    found = {}
    for position, color, shape in _DESCRIPTION.findall(text):
        found.setdefault(position.lower(), (color.lower(), shape.lower().rstrip(".")))
    return found


@torch.no_grad()
def evaluate_scenes(model, processor, scenes: list, max_new_tokens: int = 48, blank: bool = False) -> dict:
    """Greedy descriptions of `scenes` scored against their objects.

    Args:
        blank: describe a blank white image instead (what the model says without seeing anything).

    Returns:
        dict: `color` / `shape` (share of the 4 x len(scenes) colour / shape words right), `scenes_right` (share
        of scenes with all 8 words right), `samples` (the first 3 descriptions).
    """
    from PIL import Image

    model.eval()
    color = shape = whole = 0
    samples = []
    for scene in scenes:
        image = Image.new("RGB", scene.image.size, (255, 255, 255)) if blank else scene.image
        inputs = encode_chat(processor, scene_messages(DESCRIBE_REQUEST), [image])
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        text = processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        read = parse_description(text)
        right = [(read.get(name, (None, None))[0] == c, read.get(name, (None, None))[1] == h)
                 for (name, _, _), (c, h) in zip(POSITIONS, scene.objects)]
        color += sum(r[0] for r in right)
        shape += sum(r[1] for r in right)
        whole += all(r[0] and r[1] for r in right)
        if len(samples) < 3:
            samples.append({"scene": scene.id, "truth": scene.description, "said": text})
    n = max(1, len(scenes))
    return {"color": color / (4 * n), "shape": shape / (4 * n), "scenes_right": whole / n, "scenes": len(scenes),
            "samples": samples}


def train_scenes_vlm(model, processor, config: VLMTrainConfig, out_dir=None, resume: bool = False,
                     accelerator=None, progress: bool = True, log=print, scene_source=make_scenes) -> dict:
    """Train `model`'s vision tower and projector in place, and low-rank updates of its language model
    (``config.lora_rank``; added by :func:`~hf_adaptive_spec.scenes.vlm.add_language_lora` unless the model
    already carries them). The model is returned parametrized: save it with
    :func:`~hf_adaptive_spec.scenes.vlm.save_trained_parts`, then fold the updates in with
    :func:`~hf_adaptive_spec.scenes.vlm.merge_language_lora`.

    Args:
        model: the scenes VLM (`scenes.vlm.build_scenes_vlm`).
        processor: its processor.
        config ([`VLMTrainConfig`]).
        out_dir (path, *optional*): checkpoints (`checkpoint-N/`) go here.
        resume (`bool`): continue from the latest checkpoint in `out_dir`.
        accelerator (`accelerate.Accelerator`, *optional*): created if not given.
        scene_source: `(split, count, seed=, start=) -> scenes` (tests pass a cheap fake).

    Returns:
        dict with `history` (stage, step, loss, color / shape accuracy of the heads, seconds), `evals` and
        `config`.
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    accelerator = accelerator or Accelerator()
    torch.manual_seed(config.seed)
    vision = model.config.vision_config
    heads = QuadrantHeads(vision.hidden_size, vision.image_size // vision.patch_size)
    from ..scenes.vlm import TRAINED_PREFIXES, add_language_lora, language_lora_parameters

    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith(TRAINED_PREFIXES)
    lora_params = language_lora_parameters(model) or add_language_lora(model, config.lora_rank, config.lora_alpha,
                                                                       seed=config.seed)
    for parameter in lora_params:
        parameter.requires_grad = True
    tower_params = list(model.model.vision_tower.parameters())
    projector_params = list(model.model.multi_modal_projector.parameters())
    total = config.tower_steps + config.align_steps + config.lm_steps
    out_dir = Path(out_dir) if out_dir is not None else None
    trained_keys = [k for k in model.state_dict()
                    if k.startswith(TRAINED_PREFIXES) or ".parametrizations.weight.0." in k]
    state, start, history, evals = resume_state(out_dir, resume, log)
    if state is not None:
        model.load_state_dict(state["trained"], strict=False)
        heads.load_state_dict(state["heads"])

    stages = [("tower", config.tower_steps, config.tower_batch), ("align", config.align_steps, config.align_batch),
              ("lm", config.lm_steps, config.lm_batch)]

    def stage_at(step: int) -> tuple:
        """(stage name, step within it, its length, its batch size)"""
        first = 0
        for name, length, batch in stages:
            if step < first + length:
                return name, step - first, length, batch
            first += length
        return stages[-1][0], step - first + stages[-1][1], stages[-1][1], stages[-1][2]

    def optimizer_for(stage: str):
        if stage == "tower":
            groups = [{"params": tower_params + list(heads.parameters()), "lr": config.tower_lr}]
        else:
            lr = config.align_lr if stage == "align" else config.lm_lr
            groups = [{"params": projector_params + list(heads.parameters()), "lr": lr},
                      {"params": tower_params, "lr": config.lm_tower_lr}]
            if stage == "lm" and lora_params:
                groups.append({"params": lora_params, "lr": config.lora_lr})
        return torch.optim.AdamW(groups, weight_decay=0.0)

    stage = stage_at(start)[0]
    optimizer = optimizer_for(stage)
    base_lrs = [g["lr"] for g in optimizer.param_groups]  # before loading a state: it holds scheduled rates
    if state is not None and state.get("stage") == stage:
        optimizer.load_state_dict(state["optimizer"])
    rng = random.Random(config.seed * 1000 + accelerator.process_index + start)
    bar = tqdm(desc=f"train-vlm ({stage})", disable=not progress, initial=start, total=total)
    started = time.perf_counter()
    model.train()
    step = start
    tokenizer = processor.tokenizer
    autocast_device = "cpu" if accelerator.device.type == "cpu" else accelerator.device.type
    while step < total:
        name, local, stage_total, batch_size = stage_at(step)
        if name != stage:
            stage = name
            optimizer = optimizer_for(stage)
            base_lrs = [g["lr"] for g in optimizer.param_groups]
            bar.set_description(f"train-vlm ({stage})")
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr * warmup_cosine(local, stage_total)
        scenes = scene_source("train", batch_size, seed=config.seed, start=step * batch_size)
        if stage in ("tower", "align"):
            pixels = processor.image_processor([s.image for s in scenes], return_tensors="pt")["pixel_values"]
            features = _patch_features(model, pixels)
            loss, right = _aux_loss(heads, features, scenes, config.patch_weight)
            if stage == "align":
                loss = _align_loss(model, features, scenes, tokenizer) + config.aux_weight * loss
        else:
            inputs, labels, keep = _lm_batch(processor, scenes, rng, config.describe_fraction)
            with torch.autocast(autocast_device, dtype=torch.bfloat16, enabled=config.bf16):
                lm = _lm_loss(model, inputs, labels, keep)
                features = _patch_features(model, inputs["pixel_values"])
                aux, right = _aux_loss(heads, features, scenes, config.patch_weight)
                align = _align_loss(model, features, scenes, tokenizer) if config.align_weight else 0.0
            loss = lm + config.aux_weight * aux + config.align_weight * align
        optimizer.zero_grad()
        accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        optimizer.step()
        step += 1
        history.append({"stage": stage, "step": step, "loss": loss.item(), "color": right[0], "shape": right[1],
                        "lr": optimizer.param_groups[0]["lr"], "seconds": time.perf_counter() - started})
        bar.set_postfix(loss=f"{loss.item():.3f}", color=f"{right[0]:.2f}", shape=f"{right[1]:.2f}")
        bar.update(1)
        lm_done = step - config.tower_steps - config.align_steps
        if config.eval_scenes and (step == total or (lm_done > 0 and config.eval_every and lm_done % config.eval_every == 0)):
            result = evaluate_scenes(model, processor, scene_source("test", config.eval_scenes, seed=config.seed))
            evals.append({"step": step, **result})
            log(f"step {step}: held-out colour {result['color']:.3f}, shape {result['shape']:.3f}, "
                f"scenes all right {result['scenes_right']:.3f}")
            model.train()
        if out_dir is not None and accelerator.is_main_process and (
                step == total or (config.checkpoint_every and step % config.checkpoint_every == 0)):
            trained = {k: v for k, v in model.state_dict().items() if k in trained_keys}
            save_checkpoint(out_dir, step, {"trained": trained, "heads": heads.state_dict(),
                                            "optimizer": optimizer.state_dict(), "stage": stage, "step": step,
                                            "history": history, "evals": evals, "config": asdict(config)}, evals)
    bar.close()
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad = False
    return {"history": history, "evals": evals, "config": asdict(config)}
