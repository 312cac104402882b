"""``scenes-vlm-drafter-16m``: a small image-aware drafter for ``scenes-vlm-135m``, trained by the project
(``hf-adaptive-spec train-scenes-drafter``).

An ordinary ``LlavaForConditionalGeneration`` over SmolLM2's vocabulary: the target's own trained vision tower
(frozen, copied), a new projector (192 -> 256) and a 2-layer Llama of width 256 whose tied embedding is the
target's embedding times a trained 576 x 256 map (``embedding_map``). It reads the image (64 visual tokens) and
the prompt like the target, so every independent-drafter strategy (`chain`, `static_tree`, `sage`) and stock
assisted generation can use it::

    from hf_adaptive_spec.scenes.drafter import fetch_scenes_drafter
    from transformers import AutoModelForImageTextToText

    drafter = AutoModelForImageTextToText.from_pretrained(fetch_scenes_drafter())
    out = target.generate(**inputs, assistant_model=drafter, spec_strategy="sage")

Only what training made is shipped (the map, the projector, the 2 layers: a few MB); the full checkpoint is
assembled at fetch time from the registry's scenes VLM (its embedding and vision tower).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Optional, Union

__all__ = [
    "SCENES_DRAFTER",
    "TEXT_CONFIG",
    "assemble_scenes_drafter",
    "build_scenes_drafter",
    "embedding_map_init",
    "fetch_scenes_drafter",
    "load_drafter_parts",
    "save_drafter_parts",
    "set_embedding",
]

SCENES_DRAFTER = "scenes-vlm-drafter-16m"
TARGET = "scenes-vlm-135m"
#: The drafter's language model (the rest of LlamaConfig: the target's rope, norm epsilon and special ids).
TEXT_CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64)
PARTS_FILE = "drafter_parts.safetensors"
#: The state-dict prefixes training makes (besides ``embedding_map``); the vision tower and the embedding come
#: from the target at assembly.
TRAINED_PREFIXES = ("model.multi_modal_projector.", "model.language_model.layers.", "model.language_model.norm.")
EMBEDDING_MAP = "embedding_map"
SHIPPED = Path(__file__).parent.parent / "checkpoints" / SCENES_DRAFTER


def drafter_config(target_config):
    """The drafter's ``LlavaConfig`` for a target's: its vision tower and special tokens, a small Llama."""
    from transformers import LlamaConfig, LlavaConfig

    from ..adapters.compat import text_config

    text = text_config(target_config)
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    text_config = LlamaConfig(vocab_size=text.vocab_size, rms_norm_eps=text.rms_norm_eps, rope_parameters=dict(rope),
                              max_position_embeddings=text.max_position_embeddings, tie_word_embeddings=True,
                              bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id,
                              pad_token_id=getattr(text, "pad_token_id", None), **TEXT_CONFIG)
    return LlavaConfig(vision_config=target_config.vision_config.to_dict(), text_config=text_config,
                       image_token_index=target_config.image_token_index,
                       vision_feature_select_strategy=target_config.vision_feature_select_strategy,
                       vision_feature_layer=target_config.vision_feature_layer,
                       projector_hidden_act=target_config.projector_hidden_act, tie_word_embeddings=True)


def embedding_map_init(embedding):
    """`(H_target, H)`: the top-H right singular vectors of the target's `(V, H_target)` embedding (the
    projection that keeps most of its variance), each signed so that its largest entry is positive (an SVD's
    signs are arbitrary; this makes the map the same on every machine); zero columns past H_target."""
    import torch

    width = TEXT_CONFIG["hidden_size"]
    _, _, vh = torch.linalg.svd(embedding.detach().float(), full_matrices=False)
    basis = vh[:width].T.contiguous()  # (H_target, min(H_target, H))
    sign = torch.sign(basis.gather(0, basis.abs().argmax(0, keepdim=True)))
    basis = basis * sign
    if basis.shape[1] < width:  # a target narrower than the drafter: the other dimensions start at zero
        basis = torch.cat([basis, basis.new_zeros(basis.shape[0], width - basis.shape[1])], dim=1)
    return basis


def set_embedding(drafter, target_embedding, embedding_map) -> None:
    """The drafter's tied embedding := target embedding `(V, H_target)` @ `embedding_map` `(H_target, H)`."""
    import torch

    with torch.no_grad():
        weight = drafter.get_input_embeddings().weight
        weight.copy_((target_embedding.float() @ embedding_map.float()).to(weight.dtype))
    drafter.tie_weights()


def build_scenes_drafter(target, seed: int = 0):
    """A fresh drafter for `target` (the scenes VLM, loaded): its vision tower copied and frozen, a seeded
    projector and language model, the embedding map from `embedding_map_init`. Returns `(drafter,
    embedding_map)`; the drafter is in eval mode, float32."""
    import torch
    from transformers import LlavaForConditionalGeneration

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        drafter = LlavaForConditionalGeneration(drafter_config(target.config)).float()
    finally:
        torch.random.set_rng_state(generator_state)
    drafter.model.vision_tower.load_state_dict(target.model.vision_tower.state_dict())
    embedding_map = embedding_map_init(target.get_input_embeddings().weight)
    set_embedding(drafter, target.get_input_embeddings().weight, embedding_map)
    generation = target.generation_config
    drafter.generation_config.eos_token_id = generation.eos_token_id
    drafter.generation_config.pad_token_id = generation.pad_token_id
    return drafter.eval(), embedding_map


