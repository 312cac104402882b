"""What the benchmark loads: its device, models (registry names, the scenes VLM or local folders) and prompts
(a data set, or held-out scenes), each prompt encoded through its chat template."""

from __future__ import annotations

from typing import Optional

import torch

from .. import loading
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
    """The prompts of `args.datasets` (each data set once, in order), `args.limit` of each; a `ValueError` for none."""
    prompt_loader = prompt_loader or default_prompt_loader
    prompts = []
    for dataset in dict.fromkeys(args.datasets):
        prompts.extend(prompt_loader(dataset, args.limit))
    if not prompts:
        raise ValueError("no prompts to run.")
    return prompts


def encode_prompt(processor, messages: list, device, image=None, dtype=None) -> dict:
    """`{"input_ids", "attention_mask"}` `(1, T)` of the chat template with the generation prompt.

    A tokenizer without a chat template gets the last message's text. With an `image`, `processor` is a VLM's
    processor and every input it makes is returned (pixel values in `dtype`: `bench_vision.encode_image_prompt`).
    """
    if image is not None:
        return bench_vision.encode_image_prompt(processor, messages, image, device, dtype)
    tokenizer = bench_vision.text_tokenizer(processor)
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
    else:
        encoded = tokenizer(messages[-1]["content"], return_tensors="pt")
    input_ids = encoded["input_ids"].to(device)
    attention_mask = encoded.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    return {"input_ids": input_ids, "attention_mask": attention_mask}
