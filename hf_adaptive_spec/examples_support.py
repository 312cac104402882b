"""Tiny random-weight stand-ins for the real models of `examples/`, chosen by ``HF_ADAPTIVE_SPEC_EXAMPLES=tiny``.

With the variable set to ``tiny``, every example script and the quickstart notebook build their models here
(seconds on a CPU, nothing downloaded) instead of loading real checkpoints, so they run end to end in CI. The
stand-ins keep the shapes the examples rely on: a character-level tokenizer with a chat template, a Llama
target and a drafter made of its first layers (same embeddings and head, so drafts are often accepted), a LaSpec
drafter sized for the target, and a LLaVA target, processor and image-aware drafter. Their text is noise and
their speeds mean nothing; greedy speculative output still equals plain `generate`'s, which is what the examples
check. Unset (or ``real``), the examples load the real models.
"""

from __future__ import annotations

import os

import torch

__all__ = ["EXAMPLES_ENV", "tiny_image", "tiny_laspec_drafter", "tiny_lm", "tiny_mode", "tiny_pair",
           "tiny_tokenizer", "tiny_vlm", "tiny_vlm_drafter"]

EXAMPLES_ENV = "HF_ADAPTIVE_SPEC_EXAMPLES"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<image>", "<unk>")  # ids 0-4; then "\n" and printable ASCII
IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<s>' + message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant: ' }}{% endif %}"
)
HIDDEN_SIZE = 64
IMAGE_SIZE, PATCH_SIZE = 16, 8  # 2 x 2 = 4 image tokens (the CLS feature is dropped)


def tiny_mode() -> bool:
    """Whether ``HF_ADAPTIVE_SPEC_EXAMPLES`` asks for the tiny stand-ins (``tiny``); unset or ``real``: no."""
    value = os.environ.get(EXAMPLES_ENV, "real")
    if value not in ("real", "tiny"):
        raise ValueError(f"{EXAMPLES_ENV}={value!r}: expected 'tiny' (random-weight stand-ins) or 'real'.")
    return value == "tiny"


def tiny_tokenizer():
    """A character-level fast tokenizer (special tokens, newline, printable ASCII: 101 ids) with a chat template
    that takes string contents and content parts (``{"type": "image"}`` becomes ``<image>``)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tokens = list(SPECIAL_TOKENS) + ["\n"] + [chr(code) for code in range(32, 127)]
    model = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    model.decoder = decoders.Fuse()
    model.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", chat_template=CHAT_TEMPLATE)


def _text_config(tokenizer, num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN_SIZE, intermediate_size=2 * HIDDEN_SIZE,
                       num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, initializer_range=0.3, tie_word_embeddings=False,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)


def _finish(model, tokenizer):
    """Eval mode, greedy generation settings, and a head that practically never emits a special token (their
    rows zeroed, the end-of-sequence row halved), so answers run their full length."""
    from transformers import GenerationConfig

    with torch.no_grad():
        head = model.get_output_embeddings().weight
        eos = head[tokenizer.eos_token_id] * 0.5
        head[: len(SPECIAL_TOKENS)].zero_()
        head[tokenizer.eos_token_id] = eos
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id, do_sample=False)
    return model.eval()


def tiny_lm(tokenizer, num_layers: int = 4, seed: int = 0):
    """A random ``LlamaForCausalLM`` (width 64, `num_layers` layers) over `tokenizer`'s vocabulary."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(_text_config(tokenizer, num_layers), attn_implementation="sdpa",
                                          dtype=torch.float32)
    return _finish(model, tokenizer)


def tiny_pair():
    """``(target, drafter, tokenizer)``: a 4-layer target and a drafter made of its first 2 layers, embeddings
    and head."""
    tokenizer = tiny_tokenizer()
    target = tiny_lm(tokenizer, 4)
    drafter = tiny_lm(tokenizer, 2, seed=1)
    drafter.load_state_dict(target.state_dict(), strict=False)
    return target, drafter, tokenizer


def tiny_laspec_drafter(target):
    """An untrained one-layer LaSpec block drafter sized for `target`, attached to it (its visual gate closed,
    as a new drafter's is)."""
    from .drafters.laspec import LaSpecDrafterConfig, LaSpecDrafterModel

    torch.manual_seed(2)
    return LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval().attach_target(target)


def _vlm_config(tokenizer, num_layers: int):
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2, projection_dim=32, initializer_range=0.3)
    return LlavaConfig(vision_config=vision, text_config=_text_config(tokenizer, num_layers),
                       image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                       image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2, vision_feature_select_strategy="default",
                       vision_feature_layer=-1, tie_word_embeddings=False)


def _llava(tokenizer, num_layers: int, seed: int):
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration._from_config(_vlm_config(tokenizer, num_layers),
                                                       attn_implementation="sdpa", dtype=torch.float32)
    return _finish(model, tokenizer)


def tiny_vlm():
    """``(target, processor)``: a random 4-layer ``LlavaForConditionalGeneration`` and a ``LlavaProcessor``
    (any image resized to 16 x 16 pixels: 4 image tokens) with the tiny tokenizer's chat template."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    tokenizer = tiny_tokenizer()
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE)
    return _llava(tokenizer, 4, seed=0), processor


def tiny_vlm_drafter(target):
    """An image-aware drafter for a `tiny_vlm` target: a one-layer LLaVA with the target's vision tower,
    projector, embeddings, first layer and head."""
    drafter = _llava(tiny_tokenizer(), 1, seed=1)
    drafter.load_state_dict(target.state_dict(), strict=False)
    return drafter


def tiny_image():
    """A 64 x 64 RGB image of four coloured quadrants (PIL)."""
    from PIL import Image

    image = Image.new("RGB", (64, 64))
    for index, colour in enumerate(((200, 30, 30), (30, 160, 60), (40, 60, 200), (220, 200, 40))):
        left, top = 32 * (index % 2), 32 * (index // 2)
        image.paste(colour, (left, top, left + 32, top + 32))
    return image
