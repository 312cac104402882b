"""Training the image-aware scenes drafter (`hf_adaptive_spec.scenes.drafter`), distilled from the target.

Data: the target's greedy answers to train scenes (the description request, or one question about one position:
`question_fraction`), made once in left-padded batches and cached. For each answer the target's prompt also says
which visual tokens its attention picks (the last prompt position's query against int8 keys of the image, a
cross-layer vote: `drafters.vision.select_visual_tokens`) for each M of `visual_keep`, as a drafter that sees M
visual tokens chosen once after the prefill would get them.

Training: cross-entropy of the drafter on the target's answer tokens (the target's greedy tokens: what a round
accepts). The vision tower is the target's, frozen (its features are computed once per scene); the projector,
the two layers and the 576 x 256 embedding map are trained. A share `visual_dropout` of the samples sees only
the top-M visual tokens for an M drawn from `visual_keep` (the others are masked from attention, positions
unchanged), so that the drafter keeps working with M selected tokens.

Checkpoints (`checkpoint-N/training_state.pt`) hold the trained parts and the optimizer; `resume` continues
from the latest one.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpointing import resume_state, save_checkpoint
from .schedule import warmup_cosine

__all__ = ["DrafterTrainConfig", "evaluate_drafter", "make_drafter_data", "tower_features", "train_scenes_drafter"]


@dataclass
class DrafterTrainConfig:
    """Settings of `train_scenes_drafter` (defaults: the shipped run)."""

    scenes: int = 1024  # train scenes answered by the target
    question_fraction: float = 0.25  # share of the answers that answer one question (the rest: the description)
    max_new_tokens: int = 48
    generate_batch: int = 16
    steps: int = 2000
    batch: int = 16
    lr: float = 2e-3
    map_lr: float = 5e-4
    warmup: int = 50
    visual_dropout: float = 0.5
    visual_keep: tuple = (0, 1, 2, 4, 8, 16)
    round_selection: float = 0.0  # share of the dropped-out samples whose tokens are chosen per position (needs
    # `add_round_selections`: each answer position sees the M tokens the target's query at the position before picks)
    eval_scenes: int = 32  # held-out test scenes from index 1000 on (the bench uses the first ones)
    eval_every: int = 200
    checkpoint_every: int = 200
    seed: int = 0


def tower_features(vlm, pixel_values: torch.Tensor) -> torch.Tensor:
    """`(B, T, H_vision)` the vision tower's features as the projector reads them (CLS dropped)."""
    out = vlm.model.vision_tower(pixel_values, output_hidden_states=True)
    return out.hidden_states[vlm.config.vision_feature_layer][:, 1:]


