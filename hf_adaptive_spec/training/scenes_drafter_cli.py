"""`hf-adaptive-spec train-scenes-drafter`: distill the image-aware scenes drafter from the scenes VLM.

    hf-adaptive-spec train-scenes-drafter --out runs/scenes-drafter

Writes `drafter_parts.safetensors` + `training_info.json` to `--out` (what `scenes.drafter.fetch_scenes_drafter`
assembles with the scenes VLM into a full checkpoint) and, with `--assemble`, the HF folder `--out/model/`.
The target's answers are made once and kept in `--out/data.pt` (reused when the settings that made them match).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, fields
from pathlib import Path

DATA_KEYS = ("scenes", "question_fraction", "max_new_tokens", "visual_keep", "seed")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from .scenes_drafter import DrafterTrainConfig

    parser.add_argument("--out", required=True, help="output folder (data, checkpoints, trained parts)")
    parser.add_argument("--target", default="scenes-vlm-135m", help="registry name or folder of the scenes VLM")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--init-from", default=None,
                        help="start from trained parts (a folder written by train-scenes-drafter, or 'shipped')")
    parser.add_argument("--assemble", action="store_true", help="also write the full HF checkpoint to --out/model")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")
    for spec in fields(DrafterTrainConfig):
        flag = "--" + spec.name.replace("_", "-")
        if spec.name == "visual_keep":
            parser.add_argument(flag, type=int, nargs="+", default=list(spec.default))
        else:
            parser.add_argument(flag, type={"int": int, "float": float}.get(spec.type, type(spec.default)),
                                default=spec.default)
    return parser


def run(args) -> int:
    import torch

    from ..loading import load_model, resolve_path
    from ..scenes.dataset import make_scenes
    from ..scenes.drafter import (SHIPPED, assemble_scenes_drafter, build_scenes_drafter, load_drafter_parts,
                                  save_drafter_parts)
    from .scenes_drafter import (DrafterTrainConfig, add_round_selections, evaluate_drafter, make_drafter_data,
                                 train_scenes_drafter)

    if args.threads:
        torch.set_num_threads(args.threads)
    values = {f.name: getattr(args, f.name) for f in fields(DrafterTrainConfig)}
    values["visual_keep"] = tuple(values["visual_keep"])
    config = DrafterTrainConfig(**values)
    if any(m < 0 for m in config.visual_keep) or not config.visual_keep:
        raise SystemExit(f"--visual-keep takes counts >= 0, got {list(config.visual_keep)}.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, processor = load_model(args.target, option="--target")
    progress = not args.no_progress
    started = time.time()
    data_file = out / "data.pt"
    wanted = {key: list(v) if isinstance(v, tuple) else v for key, v in asdict(config).items() if key in DATA_KEYS}
    wanted["eval_scenes"] = config.eval_scenes
    data = torch.load(data_file, weights_only=False) if data_file.is_file() else None
    if data is None or data["settings"] != wanted:
        train = make_drafter_data(target, processor, make_scenes("train", config.scenes, seed=config.seed), config,
                                  progress=progress)
        held_out = make_drafter_data(target, processor, make_scenes("test", config.eval_scenes, seed=config.seed,
                                                                    start=1000), config, progress=progress)
        data = {"settings": wanted, "train": train, "eval": held_out}
        torch.save(data, data_file)
    if config.round_selection > 0 and any("per_position" not in r for r in data["train"] + data["eval"]):
        add_round_selections(target, data["train"] + data["eval"], config, progress=progress)
        torch.save(data, data_file)
    data_seconds = time.time() - started
    drafter, embedding_map = build_scenes_drafter(target, seed=config.seed)
    if args.init_from:
        embedding_map = load_drafter_parts(drafter, target, SHIPPED if args.init_from == "shipped" else args.init_from)
    pad = processor.tokenizer.pad_token_id if processor.tokenizer.pad_token_id is not None else 0
    embedding = target.get_input_embeddings().weight.detach()
    result = train_scenes_drafter(drafter, embedding_map, embedding, data["train"], data["eval"], pad, config,
                                  out_dir=out, resume=args.resume, progress=progress)
    keeps = {str(m): evaluate_drafter(drafter, result["embedding_map"], embedding, data["eval"], pad,
                                      keep=m)["top1"] for m in config.visual_keep}
    per_round = {}
    if config.round_selection > 0:
        per_round = {str(m): evaluate_drafter(drafter, result["embedding_map"], embedding, data["eval"], pad, keep=m,
                                              per_round=True)["top1"] for m in config.visual_keep if m > 0}
    info = {"config": result["config"], "steps": config.steps, "train_examples": len(data["train"]),
            "seconds": round(time.time() - started, 1), "data_seconds": round(data_seconds, 1),
            "eval": result["evals"][-1] if result["evals"] else None, "evals": result["evals"],
            "eval_top1_with_top_m_visual_tokens": keeps, "eval_top1_with_top_m_chosen_per_position": per_round,
            "init_from": args.init_from, "target": args.target,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__}
    save_drafter_parts(drafter, result["embedding_map"], out, info)
    (out / "history.json").write_text(json.dumps(result["history"]) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k not in ("config", "evals")}, indent=1))
    if args.assemble:
        print(f"assembled: {assemble_scenes_drafter(resolve_path(args.target), out, out / 'model')}")
    return 0
