"""Tiny random-weight models of attention families beyond `tiny_models.ARCHS`: sliding-window and chunked
layers, a prefix-LM VLM, a VLM with windowed layers, and a cross-attention VLM (refused).

Same vocabulary and special ids as `tiny_models` (pad 0, bos 1, eos 2, image 3, 8.. text). Windows are 4
tokens and prompts 7-12 tokens, so every prompt is longer than the window and accepted paths cross its edge.
"""

from __future__ import annotations

import copy

import torch
import transformers as tf

from tiny_models import EMBED_SCALE, EOS_ID, IMAGE_ID, INIT_STD, PAD_ID, TEXT_TOKEN_RANGE, VOCAB_SIZE

WINDOW = 4
BOI_ID, EOI_ID = 5, 6  # Gemma 3 image start / end markers
IMAGE_SIZE = 8
# family -> (needs eager attention: softcapping or attention sinks, has an image input)
FAMILIES = {
    "mistral": (False, False),
    "gemma2": (True, False),
    "gemma3_text": (False, False),
    "gpt_oss": (True, False),
    "llama4_text": (False, False),
    "gemma3_vlm": (False, True),
    "paligemma": (False, True),
}
TEXT_FAMILIES = tuple(name for name, (_, image) in FAMILIES.items() if not image)
VLM_FAMILIES = tuple(name for name, (_, image) in FAMILIES.items() if image)
IMAGE_TOKENS = {"gemma3_vlm": 4, "paligemma": 4}


def _text(num_layers: int = 2, hidden_size: int = 32) -> dict:
    return dict(vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=EOS_ID, initializer_range=INIT_STD,
                max_position_embeddings=256)


def _layer_types(num_layers: int, windowed: str) -> list[str]:
    return [windowed if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _vision(**kwargs):
    return tf.SiglipVisionConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64,
                                 initializer_range=INIT_STD, image_size=IMAGE_SIZE, **kwargs)


def _config(family: str, num_layers: int):
    text = _text(num_layers)
    sliding = dict(sliding_window=WINDOW, layer_types=_layer_types(num_layers, "sliding_attention"))
    if family == "mistral":  # every layer sliding, no layer_types
        return tf.MistralForCausalLM, tf.MistralConfig(**text, sliding_window=WINDOW)
    if family == "gemma2":
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(**text, **sliding)
    if family == "gemma3_text":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**text, **sliding)
    if family == "gpt_oss":
        return tf.GptOssForCausalLM, tf.GptOssConfig(**text, **sliding, num_local_experts=4, num_experts_per_tok=2)
    if family == "llama4_text":
        return tf.Llama4ForCausalLM, tf.Llama4TextConfig(
            **text, intermediate_size_mlp=2 * text["hidden_size"], attention_chunk_size=WINDOW, num_local_experts=2,
            num_experts_per_tok=1, layer_types=_layer_types(num_layers, "chunked_attention"),
            no_rope_layers=[int(i % 2 == 0) for i in range(num_layers)])
    if family == "gemma3_vlm":
        config = tf.Gemma3Config(text_config=tf.Gemma3TextConfig(**text, **sliding), vision_config=_vision(patch_size=2),
                                 mm_tokens_per_image=IMAGE_TOKENS[family], image_token_index=IMAGE_ID,
                                 boi_token_index=BOI_ID, eoi_token_index=EOI_ID)
        return tf.Gemma3ForConditionalGeneration, config
    if family == "paligemma":
        config = tf.PaliGemmaConfig(text_config=tf.GemmaConfig(**text), vision_config=_vision(patch_size=4),
                                    image_token_index=IMAGE_ID, projection_dim=32)
        config.text_config.num_image_tokens = IMAGE_TOKENS[family]
        return tf.PaliGemmaForConditionalGeneration, config
    raise ValueError(f"unknown family {family!r}")


def build(family: str, seed: int = 0, num_layers: int = 2):
    """A tiny model of `family` (fp32, eval, sdpa unless the family needs eager)."""
    cls, config = _config(family, num_layers)
    torch.manual_seed(seed)
    attn = "eager" if FAMILIES[family][0] else "sdpa"
    model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(EMBED_SCALE)
    model.generation_config = tf.GenerationConfig(pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=EOS_ID,
                                                  do_sample=False)
    return model


def drafter(family: str, target, kind: str):
    """copy: the target itself, deep-copied; small: the same family, 1 layer, other weights; text: a 1-layer
    Mistral (windowed, image-blind) over the same vocabulary."""
    if kind == "copy":
        return copy.deepcopy(target).eval()
    if kind == "small":
        return build(family, seed=1, num_layers=1)
    if kind == "text":
        return build("mistral", seed=2, num_layers=1)
    raise ValueError(kind)


def make_inputs(family: str, batch_size: int = 1, prompt_lengths=(12, 7), seed: int = 0) -> dict:
    """Left-padded prompts of different lengths; for a VLM one image per row after the first text token."""
    generator = torch.Generator().manual_seed(seed)
    rows, images = [], []
    for length in prompt_lengths[:batch_size]:
        text = torch.randint(*TEXT_TOKEN_RANGE, (length,), generator=generator).tolist()
        if family == "gemma3_vlm":
            text = text[:1] + [BOI_ID] + [IMAGE_ID] * IMAGE_TOKENS[family] + [EOI_ID] + text[1:]
        elif family == "paligemma":  # image first, then the prompt (the processor's layout)
            text = [IMAGE_ID] * IMAGE_TOKENS[family] + text
        rows.append(text)
        images.append(torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator))
    width = max(len(row) for row in rows)
    input_ids = torch.full((batch_size, width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row):] = torch.tensor(row)
        attention_mask[i, width - len(row):] = 1
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if family in VLM_FAMILIES:
        inputs["pixel_values"] = torch.cat(images)
        if family == "gemma3_vlm":
            inputs["token_type_ids"] = (input_ids == IMAGE_ID).long()
        else:  # PaliGemma: the whole prompt is the bidirectional prefix
            inputs["token_type_ids"] = torch.zeros_like(input_ids)
    return inputs


def build_mllama(seed: int = 0):
    """A tiny Mllama (cross-attention VLM): refused by spec_strategy."""
    text = tf.MllamaTextConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, cross_attention_layers=[1],
                               pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=EOS_ID, initializer_range=INIT_STD)
    vision = tf.MllamaVisionConfig(hidden_size=32, num_hidden_layers=1, num_global_layers=1, num_attention_heads=2,
                                   intermediate_size=64, image_size=8, patch_size=4, max_num_tiles=1,
                                   vision_output_dim=64, intermediate_layers_indices=[0],
                                   supported_aspect_ratios=[[1, 1]])
    config = tf.MllamaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_ID)
    torch.manual_seed(seed)
    model = tf.MllamaForConditionalGeneration._from_config(config, attn_implementation="sdpa",
                                                          dtype=torch.float32).eval()
    model.generation_config = tf.GenerationConfig(pad_token_id=PAD_ID, bos_token_id=1, eos_token_id=EOS_ID,
                                                  do_sample=False)
    return model
