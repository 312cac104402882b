"""`hf-adaptive-spec train-vlm`: train the scenes VLM's vision tower and projector, and low-rank updates of SmolLM2.

    hf-adaptive-spec train-vlm --out runs/scenes-vlm

Writes `trained_parts.safetensors` + `training_info.json` to `--out` (what `scenes.vlm.fetch_scenes_vlm`
assembles with SmolLM2 into a full checkpoint), and `--out/model/`, the assembled HF folder, with `--assemble`.
Runs on one CPU as is, or with `accelerate launch -m hf_adaptive_spec.cli train-vlm ...`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from .vlm import VLMTrainConfig

    parser.add_argument("--out", required=True, help="output folder (checkpoints, trained parts)")
    parser.add_argument("--language-model", default="smollm2-135m-instruct",
                        help="registry name or folder of SmolLM2-135M-Instruct")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--init-from", default=None,
                        help="start from trained parts (a folder written by train-vlm, or 'shipped'); "
                             "usually with --tower-steps 0 --align-steps 0")
    parser.add_argument("--assemble", action="store_true", help="also write the full HF checkpoint to --out/model")
    parser.add_argument("--threads", type=int, default=None)
    for spec in fields(VLMTrainConfig):
        flag = "--" + spec.name.replace("_", "-")
        if spec.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=spec.default)
        else:
            kind = {"int": int, "float": float}.get(spec.type, type(spec.default))
            parser.add_argument(flag, type=kind, default=spec.default)
    return parser


def run(args) -> int:
    import torch

    from ..loading import resolve_path
    from ..scenes.vlm import (SHIPPED, add_language_lora, assemble_scenes_vlm, build_scenes_vlm, load_trained_parts,
                              merge_language_lora, save_trained_parts)
    from .vlm import VLMTrainConfig, evaluate_scenes, train_scenes_vlm

    if args.threads:
        torch.set_num_threads(args.threads)
    config = VLMTrainConfig(**{f.name: getattr(args, f.name) for f in fields(VLMTrainConfig)})
    language = resolve_path(args.language_model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor = build_scenes_vlm(language, seed=config.seed)
    if args.init_from:
        factors = load_trained_parts(model, SHIPPED if args.init_from == "shipped" else args.init_from, merge=False)
        if factors:
            add_language_lora(model, config.lora_rank, config.lora_alpha, factors=factors)
    started = time.time()
    result = train_scenes_vlm(model, processor, config, out_dir=out, resume=args.resume)
    seconds = time.time() - started
    info = {"config": result["config"], "seconds": round(seconds, 1), "evals": result["evals"],
            "final_loss": result["history"][-1]["loss"] if result["history"] else None,
            "language_model": args.language_model, "init_from": args.init_from, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__}
    if config.eval_scenes:
        from ..scenes.dataset import make_scenes

        info["blank_image"] = evaluate_scenes(model, processor, make_scenes("test", config.eval_scenes,
                                                                            seed=config.seed), blank=True)
    save_trained_parts(model, out, info)
    merge_language_lora(model)
    (out / "history.json").write_text(json.dumps(result["history"]) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "config"}, indent=1))
    if args.assemble:
        print(f"assembled: {assemble_scenes_vlm(language, out, out / 'model')}")
    return 0