@torch.no_grad()
def make_drafter_data(target, processor, scenes: list, config: DrafterTrainConfig, progress: bool = True) -> list:
    """One record per scene: `ids` (prompt + the target's greedy answer, end-of-turn included), `prompt_length`,
    `features` (the tower's, fp16), `selected` ({M: visual token ranks 0..T-1 picked for M}) and `scene`."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from ..adapters.compat import cache_argument, text_config
    from ..chat_template import chat_text
    from ..drafters.vision import QueryCapture, VisualKeyStore, select_visual_tokens
    from ..drafters.visual_view import image_token_mask, selection_layers
    from ..scenes.dataset import DESCRIBE_REQUEST, scene_messages

    rng = random.Random(f"scenes-drafter/{config.seed}")
    tokenizer = processor.tokenizer
    eos = target.generation_config.eos_token_id
    eos = eos if isinstance(eos, int) else eos[0]
    layers = selection_layers(text_config(target).num_hidden_layers)
    keeps = sorted({m for m in config.visual_keep if m > 0})
    records = []
    bar = tqdm(total=len(scenes), desc="target answers", disable=not progress)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for first in range(0, len(scenes), config.generate_batch):
            chunk = scenes[first : first + config.generate_batch]
            requests = [DESCRIBE_REQUEST if rng.random() >= config.question_fraction
                        else scene.questions[rng.randrange(len(scene.questions))][0] for scene in chunk]
            inputs = processor(text=[chat_text(processor, scene_messages(r)) for r in requests],
                               images=[s.image for s in chunk], return_tensors="pt", padding=True)
            cache = DynamicCache(config=target.config)
            with QueryCapture(target, layers) as capture:
                capture.keep_prompt_keys = True
                target(**inputs, use_cache=True, logits_to_keep=1, **{cache_argument(target): cache})
            store = VisualKeyStore.from_keys({layer: capture.prompt_keys[layer] for layer in layers},
                                             image_token_mask(target, inputs["input_ids"]))
            query = capture.query_at(-1)
            selected = {m: select_visual_tokens(query, store, m_per_layer=2 * m, keep=m, timed=False)[0] for m in keeps}
            out = target.generate(**inputs, max_new_tokens=config.max_new_tokens, do_sample=False)
            features = tower_features(target, inputs["pixel_values"]).to(torch.float16)
            width = inputs["input_ids"].shape[1]
            for row, scene in enumerate(chunk):
                answer = out[row, width:]
                stop = (answer == eos).nonzero()
                answer = answer[: int(stop[0]) + 1] if len(stop) else answer
                prompt = inputs["input_ids"][row][inputs["attention_mask"][row].bool()]
                image_slots = store.positions[row]  # (T,) slots of the image tokens, ascending
                ranks = {m: torch.searchsorted(image_slots, chosen[row]).tolist() for m, chosen in selected.items()}
                records.append({"ids": torch.cat([prompt, answer]), "prompt_length": len(prompt),
                                "features": features[row], "selected": ranks, "scene": scene.id})
            bar.update(len(chunk))
    finally:
        tokenizer.padding_side = side
        bar.close()
    return records


@torch.no_grad()
def add_round_selections(target, records: list, config: DrafterTrainConfig, batch_size: int = 16,
                         progress: bool = True) -> None:
    """Add to each record `per_position` = {M: (A, M) visual token ranks}: for the A answer tokens, the M tokens
    the target's query at the position before each picks (what a drafter whose tokens are chosen after every round,
    `visual_selection="round"`, sees while it drafts there), from one teacher-forced forward of prompt + answer."""
    from tqdm.auto import tqdm

    from ..adapters.compat import text_config
    from ..drafters.vision import QueryCapture, VisualKeyStore, select_visual_tokens
    from ..drafters.visual_view import image_token_mask, selection_layers

    layers = selection_layers(text_config(target).num_hidden_layers)
    keeps = sorted({m for m in config.visual_keep if m > 0})
    for first in tqdm(range(0, len(records), batch_size), desc="per-position selections", disable=not progress):
        chunk = records[first : first + batch_size]
        width = max(len(r["ids"]) for r in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, record in enumerate(chunk):
            input_ids[row, width - len(record["ids"]):] = record["ids"]
            attention[row, width - len(record["ids"]):] = 1
        image = image_token_mask(target, input_ids)
        # the image's embeddings from the stored tower features through the target's projector (no pixels kept)
        embeds = target.get_input_embeddings()(input_ids)
        projected = target.model.multi_modal_projector(torch.stack([r["features"] for r in chunk]).float())
        embeds = embeds.masked_scatter(image[..., None], projected.to(embeds.dtype))
        with QueryCapture(target, layers) as capture:
            capture.keep_prompt_keys = True
            target(inputs_embeds=embeds, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp_min(0),
                   use_cache=False, logits_to_keep=1)
        store = VisualKeyStore.from_keys({layer: capture.prompt_keys[layer] for layer in layers}, image)
        for row, record in enumerate(chunk):
            start = width - len(record["ids"])
            positions = torch.arange(start + record["prompt_length"] - 1, width - 1)  # queries at P-1 .. L-2
            count = len(positions)
            expanded = VisualKeyStore({l: q[row : row + 1].expand(count, *q.shape[1:]) for l, q in store.quantized.items()},
                                      {l: c[row : row + 1].expand(count, *c.shape[1:]) for l, c in store.scales.items()},
                                      store.positions[row : row + 1].expand(count, -1),
                                      store.valid[row : row + 1].expand(count, -1), (store.counts[row],) * count)
            queries = {layer: capture.queries[layer][row, :, positions].transpose(0, 1) for layer in layers}
            image_slots = store.positions[row]
            record["per_position"] = {}
            for m in keeps:
                slots = select_visual_tokens(queries, expanded, m_per_layer=2 * m, keep=m, timed=False)[0]
                record["per_position"][m] = torch.searchsorted(image_slots, slots.clamp_min(0))


def _batch(records: list, pad: int, image_token: int, rng: random.Random, config: DrafterTrainConfig) -> dict:
    """Left-padded inputs of `records` with the visual tokens each query row sees, `visible` `(B, L, L)` over keys:
    all of them, or for a dropped-out sample the top-M chosen once after the prefill, or (a `round_selection`
    share, with `add_round_selections`' data) at each answer row the top-M the target's query before it picks."""
    width = max(len(r["ids"]) for r in records)
    batch = len(records)
    input_ids = torch.full((batch, width), pad, dtype=torch.long)
    attention = torch.zeros(batch, width, dtype=torch.bool)
    visible = torch.ones(batch, width, width, dtype=torch.bool)
    labels = torch.full((batch, width), -100, dtype=torch.long)
    for row, record in enumerate(records):
        ids = record["ids"]
        start = width - len(ids)
        prompt = record["prompt_length"]
        input_ids[row, start:] = ids
        attention[row, start:] = True
        labels[row, start + prompt - 1 : width - 1] = ids[prompt:]
        if rng.random() < config.visual_dropout:
            keep = rng.choice(config.visual_keep)
            per_round = (keep > 0 and config.round_selection > 0 and "per_position" in record
                         and rng.random() < config.round_selection)
            slots = (input_ids[row] == image_token).nonzero().squeeze(1)
            seen = torch.zeros(width, len(slots), dtype=torch.bool)  # (query rows, image tokens)
            if keep > 0:
                seen[:, torch.tensor(record["selected"][keep])] = True
            if per_round:  # answer row P + k sees what the query at P - 1 + k picks
                chosen = record["per_position"][keep]  # (A, M)
                rows = start + prompt + torch.arange(chosen.shape[0])
                seen[rows] = False
                seen[rows[:, None], chosen] = True
            visible[row][:, slots] = seen
    features = torch.stack([r["features"] for r in records]).float()
    return {"input_ids": input_ids, "attention": attention, "visible": visible, "labels": labels,
            "features": features}


def drafter_logits(drafter, embedding_map, target_embedding, batch: dict) -> tuple:
    """`(logits (N, V), labels (N,))` of the drafter at the labelled positions of `batch` (`_batch`): the
    embedding is the target's times `embedding_map` (trained through both the input and the tied output side)."""
    weight = target_embedding @ embedding_map  # (V, H)
    input_ids = batch["input_ids"]
    embeds = nn.functional.embedding(input_ids, weight)
    image = input_ids == drafter.config.image_token_index
    projected = drafter.model.multi_modal_projector(batch["features"])  # (B, T, H)
    embeds = embeds.masked_scatter(image[..., None], projected.to(embeds.dtype))
    attention = batch["attention"]
    positions = (attention.long().cumsum(-1) - 1).clamp_min(0)
    width = input_ids.shape[1]
    allowed = torch.ones(width, width, dtype=torch.bool).tril()[None] & attention[:, None, :] & batch["visible"]
    alone = ~allowed.any(-1)  # padding rows: themselves only (no row of -inf)
    allowed |= torch.eye(width, dtype=torch.bool)[None] & alone[..., None]
    mask = torch.zeros(allowed.shape, dtype=embeds.dtype).masked_fill(~allowed, float("-inf"))[:, None]
    hidden = drafter.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).last_hidden_state
    where = batch["labels"] != -100
    return hidden[where] @ weight.T, batch["labels"][where]


