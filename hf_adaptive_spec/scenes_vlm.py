"""``scenes-vlm-135m``: a LLaVA-style VLM made of the real SmolLM2-135M-Instruct (frozen) and a small CLIP-style
vision tower + projector that the project trains on :mod:`hf_adaptive_spec.scenes` (``hf-adaptive-spec train-vlm``).

The model is an ordinary ``LlavaForConditionalGeneration``; its vocabulary is SmolLM2's, unchanged (the image
placeholder is SmolLM2's unused special token ``<empty_output>``, id 16), so the text SmolLM2 stays a valid,
image-blind drafter for it. Only what the project trained is shipped (the vision tower and the projector,
a few MB); the full checkpoint is assembled at fetch time from the registry's SmolLM2::

    from hf_adaptive_spec.scenes_vlm import fetch_scenes_vlm
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = fetch_scenes_vlm()                       # ~/.cache/hf_adaptive_spec/models/scenes-vlm-135m
    model = AutoModelForImageTextToText.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

__all__ = [
    "IMAGE_TOKEN",
    "IMAGE_TOKEN_ID",
    "SCENES_VLM",
    "TRAINED_PREFIXES",
    "VISION_CONFIG",
    "assemble_scenes_vlm",
    "build_scenes_vlm",
    "fetch_scenes_vlm",
    "load_trained_parts",
    "save_trained_parts",
]

SCENES_VLM = "scenes-vlm-135m"
LANGUAGE_MODEL = "smollm2-135m-instruct"
IMAGE_TOKEN = "<empty_output>"
IMAGE_TOKEN_ID = 16
#: 128x128 images, 16-pixel patches -> 8x8 = 64 visual tokens (+ CLS, dropped by the "default" feature strategy).
VISION_CONFIG = dict(image_size=128, patch_size=16, hidden_size=192, intermediate_size=768, num_hidden_layers=3,
                     num_attention_heads=3, num_channels=3)
VISION_LAYER = -1
#: Module prefixes (of the model's state dict) that training changes; everything else is SmolLM2's.
TRAINED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")
TRAINED_FILE = "trained_parts.safetensors"
SHIPPED = Path(__file__).parent / "checkpoints" / SCENES_VLM
MARKER = ".hf_adaptive_spec_complete.json"

# SmolLM2's ChatML template, walking content parts: {"type": "image"} becomes the image placeholder.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_config(text_config):
    """The ``LlavaConfig`` of the scenes VLM around `text_config` (SmolLM2's ``LlamaConfig``)."""
    from transformers import CLIPVisionConfig, LlavaConfig

    return LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION_CONFIG),
        text_config=text_config,
        image_token_index=IMAGE_TOKEN_ID,
        vision_feature_select_strategy="default",
        vision_feature_layer=VISION_LAYER,
        projector_hidden_act="gelu",
        tie_word_embeddings=text_config.tie_word_embeddings,
    )


def build_processor(tokenizer):
    """A ``LlavaProcessor`` for 128x128 scenes around SmolLM2's `tokenizer` (vocabulary unchanged)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    if tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) != IMAGE_TOKEN_ID:
        raise ValueError(f"the tokenizer maps {IMAGE_TOKEN!r} to {tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)}, "
                         f"expected {IMAGE_TOKEN_ID} (SmolLM2's vocabulary).")
    size = VISION_CONFIG["image_size"]
    image_processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=VISION_CONFIG["patch_size"],
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE)


def build_scenes_vlm(language_model: Union[str, Path], dtype=None, seed: int = 0):
    """The scenes VLM with SmolLM2's weights from the folder `language_model` and a freshly initialized vision
    tower and projector (seeded). Returns ``(model, processor)``; the model is in eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlavaForConditionalGeneration

    text_config = AutoConfig.from_pretrained(language_model)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(build_config(text_config))
    language = AutoModelForCausalLM.from_pretrained(language_model, dtype=torch.float32)
    model.model.language_model.load_state_dict(language.model.state_dict())
    model.lm_head.load_state_dict(language.lm_head.state_dict())
    if text_config.tie_word_embeddings:
        model.tie_weights()
    del language
    model.generation_config.eos_token_id = text_config.eos_token_id
    model.generation_config.pad_token_id = getattr(text_config, "pad_token_id", None)
    if dtype is not None:
        model = model.to(dtype)
    processor = build_processor(AutoTokenizer.from_pretrained(language_model))
    return model.eval(), processor


