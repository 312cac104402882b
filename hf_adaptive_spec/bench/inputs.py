"""What the benchmark loads: its device, models (registry names, the scenes VLM or local folders) and prompts
(a data set, or held-out scenes), each prompt encoded through its chat template."""

from __future__ import annotations

from typing import Optional

import torch

from .. import loading
from ..loading import encode_prompt
from . import vision as bench_vision

__all__ = ["bench_prompts", "default_prompt_loader", "encode_prompt", "load_drafter_option", "load_on_device",
           "resolve_device"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_on_device(name: str, args, role: str) -> tuple:
    """`(model, processor)` from a registry name, ``scenes-vlm-135m`` or a local HF folder
    (`loading.load_model`), on `args.device` with `args.dtype`; `role` names the option in an error."""
    model, processor = loading.load_model(name, args.dtype, progress=not getattr(args, "no_progress", False),
                                          option=f"--{role}")
    return model.to(resolve_device(args.device)), processor


def load_drafter_option(name: str, target, args, int8: bool, model_loader=None):
    """The drafter `name` of `--drafter` / `--baseline-drafter` (`loading.load_assistant`); an independent model
    loads through `model_loader(name, args, "drafter")` (default `load_on_device`)."""
    loader = model_loader or load_on_device
    return loading.load_assistant(name, target, int8, model_loader=lambda other: loader(other, args, "drafter"))


def default_prompt_loader(dataset: str, limit: Optional[int]) -> list:
    if dataset == bench_vision.SCENES:
        return bench_vision.scene_prompts(limit)
    from ..registry.data import load_prompts

    return load_prompts(dataset, limit=limit)


def bench_prompts(args, prompt_loader=None) -> list:
    """The prompts of `args.datasets` (each data set once, in order), `args.limit` of each after the first
    `args.skip`; a `ValueError` for none."""
    prompt_loader = prompt_loader or default_prompt_loader
    skip = getattr(args, "skip", 0)
    prompts = []
    for dataset in dict.fromkeys(args.datasets):
        prompts.extend(prompt_loader(dataset, None if args.limit is None else skip + args.limit)[skip:])
    if not prompts:
        raise ValueError("no prompts to run.")
    return prompts
