"""Loading models for the command line, training and the datastore builder: a registry name or a local folder
-> model and processor / tokenizer; assistants (a LaSpec drafter, or an independent model, optionally int8); the
inputs of one prompt (a command-line prompt, or chat messages on a device)."""

from __future__ import annotations

from pathlib import Path

from .chat_template import encode_chat, text_tokenizer

__all__ = ["chat_inputs", "encode_prompt", "int8_drafter", "is_laspec", "load_assistant", "load_model", "model_names",
           "resolve_path"]


def model_names() -> list:
    """Every name `resolve_path` knows: the registry's converted models, the assembled scenes VLM and its
    image-aware drafter."""
    from .registry.models import list_models
    from .scenes.drafter import SCENES_DRAFTER
    from .scenes.vlm import SCENES_VLM

    return sorted(list_models() + [SCENES_VLM, SCENES_DRAFTER])


def resolve_path(name_or_path: str, progress: bool = True, option: str | None = None) -> Path:
    """A local HF folder, or a registry name fetched (once) into the cache (the scenes VLM: assembled from
    SmolLM2 and its shipped vision tower; its drafter: from the scenes VLM and the drafter's shipped parts). An unknown name exits with a message (naming `option`, e.g.
    ``--target``, when given)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from .registry.models import REGISTRY, fetch
    from .scenes.drafter import SCENES_DRAFTER, fetch_scenes_drafter
    from .scenes.vlm import SCENES_VLM, fetch_scenes_vlm

    if name_or_path in REGISTRY:
        return fetch(name_or_path, progress=progress)
    if name_or_path == SCENES_VLM:
        return fetch_scenes_vlm(progress=progress)
    if name_or_path == SCENES_DRAFTER:
        return fetch_scenes_drafter(progress=progress)
    raise SystemExit(
        f"{option + ' ' if option else ''}{name_or_path!r} is neither a local model folder nor a registry name ({', '.join(model_names())})."
    )


def load_model(name_or_path: str, dtype: str = "float32", progress: bool = True, option: str | None = None):
    """Load a causal LM or a VLM (with its processor or tokenizer) from a folder or registry name, in eval mode
    (`resolve_path` for `progress` and `option`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    path = resolve_path(name_or_path, progress=progress, option=option)
    config = AutoConfig.from_pretrained(path)
    torch_dtype = getattr(torch, dtype)
    if hasattr(config, "vision_config"):
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
        processor = AutoProcessor.from_pretrained(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
        processor = AutoTokenizer.from_pretrained(path)
    return model.eval(), processor


def chat_inputs(processor, prompt: str, image_path: str | None = None, chat: bool = True):
    """Model inputs for one user prompt (and an image file, for a VLM): `chat_template.encode_chat` of it, or,
    when not `chat` (a text prompt only), the prompt's own tokens."""
    if image_path is not None:
        content = [{"type": "image"}, {"type": "text", "text": prompt}]
        return encode_chat(processor, [{"role": "user", "content": content}], [_open_image(image_path)])
    if not chat:
        return text_tokenizer(processor)(prompt, return_tensors="pt")
    return encode_chat(processor, [{"role": "user", "content": prompt}])


def encode_prompt(processor, messages: list, device, image=None, dtype=None) -> dict:
    """`{"input_ids", "attention_mask"}` `(1, T)` on `device`: `chat_template.encode_chat` of `messages`.

    With an `image`, `processor` is a VLM's processor and every input it makes is returned, floating ones (pixel
    values) in `dtype`.
    """
    import torch

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
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device, dtype=dtype if dtype is not None and value.is_floating_point() else None)


def _open_image(path: str):
    try:
        from PIL import Image
    except ImportError as error:
        raise SystemExit("--image needs Pillow: pip install pillow") from error
    return Image.open(path).convert("RGB")


def is_laspec(name_or_path: str) -> bool:
    from .drafters.hub import SHIPPED_DRAFTERS, is_laspec_folder

    return name_or_path in SHIPPED_DRAFTERS or is_laspec_folder(Path(name_or_path).expanduser())


def load_assistant(name_or_path: str, target, int8: bool = False, dtype: str = "float32", model_loader=None):
    """What `generate(assistant_model=...)` gets for `name_or_path`: a LaSpec drafter (a shipped name or folder,
    attached to `target`: `drafters.hub.load_drafter`) or an independent HF model, `model_loader(name) ->
    (model, processor)` (default `load_model` in `dtype`), int8 when `int8` (`int8_drafter`)."""
    if is_laspec(name_or_path):
        from .drafters.hub import load_drafter

        return load_drafter(name_or_path, target)  # int8 does not apply: one small forward per round
    drafter, _ = (model_loader or (lambda name: load_model(name, dtype)))(name_or_path)
    return int8_drafter(drafter, int8)


def int8_drafter(drafter, int8: bool):
    """`drafter`, or its int8 copy (`quantize_drafter`) when `int8`."""
    if not int8:
        return drafter
    from . import quantize_drafter

    return quantize_drafter(drafter)
