"""``scenes-vlm-135m``: a LLaVA-style VLM made of the real SmolLM2-135M-Instruct and a small CLIP-style vision tower
+ projector that the project trains on :mod:`hf_adaptive_spec.scenes.dataset` (``hf-adaptive-spec train-vlm``), with
low-rank updates of the language model's linear layers (LoRA, merged into its weights at assembly).

The model is an ordinary ``LlavaForConditionalGeneration``; its vocabulary is SmolLM2's, unchanged (the image
placeholder is SmolLM2's unused special token ``<empty_output>``, id 16), so the text SmolLM2 stays a valid,
image-blind drafter for it. Only what the project trained is shipped (the vision tower, the projector and the
low-rank factors, a few MB); the full checkpoint is assembled at fetch time from the registry's SmolLM2::

    from hf_adaptive_spec.scenes.vlm import fetch_scenes_vlm
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = fetch_scenes_vlm()                       # ~/.cache/hf_adaptive_spec/models/scenes-vlm-135m
    model = AutoModelForImageTextToText.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Union

__all__ = [
    "IMAGE_TOKEN",
    "IMAGE_TOKEN_ID",
    "SCENES_VLM",
    "TRAINED_PREFIXES",
    "VISION_CONFIG",
    "add_language_lora",
    "assemble_scenes_vlm",
    "build_scenes_vlm",
    "fetch_scenes_vlm",
    "language_lora_parameters",
    "load_trained_parts",
    "merge_language_lora",
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
#: Module prefixes (of the model's state dict) that training changes; everything else is SmolLM2's, up to the
#: low-rank updates of :data:`LORA_TARGETS`.
TRAINED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")
#: The language model's linear layers that training updates by low-rank factors (saved as
#: ``<module>.lora_A`` (r, in) and ``<module>.lora_B`` (out, r), scale included: weight += lora_B @ lora_A).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_SUFFIXES = (".lora_A", ".lora_B")
TRAINED_FILE = "trained_parts.safetensors"
SHIPPED = Path(__file__).parent.parent / "checkpoints" / SCENES_VLM

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


def _low_rank_module():
    import torch
    from torch import nn

    class LowRank(nn.Module):
        def __init__(self, out_features: int, in_features: int, rank: int, scale: float, dtype):
            super().__init__()
            self.scale = scale
            self.A = nn.Parameter(torch.randn(rank, in_features, dtype=dtype) / math.sqrt(in_features))
            self.B = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype))

        def forward(self, weight):
            return weight + (self.scale * self.B @ self.A).to(weight.dtype)

    return LowRank


def _lora_linears(model) -> dict:
    """``{state-dict prefix: nn.Linear}`` of the language model's :data:`LORA_TARGETS` layers."""
    prefix = "model.language_model."
    return {prefix + name: module for name, module in model.model.language_model.named_modules()
            if name.rsplit(".", 1)[-1] in LORA_TARGETS}


def add_language_lora(model, rank: int, alpha: float, seed: int = 0, factors: Optional[dict] = None) -> list:
    """Parametrize every :data:`LORA_TARGETS` layer of `model`'s language model as ``W + (alpha / rank) B A``
    (``torch.nn.utils.parametrize``; W frozen, A random, B zero, or both from `factors`, as
    :func:`load_trained_parts` returns them). Returns the new (A, B) parameters.

    Raises:
        ValueError: `factors` of another rank than `rank` (a rank of 0 trains none: it cannot take factors).
    """
    import torch
    from torch.nn.utils import parametrize

    if factors:
        saved_rank = next(a for key, a in factors.items() if key.endswith(".lora_A")).shape[0]
        if saved_rank != rank:
            raise ValueError(f"the saved low-rank factors have rank {saved_rank}, not {rank}.")
    if rank <= 0:
        return []
    LowRank = _low_rank_module()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        params = []
        for prefix, module in _lora_linears(model).items():
            module.weight.requires_grad = False
            update = LowRank(module.out_features, module.in_features, rank, alpha / rank, module.weight.dtype)
            if factors:
                with torch.no_grad():
                    update.A.copy_(factors[prefix + ".lora_A"])
                    update.B.copy_(factors[prefix + ".lora_B"] / update.scale)
            parametrize.register_parametrization(module, "weight", update)
            params += [update.A, update.B]
    finally:
        torch.random.set_rng_state(generator_state)
    return params


def _lora_updates(model) -> dict:
    """``{state-dict prefix: LowRank}`` of the language model's layers parametrized by :func:`add_language_lora`."""
    from torch.nn.utils import parametrize

    return {prefix: module.parametrizations.weight[0] for prefix, module in _lora_linears(model).items()
            if parametrize.is_parametrized(module, "weight")}


def language_lora_parameters(model) -> list:
    """The (A, B) parameters of `model`'s low-rank updates (empty if it carries none)."""
    return [p for update in _lora_updates(model).values() for p in (update.A, update.B)]