@torch.no_grad()
def evaluate_drafter(drafter, embedding_map, target_embedding, records: list, pad: int, keep=None,
                     per_round: bool = False) -> dict:
    """Top-1 agreement with the target's answer tokens on `records` (all visual tokens, or the top-`keep` chosen
    once, or per answer position with `per_round`)."""
    config = DrafterTrainConfig(visual_dropout=1.0 if keep is not None else 0.0,
                                visual_keep=(keep,) if keep is not None else (0,),
                                round_selection=1.0 if per_round else 0.0)
    right = total = 0
    loss = 0.0
    for first in range(0, len(records), 16):
        batch = _batch(records[first : first + 16], pad, drafter.config.image_token_index, random.Random(0), config)
        logits, labels = drafter_logits(drafter, embedding_map, target_embedding, batch)
        right += int((logits.argmax(-1) == labels).sum())
        total += labels.numel()
        loss += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
    return {"top1": right / max(1, total), "loss": loss / max(1, total), "tokens": total}


def train_scenes_drafter(drafter, embedding_map, target_embedding, records: list, eval_records: list, pad: int,
                         config: DrafterTrainConfig, out_dir=None, resume: bool = False, progress: bool = True,
                         log=print) -> dict:
    """Train `drafter`'s projector, language model and `embedding_map` (in place) on `records`
    (`make_drafter_data`). Returns `{"history", "evals", "config"}`; the drafter is left in eval mode with its
    embedding set from the trained map (`scenes.drafter.set_embedding`)."""
    from tqdm.auto import tqdm

    from ..scenes.drafter import TRAINED_PREFIXES, set_embedding

    torch.manual_seed(config.seed)
    embedding_map = embedding_map.detach().clone().requires_grad_(True)
    target_embedding = target_embedding.detach().float()
    trained = [p for name, p in drafter.named_parameters() if name.startswith(TRAINED_PREFIXES)]
    for name, parameter in drafter.named_parameters():
        parameter.requires_grad = name.startswith(TRAINED_PREFIXES)
    optimizer = torch.optim.AdamW([{"params": trained, "lr": config.lr},
                                   {"params": [embedding_map], "lr": config.map_lr}], weight_decay=0.0)
    base = [group["lr"] for group in optimizer.param_groups]
    out_dir = Path(out_dir) if out_dir is not None else None
    state, start, history, evals = resume_state(out_dir, resume, log)
    if state is not None:
        drafter.load_state_dict(state["trained"], strict=False)
        with torch.no_grad():
            embedding_map.copy_(state["embedding_map"])
        optimizer.load_state_dict(state["optimizer"])
    image_token = drafter.config.image_token_index
    bar = tqdm(desc="train-scenes-drafter", disable=not progress, initial=start, total=config.steps)
    started = time.perf_counter()
    drafter.train()
    for step in range(start, config.steps):
        rng = random.Random(f"{config.seed}/{step}")  # the same batches after a resume
        batch = _batch(rng.sample(records, min(config.batch, len(records))), pad, image_token, rng, config)
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr * warmup_cosine(step, config.steps, config.warmup)
        logits, labels = drafter_logits(drafter, embedding_map, target_embedding, batch)
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained + [embedding_map], 1.0)
        optimizer.step()
        done = step + 1
        history.append({"step": done, "loss": loss.item(), "seconds": round(time.perf_counter() - started, 2)})
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update(1)
        if eval_records and (done == config.steps or (config.eval_every and done % config.eval_every == 0)):
            drafter.eval()
            result = {"step": done, **evaluate_drafter(drafter, embedding_map, target_embedding, eval_records, pad)}
            evals.append(result)
            log(f"step {done}: held-out top-1 {result['top1']:.3f}, loss {result['loss']:.3f}")
            drafter.train()
        if out_dir is not None and (done == config.steps or (config.checkpoint_every and done % config.checkpoint_every == 0)):
            state = {k: v for k, v in drafter.state_dict().items() if k.startswith(TRAINED_PREFIXES)}
            save_checkpoint(out_dir, done, {"trained": state, "embedding_map": embedding_map.detach(),
                                            "optimizer": optimizer.state_dict(), "step": done, "history": history,
                                            "evals": evals, "config": asdict(config)}, evals)
    bar.close()
    drafter.eval()
    for parameter in drafter.parameters():
        parameter.requires_grad = False
    embedding_map = embedding_map.detach()
    set_embedding(drafter, target_embedding, embedding_map)
    return {"history": history, "evals": evals, "config": asdict(config), "embedding_map": embedding_map}