def trained_state(model) -> dict:
    """The state-dict entries of `model` under :data:`TRAINED_PREFIXES` (the vision tower and projector)."""
    return {k: v for k, v in model.state_dict().items() if k.startswith(TRAINED_PREFIXES)}


def save_trained_parts(model, folder: Union[str, Path], info: Optional[dict] = None) -> Path:
    """Save what training changed (vision tower + projector, float32 safetensors) and `info` to `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().clone() for k, v in trained_state(model).items()}
    save_file(state, str(folder / TRAINED_FILE), metadata={"format": "pt", "model": SCENES_VLM})
    (folder / "vision_config.json").write_text(json.dumps(VISION_CONFIG, indent=2) + "\n")
    if info is not None:
        (folder / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return folder


def load_trained_parts(model, folder: Union[str, Path]) -> None:
    """Load the vision tower and projector saved by :func:`save_trained_parts` into `model` (in place).

    Raises:
        ValueError: the saved parts do not match the model's (another vision configuration).
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    saved = json.loads((folder / "vision_config.json").read_text())
    if saved != VISION_CONFIG:
        raise ValueError(f"{folder} was trained with the vision configuration {saved}, this library builds "
                         f"{VISION_CONFIG}.")
    state = load_file(str(folder / TRAINED_FILE))
    expected = trained_state(model)
    if set(state) != set(expected):
        raise ValueError(f"{folder / TRAINED_FILE}: keys differ from the model's vision tower and projector "
                         f"(missing {sorted(set(expected) - set(state))[:3]}, extra {sorted(set(state) - set(expected))[:3]}).")
    model.load_state_dict(state, strict=False)


def assemble_scenes_vlm(language_model: Union[str, Path], trained_parts: Union[str, Path],
                        out: Union[str, Path]) -> Path:
    """Write a full HF checkpoint (model + processor) to `out`: SmolLM2 from `language_model` plus the vision
    tower and projector from `trained_parts`. `out` loads with ``AutoModelForImageTextToText`` and
    ``AutoProcessor``."""
    model, processor = build_scenes_vlm(language_model)
    load_trained_parts(model, trained_parts)
    out = Path(out)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def fetch_scenes_vlm(cache_dir: Optional[Union[str, Path]] = None, progress: bool = True, force: bool = False,
                     trained_parts: Optional[Union[str, Path]] = None,
                     language_model: Optional[Union[str, Path]] = None) -> Path:
    """The cached, assembled ``scenes-vlm-135m`` folder; assembles it on first use from the registry's SmolLM2
    (fetched if needed; or the folder `language_model`) and the shipped trained parts (or `trained_parts`, a
    folder written by ``train-vlm``). A cached folder assembled from other trained parts is rebuilt.

    Raises:
        FileNotFoundError: no trained parts are shipped or given.
    """
    from .models import _file_lock, default_cache_root, fetch

    parts = Path(trained_parts) if trained_parts is not None else SHIPPED
    if not (parts / TRAINED_FILE).is_file():
        raise FileNotFoundError(f"no trained vision tower at {parts}: train one with `hf-adaptive-spec train-vlm` "
                                f"and pass its folder.")
    import hashlib

    digest = hashlib.sha256((parts / TRAINED_FILE).read_bytes()).hexdigest()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / SCENES_VLM
    marker = final / MARKER

    def complete() -> bool:
        try:
            return json.loads(marker.read_text()).get("trained_parts_sha256") == digest
        except (OSError, ValueError):
            return False

    if not force and complete():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{SCENES_VLM}.lock"):
        if not force and complete():
            return final
        language = language_model or fetch(LANGUAGE_MODEL, cache_dir=cache_dir, progress=progress)
        work = Path(tempfile.mkdtemp(prefix=f".{SCENES_VLM}.tmp-", dir=root))
        try:
            build = assemble_scenes_vlm(language, parts, work / "model")
            (build / MARKER).write_text(json.dumps({
                "name": SCENES_VLM, "language_model": str(language_model or LANGUAGE_MODEL), "trained_parts_sha256": digest,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
            if final.exists():
                os.replace(final, work / "old")
            os.replace(build, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
