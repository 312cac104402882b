"""Tree speculative decoding on a vision-language model with an image: speculative output == plain output.

RANDOM WEIGHTS: no trained VLM can be downloaded on these offline machines, so the target is a tiny
Qwen2-VL built from a config with random weights, and its output is meaningless token ids. What this
example shows is the plumbing: the image goes through `generate` as usual (`pixel_values`,
`image_grid_thw`), the drafter also sees it, and `spec_strategy="sage"` returns exactly the plain greedy
tokens. With a real checkpoint the calls are the same:

    target = Qwen2VLForConditionalGeneration.from_pretrained(...)   # + AutoProcessor for the inputs
    out = target.generate(**inputs, assistant_model=drafter, spec_strategy="sage", return_dict_in_generate=True)

The drafter here is the target cut down to its first two of four decoder layers (same embeddings, vision
tower and head): a layer-skipping drafter that agrees with the target often enough to show accepted drafts.

    python examples/vlm_with_image.py
"""

import argparse

import torch
from transformers import (GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLTextConfig,
                          Qwen2VLVisionConfig)

import hf_adaptive_spec  # noqa: F401  (adds spec_strategy to generate)

PAD, BOS, EOS, IMAGE, VIDEO, VISION_START, VISION_END = range(7)
VOCAB = 256
PATCH, TEMPORAL_PATCH, MERGE = 4, 2, 2


def build_qwen2_vl(num_layers: int, seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """A random tiny Qwen2-VL (text width 64, `num_layers` decoder layers, a 1-block vision tower)."""
    text = Qwen2VLTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
    )
    vision = Qwen2VLVisionConfig(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, in_channels=3,
                                 patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE,
                                 initializer_range=0.3)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                           vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                           tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.generation_config = GenerationConfig(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    return model.eval()


def truncated_drafter(target, num_layers: int = 2) -> Qwen2VLForConditionalGeneration:
    """The target keeping only its first `num_layers` decoder layers; all other weights copied by value."""
    drafter = build_qwen2_vl(num_layers=num_layers, seed=1)
    missing, _unused = drafter.load_state_dict(target.state_dict(), strict=False)  # deeper layers are dropped
    assert not missing, missing
    return drafter.eval()


def patchify(image: torch.Tensor):
    """`(3, H, W)` image in [0, 1] -> Qwen2-VL `pixel_values` `(h*w patches, 3*2*4*4)` and `image_grid_thw`.

    The same layout as `Qwen2VLImageProcessor`: the frame repeated over the temporal patch, patches grouped
    by 2x2 merge windows.
    """
    channels, height, width = image.shape
    grid_h, grid_w = height // PATCH, width // PATCH
    frames = ((image - 0.5) / 0.5)[None].repeat(TEMPORAL_PATCH, 1, 1, 1)  # (T, C, H, W)
    x = frames.reshape(1, TEMPORAL_PATCH, channels, grid_h // MERGE, MERGE, PATCH, grid_w // MERGE, MERGE, PATCH)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h/m, w/m, m, m, C, T, p, p)
    pixel_values = x.reshape(grid_h * grid_w, channels * TEMPORAL_PATCH * PATCH * PATCH)
    return pixel_values, torch.tensor([[1, grid_h, grid_w]])


def make_inputs(image: torch.Tensor) -> dict:
    """"<bos> describe <vision_start> <image>*n <vision_end> please" as ids (n = patches / 4)."""
    pixel_values, grid_thw = patchify(image)
    num_image_tokens = int(grid_thw.prod()) // MERGE**2
    ids = [BOS, 40, 41, VISION_START] + [IMAGE] * num_image_tokens + [VISION_END, 42, 43, 44]
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == IMAGE).long(),
        "pixel_values": pixel_values,
        "image_grid_thw": grid_thw,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    target = build_qwen2_vl(num_layers=4)
    drafter = truncated_drafter(target, num_layers=2)
    # a 16x24 synthetic RGB "photo": horizontal red ramp, vertical green ramp, a blue square
    image = torch.zeros(3, 16, 24)
    image[0] = torch.linspace(0, 1, 24)[None, :]
    image[1] = torch.linspace(0, 1, 16)[:, None]
    image[2, 4:12, 8:16] = 1.0
    inputs = make_inputs(image)
    grid = inputs["image_grid_thw"][0].tolist()
    print(f"prompt: {inputs['input_ids'].shape[1]} tokens, image grid (t, h, w) = {grid}")

    plain = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
    out = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens, assistant_model=drafter,
                          spec_strategy="sage", return_dict_in_generate=True)
    prompt_length = inputs["input_ids"].shape[1]
    print("plain greedy :", plain[0, prompt_length:].tolist())
    print("sage         :", out.sequences[0, prompt_length:].tolist())
    same = torch.equal(out.sequences, plain)
    print("identical    :", same)
    stats = out.spec_stats
    print(f"rounds {stats.rounds}, tau {stats.mean_accepted_length:.2f}, accepted {stats.accepted_tokens}"
          f"/{stats.drafted_tokens} drafted, accepted per round {stats.accepted_lengths}")
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in stats.to_dict().items()})
    if not same:
        raise SystemExit("speculative output differs from plain greedy")


if __name__ == "__main__":
    main()