def _lora_factors(model) -> dict:
    """``{<module>.lora_A: A, <module>.lora_B: scale * B}`` of a parametrized model (empty if it has none)."""
    factors = {}
    for prefix, update in _lora_updates(model).items():
        factors[prefix + ".lora_A"] = update.A.detach()
        factors[prefix + ".lora_B"] = (update.scale * update.B).detach()
    return factors


def merge_language_lora(model) -> None:
    """Fold the low-rank updates of :func:`add_language_lora` into the weights and drop the parametrizations
    (`model` becomes an ordinary ``LlavaForConditionalGeneration`` again)."""
    from torch.nn.utils import parametrize

    for module in _lora_linears(model).values():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


def trained_state(model) -> dict:
    """What training changed: the state-dict entries of `model` under :data:`TRAINED_PREFIXES` (vision tower and
    projector) and the low-rank factors of its language model (if parametrized by :func:`add_language_lora`)."""
    state = {k: v for k, v in model.state_dict().items() if k.startswith(TRAINED_PREFIXES)}
    state.update(_lora_factors(model))
    return state


def save_trained_parts(model, folder: Union[str, Path], info: Optional[dict] = None) -> Path:
    """Save what training changed (vision tower + projector + low-rank factors, float32 safetensors) and `info`
    to `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().clone() for k, v in trained_state(model).items()}
    save_file(state, str(folder / TRAINED_FILE), metadata={"format": "pt", "model": SCENES_VLM})
    (folder / "vision_config.json").write_text(json.dumps(VISION_CONFIG, indent=2) + "\n")
    if info is not None:
        (folder / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return folder


def load_trained_parts(model, folder: Union[str, Path], merge: bool = True) -> dict:
    """Load the vision tower and projector saved by :func:`save_trained_parts` into `model` (in place) and add
    the saved low-rank factors' product to the language model's weights (`merge`; otherwise the factors are
    returned, for :func:`add_language_lora`, and the weights stay SmolLM2's).

    Raises:
        ValueError: the saved parts do not match the model's (another vision configuration, unknown layers).
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    saved = json.loads((folder / "vision_config.json").read_text())
    if saved != VISION_CONFIG:
        raise ValueError(f"{folder} was trained with the vision configuration {saved}, this library builds "
                         f"{VISION_CONFIG}.")
    import torch

    state = load_file(str(folder / TRAINED_FILE))
    lora = {k: state.pop(k) for k in list(state) if k.endswith(LORA_SUFFIXES)}
    expected = {k for k in model.state_dict() if k.startswith(TRAINED_PREFIXES)}
    if set(state) != expected:
        raise ValueError(f"{folder / TRAINED_FILE}: keys differ from the model's vision tower and projector "
                         f"(missing {sorted(expected - set(state))[:3]}, extra {sorted(set(state) - expected)[:3]}).")
    linears = _lora_linears(model)
    updates = {}
    for prefix in {key.rsplit(".", 1)[0] for key in lora}:
        if prefix not in linears or prefix + ".lora_A" not in lora or prefix + ".lora_B" not in lora:
            raise ValueError(f"{folder / TRAINED_FILE}: {prefix} names no low-rank pair of the language model's "
                             f"{', '.join(LORA_TARGETS)} layers.")
        a, b = updates[prefix] = (lora[prefix + ".lora_A"], lora[prefix + ".lora_B"])
        if (b.shape[0], a.shape[1]) != tuple(linears[prefix].weight.shape):
            raise ValueError(f"{folder / TRAINED_FILE}: {prefix} factors make {b.shape[0]}x{a.shape[1]}, the "
                             f"layer is {tuple(linears[prefix].weight.shape)}.")
    model.load_state_dict(state, strict=False)
    if not merge:
        return lora
    with torch.no_grad():
        for prefix, (a, b) in updates.items():
            weight = linears[prefix].weight
            weight.add_((b.float() @ a.float()).to(weight.dtype))
    return {}


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
    from ..locations import default_cache_root
    from ..registry.cache import assembled_once
    from ..registry.models import fetch

    parts = Path(trained_parts) if trained_parts is not None else SHIPPED
    if not (parts / TRAINED_FILE).is_file():
        raise FileNotFoundError(f"no trained vision tower at {parts}: train one with `hf-adaptive-spec train-vlm` "
                                f"and pass its folder.")
    import hashlib

    digest = hashlib.sha256((parts / TRAINED_FILE).read_bytes()).hexdigest()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()

    def build(folder: Path) -> Path:
        language = language_model or fetch(LANGUAGE_MODEL, cache_dir=cache_dir, progress=progress)
        return assemble_scenes_vlm(language, parts, folder)

    return assembled_once(root, SCENES_VLM, {"trained_parts_sha256": digest}, build,
                          {"language_model": str(language_model or LANGUAGE_MODEL)}, force=force)