def trained_state(drafter, embedding_map) -> dict:
    state = {k: v for k, v in drafter.state_dict().items() if k.startswith(TRAINED_PREFIXES)}
    state[EMBEDDING_MAP] = embedding_map
    return state


def save_drafter_parts(drafter, embedding_map, folder: Union[str, Path], info: Optional[dict] = None) -> Path:
    """Save what training made (the embedding map, the projector, the language model's layers and norm; float32
    safetensors) and `info` (``training_info.json``) to `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().clone() for k, v in trained_state(drafter, embedding_map).items()}
    save_file(state, str(folder / PARTS_FILE), metadata={"format": "pt", "model": SCENES_DRAFTER})
    (folder / "text_config.json").write_text(json.dumps(TEXT_CONFIG, indent=2) + "\n")
    if info is not None:
        (folder / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return folder


def load_drafter_parts(drafter, target, folder: Union[str, Path]):
    """Load the parts saved by `save_drafter_parts` into `drafter` (in place), and its embedding from `target`'s
    and the saved map. Returns the map.

    Raises:
        ValueError: the parts were saved for another language-model configuration, or their keys differ.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    saved = json.loads((folder / "text_config.json").read_text())
    if saved != TEXT_CONFIG:
        raise ValueError(f"{folder} holds a drafter with the language model {saved}; this library builds {TEXT_CONFIG}.")
    state = load_file(str(folder / PARTS_FILE))
    embedding_map = state.pop(EMBEDDING_MAP, None)
    expected = {k for k in drafter.state_dict() if k.startswith(TRAINED_PREFIXES)}
    if embedding_map is None or set(state) != expected:
        raise ValueError(f"{folder / PARTS_FILE}: keys differ from the drafter's (missing "
                         f"{sorted(expected - set(state))[:3]}, extra {sorted(set(state) - expected)[:3]}, "
                         f"embedding map {'present' if embedding_map is not None else 'missing'}).")
    drafter.load_state_dict(state, strict=False)
    set_embedding(drafter, target.get_input_embeddings().weight, embedding_map)
    return embedding_map


MODEL_CARD = """---
library_name: transformers
tags: [speculative-decoding, hf_adaptive_spec, drafter, vision-language]
base_model: {target}
---
# {name}

An image-aware drafter for `{target}` (speculative decoding with `hf_adaptive_spec`), assembled from the target's
embedding and vision tower and the parts `hf-adaptive-spec train-scenes-drafter` trained: a 192 -> 256 projector,
a 2-layer Llama of width 256 and a 576 x 256 map of the target's embedding (tied input and output embedding).
It loads with `AutoModelForImageTextToText` and reads the image like the target (64 visual tokens).

```python
import hf_adaptive_spec
out = target.generate(**inputs, assistant_model=drafter, spec_strategy="sage")
```

Training: {training}
"""


def assemble_scenes_drafter(target_path: Union[str, Path], parts: Union[str, Path], out: Union[str, Path]) -> Path:
    """Write the full HF checkpoint (model, processor, model card) to `out`: the target at `target_path` gives the
    vision tower and the embedding, `parts` (a folder of `save_drafter_parts`) the rest."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    target = AutoModelForImageTextToText.from_pretrained(target_path, dtype=torch.float32)
    drafter, _ = build_scenes_drafter(target)
    load_drafter_parts(drafter, target, parts)
    out = Path(out)
    drafter.save_pretrained(out)
    AutoProcessor.from_pretrained(target_path).save_pretrained(out)
    info_file = Path(parts) / "training_info.json"
    training = "see training_info.json"
    if info_file.is_file():
        info = json.loads(info_file.read_text())
        shutil.copy(info_file, out / "training_info.json")
        training = (f"{info.get('steps', '?')} steps on {info.get('train_examples', '?')} answers of the target to "
                    f"train scenes, {info.get('seconds', '?')} s; held-out top-1 agreement "
                    f"{info.get('eval', {}).get('top1', '?')}.")
    (out / "README.md").write_text(MODEL_CARD.format(name=SCENES_DRAFTER, target=TARGET, training=training))
    return out


def fetch_scenes_drafter(cache_dir: Optional[Union[str, Path]] = None, progress: bool = True, force: bool = False,
                         parts: Optional[Union[str, Path]] = None, target: Optional[Union[str, Path]] = None) -> Path:
    """The cached, assembled drafter folder; assembled on first use from the scenes VLM (fetched or assembled if
    needed; or the folder `target`) and the shipped parts (or `parts`, a folder written by
    ``train-scenes-drafter``). A cached folder assembled from other parts is rebuilt.

    Raises:
        FileNotFoundError: no parts are shipped or given.
    """
    from ..locations import default_cache_root
    from ..registry.cache import assembled_once
    from .vlm import fetch_scenes_vlm

    parts = Path(parts) if parts is not None else SHIPPED
    if not (parts / PARTS_FILE).is_file():
        raise FileNotFoundError(f"no trained drafter parts at {parts}: train them with "
                                f"`hf-adaptive-spec train-scenes-drafter` and pass the folder.")
    digest = hashlib.sha256((parts / PARTS_FILE).read_bytes()).hexdigest()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()

    def build(folder: Path) -> Path:
        base = target if target is not None else fetch_scenes_vlm(cache_dir=cache_dir, progress=progress)
        return assemble_scenes_drafter(base, parts, folder)

    return assembled_once(root, SCENES_DRAFTER, {"parts_sha256": digest}, build, {"target": TARGET}, force=force)
