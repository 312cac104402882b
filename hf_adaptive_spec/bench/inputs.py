"""What the benchmark loads: its device, models (registry names, the scenes VLM or local folders) and prompts
(a data set, or held-out scenes), each prompt encoded through its chat template."""

from __future__ import annotations

from typing import Optional

import torch

from .. import loading
from ..chat_template import encode_chat
from . import vision as bench_vision

__all__ = ["bench_prompts", "default_prompt_loader", "encode_prompt", "load_model", "resolve_device"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(name: str, args, role: str) -> tuple:
    """`(model, processor)` from a registry name, ``scenes-vlm-135m`` or a local HF folder
    (`loading.load_model`), on `args.device` with `args.dtype`; `role` names the option in an error."""
    model, processor = loading.load_model(name, args.dtype, progress=not getattr(args, "no_progress", False),
                                          option=f"--{role}")
    return model.to(resolve_device(args.device)), processor


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


def encode_prompt(processor, messages: list, device, image=None, dtype=None) -> dict:
    """`{"input_ids", "attention_mask"}` `(1, T)` on `device`: `chat_template.encode_chat` of `messages`.

    With an `image`, `processor` is a VLM's processor and every input it makes is returned, floating ones (pixel
    values) in `dtype`.
    """
    if image is None:
        encoded = encode_chat(processor, messages)
        encoded = {key: encoded[key] for key in ("input_ids", "attention_mask") if key in encoded}
    else:
        encoded = encode_chat(processor, messages, [image])
    inputs = {key: _to_device(value, device, dtype) for key, value in encoded.items()}
    if inputs.get("attention_mask") is None:
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    return inputs


def _to_device(value, device, dtype):
    """A tensor on `device` (floating ones in `dtype`, when given); anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device, dtype=dtype if dtype is not None and value.is_floating_point() else None)
