"""Tiny random-weight models and ready-made inputs for tests.

Everything is built from configs (no network, never ``from_pretrained``).  Every
architecture shares one small vocabulary with fixed special ids:

==========  ===  =====================================================
name        id   use
==========  ===  =====================================================
PAD_ID      0    padding (config / generation_config ``pad_token_id``)
BOS_ID      1    ``bos_token_id`` (not put into prompts)
EOS_ID      2    ``eos_token_id`` (may be generated: the model can stop)
IMAGE_ID    3    image placeholder (``image_token_id`` / ``image_token_index``)
VIDEO_ID    4    video placeholder (never used by ``make_inputs``)
VSTART_ID   5    ``vision_start_token_id`` (Qwen-VL family only)
VEND_ID     6    ``vision_end_token_id`` (Qwen-VL family only)
7           7    reserved
8..V-1           ordinary text tokens (``TEXT_TOKEN_RANGE``)
==========  ===  =====================================================

The rows of ``lm_head`` for the ids 0,1,3..7 are zeroed (logit exactly 0), so
greedy decoding practically never emits pad / bos / image / video / vision
markers.  The EOS row is random but scaled by 0.5: sampling can emit EOS, greedy
practically never does (0 of 192 rows x 30 tokens, 8 archs x 6 seeds).  A test
that needs an early stop should pass ``eos_token_id=<a token the greedy output
contains>`` to ``generate``.

Weights use ``initializer_range=0.3`` (last-token logits std ~1.6).  Numerical
noise between equivalent computations (batch 2 vs batch 1, sdpa vs eager) is
usually exactly 0 and at most ~1e-5 on a logit, while the top-2 logit gap is
below 1e-2 in only 1% of greedy steps: an argmax flip from fp32 noise has a
probability of roughly 1e-5 per generated token (not zero, but "never" in a
test suite of this size).

Tiny random models like runs of one token: about 2-4% of rows have at most 4
distinct tokens among their first 12.  The defaults of ``make_inputs`` (seed 0,
batch 1/2/4, with and without image) were checked to give varied outputs and no
EOS within 20 tokens for every arch.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import GenerationConfig, PreTrainedModel

ARCHS = ("llama", "qwen2", "qwen3", "llava", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
TEXT_ARCHS = ("llama", "qwen2", "qwen3")
VLM_ARCHS = ("llava", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
QWEN_VL_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")

VOCAB_SIZE = 128
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
IMAGE_ID = 3
VIDEO_ID = 4
VSTART_ID = 5
VEND_ID = 6
SPECIAL_IDS = (PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID, 7)
TEXT_TOKEN_RANGE = (8, VOCAB_SIZE)  # [low, high)
_SILENCED_IDS = tuple(i for i in SPECIAL_IDS if i != EOS_ID)  # lm_head rows zeroed

INIT_STD = 0.3
EOS_ROW_SCALE = 0.5  # EOS row of lm_head scaled down: greedy practically never stops early
# Balance of the residual stream: text embeddings x3 (rms ~0.9) and the last layer of the image
# projector / merger scaled so image embeddings have rms ~1 too.  Unscaled, image embeddings are
# 8-25x larger than text embeddings and swamp the text tokens.
EMBED_SCALE = 3.0
# last linear of: llava projectors, qwen2(.5)-vl merger, qwen3-vl merger and deepstack mergers
_IMAGE_OUT_LAYERS = ("multi_modal_projector.linear_2", "merger.mlp.2", "merger.linear_fc2")
_IMAGE_OUT_LAYERS += tuple(f"deepstack_merger_list.{i}.linear_fc2" for i in range(8))
_IMAGE_OUT_SCALE = {"llava": 0.4, "llava_onevision": 0.4, "qwen2_vl": 0.12, "qwen2_5_vl": 0.12,
                    "qwen3_vl": 0.12, "qwen3_vl_moe": 0.12, "llama": 1.0, "qwen2": 1.0, "qwen3": 1.0}

# --- vision geometry -------------------------------------------------------
# Llava (CLIP): 8x8 image, patch 4 -> 2x2 = 4 patches (+CLS dropped) -> 4 image tokens.
LLAVA_IMAGE_SIZE = 8
LLAVA_PATCH = 4
# LlavaOnevision (SigLIP): tile 8x8, patch 4 -> 4 features per tile; anyres with pinpoints
# [[8, 8], [8, 16]].  Row i of a batch gets image size ONEVISION_IMAGE_SIZES[i % 2].
ONEVISION_TILE = 8
ONEVISION_PATCH = 4
ONEVISION_PINPOINTS = [[8, 8], [8, 16]]
ONEVISION_IMAGE_SIZES = ((8, 8), (8, 16))  # (height, width): 2 patches/10 tokens, 3 patches/14 tokens
# Qwen-VL family: patch 4, temporal patch 2, spatial merge 2; grid (t, h, w) in patches.
# Row i of a batch gets grid QWEN_GRIDS[i % 2]: 2x2 = 4 and 2x3 = 6 merged image tokens.
QWEN_PATCH = 4
QWEN_TEMPORAL_PATCH = 2
QWEN_MERGE = 2
QWEN_GRIDS = ((1, 4, 4), (1, 4, 6))

DEFAULT_PROMPT_LENGTHS = (5, 9, 7, 11)


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _heads(hidden_size: int) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim): head_dim 16, GQA 2:1."""
    n_heads = max(2, hidden_size // 16)
    if hidden_size % n_heads:
        raise ValueError(f"hidden_size {hidden_size} not divisible by {n_heads} heads")
    return n_heads, max(1, n_heads // 2), hidden_size // n_heads


def _token_kwargs() -> dict:
    return dict(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def _text_kwargs(num_layers: int, hidden_size: int, vocab_size: int = VOCAB_SIZE) -> dict:
    n_heads, n_kv, head_dim = _heads(hidden_size)
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        max_position_embeddings=1024,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        **_token_kwargs(),
    )


def _mrope_section(head_dim: int, interleaved: bool) -> list[int]:
    half = head_dim // 2
    if interleaved:  # Qwen3-VL default [24, 20, 20] of 64
        hw = (5 * half) // 16
    else:  # Qwen2-VL default [16, 24, 24] of 64
        hw = (3 * half) // 8
    hw = max(1, hw)
    return [half - 2 * hw, hw, hw]


def _make_config(arch: str, num_layers: int, hidden_size: int, vocab_size: int = VOCAB_SIZE):
    import transformers as tf

    text = _text_kwargs(num_layers, hidden_size, vocab_size)
    n_heads, n_kv, head_dim = _heads(hidden_size)
    rope_default = {"rope_type": "default", "rope_theta": 10000.0}

    if arch == "llama":
        return tf.LlamaConfig(**text, rope_parameters=dict(rope_default))
    if arch == "qwen2":
        return tf.Qwen2Config(**text, rope_parameters=dict(rope_default))
    if arch == "qwen3":  # per-head q/k norms; Qwen3Config's head_dim defaults to 128, so it is set
        return tf.Qwen3Config(**text, head_dim=head_dim, rope_parameters=dict(rope_default))

    vision_common = dict(
        num_hidden_layers=1,
        num_attention_heads=2,
        hidden_size=32,
        intermediate_size=64,
        initializer_range=INIT_STD,
    )
    if arch == "llava":
        vision = tf.CLIPVisionConfig(
            **vision_common,
            image_size=LLAVA_IMAGE_SIZE,
            patch_size=LLAVA_PATCH,
            projection_dim=32,
        )
        txt = tf.LlamaConfig(**text, rope_parameters=dict(rope_default))
        return tf.LlavaConfig(
            vision_config=vision,
            text_config=txt,
            image_token_index=IMAGE_ID,
            image_seq_length=(LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2,
            vision_feature_select_strategy="default",
            vision_feature_layer=-1,
            tie_word_embeddings=False,
        )
    if arch == "llava_onevision":
        vision = tf.SiglipVisionConfig(
            **vision_common,
            image_size=ONEVISION_TILE,
            patch_size=ONEVISION_PATCH,
            vision_use_head=False,
        )
        txt = tf.Qwen2Config(**text, rope_parameters=dict(rope_default))
        return tf.LlavaOnevisionConfig(
            vision_config=vision,
            text_config=txt,
            image_token_index=IMAGE_ID,
            video_token_index=VIDEO_ID,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
            image_grid_pinpoints=[list(p) for p in ONEVISION_PINPOINTS],
            vision_aspect_ratio="anyres_max_9",
            tie_word_embeddings=False,
        )

    qwen_ids = dict(
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=VSTART_ID,
        vision_end_token_id=VEND_ID,
        tie_word_embeddings=False,
    )
    patch = dict(
        in_channels=3,
        patch_size=QWEN_PATCH,
        temporal_patch_size=QWEN_TEMPORAL_PATCH,
        spatial_merge_size=QWEN_MERGE,
        initializer_range=INIT_STD,
    )
    if arch == "qwen2_vl":
        txt = tf.Qwen2VLTextConfig(
            **text,
            rope_parameters={**rope_default, "mrope_section": _mrope_section(head_dim, False)},
        )
        vision = tf.Qwen2VLVisionConfig(
            depth=1, embed_dim=32, hidden_size=hidden_size, num_heads=2, mlp_ratio=2, **patch
        )
        return tf.Qwen2VLConfig(text_config=txt, vision_config=vision, **qwen_ids)
    if arch == "qwen2_5_vl":
        txt = tf.Qwen2_5_VLTextConfig(
            **text,
            rope_parameters={**rope_default, "mrope_section": _mrope_section(head_dim, False)},
        )
        # 2 blocks: block 0 windowed (window 16 px = 2x2 merged tokens), block 1 full attention.
        vision = tf.Qwen2_5_VLVisionConfig(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=hidden_size,
            window_size=16,
            fullatt_block_indexes=[1],
            **patch,
        )
        return tf.Qwen2_5_VLConfig(text_config=txt, vision_config=vision, **qwen_ids)
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        rope = {
            **rope_default,
            "mrope_section": _mrope_section(head_dim, True),
            "mrope_interleaved": True,
        }
        vision_kwargs = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=hidden_size,
            num_position_embeddings=16,  # 4x4 learned grid, bilinearly interpolated
            deepstack_visual_indexes=[0],
            **patch,
        )
        if arch == "qwen3_vl":
            txt = tf.Qwen3VLTextConfig(**text, head_dim=head_dim, rope_parameters=rope)
            vision = tf.Qwen3VLVisionConfig(**vision_kwargs)
            return tf.Qwen3VLConfig(text_config=txt, vision_config=vision, **qwen_ids)
        txt = tf.Qwen3VLMoeTextConfig(
            **text,
            head_dim=head_dim,
            rope_parameters=rope,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        vision = tf.Qwen3VLMoeVisionConfig(**vision_kwargs)
        return tf.Qwen3VLMoeConfig(text_config=txt, vision_config=vision, **qwen_ids)
    raise ValueError(f"unknown arch {arch!r}")


_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}


def _set_token_ids(config) -> None:
    """pad/bos/eos on the top config and on every text sub-config (best effort)."""
    configs = [config]
    text_config = config.get_text_config()
    if text_config is not config:
        configs.append(text_config)
    for cfg in configs:
        for name, value in _token_kwargs().items():
            try:
                setattr(cfg, name, value)
            except Exception:  # strict config without the field: leave it
                pass


def _build(arch: str, seed: int, num_layers: int, attn_implementation: str, hidden_size: int,
           vocab_size: int = VOCAB_SIZE) -> PreTrainedModel:
    import transformers as tf

    _check_arch(arch)
    config = _make_config(arch, num_layers, hidden_size, vocab_size)
    _set_token_ids(config)
    cls = getattr(tf, _MODEL_CLASSES[arch])
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        for tok in _SILENCED_IDS:
            if tok < head.shape[0]:
                head[tok].zero_()
        if EOS_ID < head.shape[0]:
            head[EOS_ID].mul_(EOS_ROW_SCALE)
        model.get_input_embeddings().weight.mul_(EMBED_SCALE)
        for name, module in model.named_modules():
            if name.endswith(_IMAGE_OUT_LAYERS):
                module.weight.mul_(_IMAGE_OUT_SCALE[arch])
    model.generation_config = GenerationConfig(
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        do_sample=False,
    )
    return model


def build_model(arch: str, seed: int = 0, num_layers: int = 2, attn_implementation: str = "sdpa",
                hidden_size: int = 32) -> PreTrainedModel:
    """Tiny random model: ``*ForCausalLM`` (text) or ``*ForConditionalGeneration`` (VLM).

    fp32, eval mode, ``torch.manual_seed(seed)`` right before weight init, vocab ``VOCAB_SIZE``,
    ``num_layers`` text decoder layers of width ``hidden_size`` (head_dim 16, 2:1 GQA),
    vision towers of 1-2 layers (width 32).
    """
    return _build(arch, seed, num_layers, attn_implementation, hidden_size)


def build_drafter(arch: str, target, kind: str, seed: int = 1):
    """A drafter for ``target`` (built by ``build_model(arch, ...)``).

    kind="copy":  exact deep copy of target (same weights).
    kind="small": same family/class, same vocab and special ids, 1 text layer, other weights (seed).
    kind="text":  a 1-layer LlamaForCausalLM with the target's vocab size (text-only drafter).
    """
    _check_arch(arch)
    text_config = target.config.get_text_config()
    attn = getattr(text_config, "_attn_implementation", None) or "sdpa"
    if kind == "copy":
        drafter = copy.deepcopy(target)
        return drafter.eval()
    if kind == "small":
        return _build(arch, seed, 1, attn, text_config.hidden_size, text_config.vocab_size)
    if kind == "text":
        return _build("llama", seed, 1, attn, text_config.hidden_size, text_config.vocab_size)
    raise ValueError(f"unknown drafter kind {kind!r}; expected 'copy', 'small' or 'text'")


# --- inputs ----------------------------------------------------------------


def _onevision_counts(image_size: tuple[int, int]) -> tuple[int, int]:
    """(num pixel patches incl. base, num placeholder tokens) like LlavaOnevisionProcessor."""
    from transformers.image_processing_utils import select_best_resolution

    orig_h, orig_w = image_size
    best_h, best_w = select_best_resolution([orig_h, orig_w], ONEVISION_PINPOINTS)
    num_patches = (best_h // ONEVISION_TILE) * (best_w // ONEVISION_TILE) + 1
    side = ONEVISION_TILE // ONEVISION_PATCH  # features per tile side
    base = side * side
    cur_h = side * (best_h // ONEVISION_TILE)
    cur_w = side * (best_w // ONEVISION_TILE)
    if orig_w / orig_h > cur_w / cur_h:
        new_h = int(round(orig_h * (cur_w / orig_w), 7))
        cur_h -= ((cur_h - new_h) // 2) * 2
    else:
        new_w = int(round(orig_w * (cur_h / orig_h), 7))
        cur_w -= ((cur_w - new_w) // 2) * 2
    unpadded, newlines = cur_h * cur_w, cur_h
    ratio = math.sqrt(cur_h * cur_w / (9 * side * side))  # anyres_max_9
    if ratio > 1.1:
        unpadded = int(cur_h // ratio) * int(cur_w // ratio)
        newlines = int(cur_h // ratio)
    return num_patches, base + unpadded + newlines  # strategy "full": nothing removed


def num_image_tokens(arch: str, row: int = 0) -> int:
    """Placeholder tokens (IMAGE_ID count) in row ``row`` of ``make_inputs(arch, ...)``."""
    if arch == "llava":
        return (LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2
    if arch == "llava_onevision":
        return _onevision_counts(ONEVISION_IMAGE_SIZES[row % 2])[1]
    if arch in QWEN_VL_ARCHS:
        t, h, w = QWEN_GRIDS[row % 2]
        return t * h * w // QWEN_MERGE**2
    raise ValueError(f"{arch!r} has no image input")


def _image_for_row(arch: str, row: int, gen: torch.Generator) -> tuple[list[int], dict]:
    """(placeholder token block, per-row image tensors)."""
    n_tok = num_image_tokens(arch, row)
    if arch == "llava":
        pix = torch.randn(1, 3, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE, generator=gen)
        return [IMAGE_ID] * n_tok, {"pixel_values": pix}
    if arch == "llava_onevision":
        size = ONEVISION_IMAGE_SIZES[row % 2]
        n_patches, _ = _onevision_counts(size)
        pix = torch.randn(1, n_patches, 3, ONEVISION_TILE, ONEVISION_TILE, generator=gen)
        return [IMAGE_ID] * n_tok, {"pixel_values": pix, "image_sizes": torch.tensor([list(size)])}
    t, h, w = QWEN_GRIDS[row % 2]
    dim = 3 * QWEN_TEMPORAL_PATCH * QWEN_PATCH * QWEN_PATCH
    pix = torch.randn(t * h * w, dim, generator=gen)
    return [VSTART_ID] + [IMAGE_ID] * n_tok + [VEND_ID], {
        "pixel_values": pix,
        "image_grid_thw": torch.tensor([[t, h, w]]),
    }


def make_inputs(arch: str, batch_size: int = 1, prompt_lengths=None, with_image: bool = True,
                seed: int = 0) -> dict:
    """Inputs ready for ``model.generate(**inputs)``.

    Row i: ``prompt_lengths[i]`` random ordinary text tokens (ids in ``TEXT_TOKEN_RANGE``); for a
    VLM with ``with_image`` one image block is inserted after the first two text tokens
    (Llava: IMAGE_ID * n; Qwen-VL: VSTART_ID, IMAGE_ID * n, VEND_ID), already expanded to the count
    the real processor produces.  Rows are LEFT padded with PAD_ID (attention_mask 0).
    Default prompt lengths: 5, 9, 7, 11, ... (differ between rows).  Image sizes alternate per row
    (row i uses variant i % 2, see ONEVISION_IMAGE_SIZES / QWEN_GRIDS), so rows of a batch also
    differ in image token count.  Row content depends only on (seed, row index, its length).

    Keys: input_ids, attention_mask; Qwen-VL family also mm_token_type_ids (always, 1 on IMAGE_ID);
    with images: llava pixel_values [B,3,8,8]; llava_onevision pixel_values [B,P,3,8,8] (patches
    zero-padded to the max P) + image_sizes [B,2]; Qwen-VL pixel_values [sum patches, 96] +
    image_grid_thw [B,3].
    """
    _check_arch(arch)
    if prompt_lengths is None:
        prompt_lengths = [DEFAULT_PROMPT_LENGTHS[i % 4] + 8 * (i // 4) for i in range(batch_size)]
    prompt_lengths = list(prompt_lengths)
    if len(prompt_lengths) != batch_size:
        raise ValueError("len(prompt_lengths) must equal batch_size")
    use_image = with_image and arch in VLM_ARCHS

    rows, images = [], []
    for i, n_text in enumerate(prompt_lengths):
        if n_text < 1:
            raise ValueError("prompt lengths must be >= 1")
        gen = torch.Generator().manual_seed(1_000_003 * seed + 104_729 * i + 257 * n_text + 3)
        text = torch.randint(TEXT_TOKEN_RANGE[0], TEXT_TOKEN_RANGE[1], (n_text,), generator=gen).tolist()
        if use_image:
            block, img = _image_for_row(arch, i, gen)
            k = min(2, n_text)
            rows.append(text[:k] + block + text[k:])
            images.append(img)
        else:
            rows.append(text)

    max_len = max(len(r) for r in rows)
    input_ids = torch.full((batch_size, max_len), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, max_len), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, max_len - len(r):] = torch.tensor(r)
        attention_mask[i, max_len - len(r):] = 1
    out = {"input_ids": input_ids, "attention_mask": attention_mask}
    if arch in QWEN_VL_ARCHS:
        out["mm_token_type_ids"] = (input_ids == IMAGE_ID).long()
    if use_image:
        if arch == "llava":
            out["pixel_values"] = torch.cat([im["pixel_values"] for im in images])
        elif arch == "llava_onevision":
            max_p = max(im["pixel_values"].shape[1] for im in images)
            pix = torch.zeros(batch_size, max_p, 3, ONEVISION_TILE, ONEVISION_TILE)
            for i, im in enumerate(images):
                pix[i, : im["pixel_values"].shape[1]] = im["pixel_values"][0]
            out["pixel_values"] = pix
            out["image_sizes"] = torch.cat([im["image_sizes"] for im in images])
        else:
            out["pixel_values"] = torch.cat([im["pixel_values"] for im in images])
            out["image_grid_thw"] = torch.cat([im["image_grid_thw"] for im in images])
    return out


def split_rows(arch: str, inputs: dict) -> list[dict]:
    """Split a batch from ``make_inputs`` into batch-1 input dicts (padding stripped), each equal to
    what the processor would give for that row alone."""
    _check_arch(arch)
    mask = inputs["attention_mask"].bool()
    batch = mask.shape[0]
    per_row_pix = None
    if "pixel_values" in inputs:
        pix = inputs["pixel_values"]
        if "image_grid_thw" in inputs:
            counts = inputs["image_grid_thw"].prod(-1).tolist()
            per_row_pix = list(torch.split(pix, counts))
        elif arch == "llava_onevision":
            per_row_pix = []
            for i in range(batch):
                n_p, _ = _onevision_counts(tuple(inputs["image_sizes"][i].tolist()))
                per_row_pix.append(pix[i : i + 1, :n_p])
        else:
            per_row_pix = [pix[i : i + 1] for i in range(batch)]
    out = []
    for i in range(batch):
        row = {}
        for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
            if key in inputs:
                row[key] = inputs[key][i : i + 1, mask[i]]
        if per_row_pix is not None:
            row["pixel_values"] = per_row_pix[i]
            for key in ("image_grid_thw", "image_sizes"):
                if key in inputs:
                    row[key] = inputs[key][i : i + 1]
        out.append(row)
    return out
