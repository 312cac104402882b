"""Speculative decoding on a trained vision-language model, with a held-out image: output == plain greedy.

The target is `scenes-vlm-135m`: the real SmolLM2-135M-Instruct with a vision tower, a projector and low-rank
updates of its layers this library trained (`hf-adaptive-spec train-vlm`) on scenes of four coloured shapes
(`hf_adaptive_spec.scenes.dataset`, from the `easy-vqa` package). It is assembled offline from the registry's SmolLM2
and the shipped trained parts on first use.
The scene shown here is built from easy-vqa's TEST images, which training never saw.

Three drafters, each on the same image:
  * `sage` with `scenes-vlm-drafter-16m`, the small image-aware drafter (an ordinary LLaVA checkpoint with the
    target's vision tower: it reads the image and the prompt like the target, at 0.07 of a target step per
    drafted token), within 8 drafted nodes a round;
  * `laspec`: the shipped LaSpec block drafter, one small forward per round from the target's own hidden states
    (its image gate is closed, so its visual branch is skipped: the image reaches it only through those states);
  * `sage` with an image-blind drafter: the text SmolLM2, int8 (same vocabulary; never sees the image).

    python examples/vlm_with_image.py [--scene 3]
    HF_ADAPTIVE_SPEC_EXAMPLES=tiny python examples/vlm_with_image.py   # tiny random-weight models (CI)

In tiny mode a random LLaVA target, its processor, a one-layer image-aware LLaVA drafter, an untrained LaSpec
drafter and a random text drafter stand in, on a drawn image of four coloured quadrants (nothing downloaded).
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

import hf_adaptive_spec
from hf_adaptive_spec import examples_support as tiny
from hf_adaptive_spec.scenes.dataset import DESCRIBE_REQUEST, scene_messages

IMAGE_AWARE = {"n_max": 8}  # the node budget of the drafter's measured runs (docs/benchmarks.md)


def real_models(scene_index: int):
    """(target, processor, drafters, image, truth) for the scenes VLM and a held-out scene."""
    from hf_adaptive_spec.drafters.hub import load_drafter
    from hf_adaptive_spec.loading import resolve_path
    from hf_adaptive_spec.registry.models import fetch
    from hf_adaptive_spec.scenes.dataset import make_scenes

    path = resolve_path("scenes-vlm-135m")
    target = AutoModelForImageTextToText.from_pretrained(path).eval()
    drafters = {
        "sage, image-aware drafter (scenes-vlm-drafter-16m)": ("sage", IMAGE_AWARE, (
            AutoModelForImageTextToText.from_pretrained(resolve_path("scenes-vlm-drafter-16m")).eval())),
        "laspec (the shipped LaSpec drafter)": ("laspec", None, load_drafter("laspec-scenes-vlm-135m", target)),
        "sage, image-blind drafter (text SmolLM2, int8)": ("sage", None, hf_adaptive_spec.quantize_drafter(
            AutoModelForCausalLM.from_pretrained(fetch("smollm2-135m-instruct")).eval())),
    }
    scene = make_scenes("test", 1, start=scene_index)[0]
    return target, AutoProcessor.from_pretrained(path), drafters, scene.image, f"scene {scene.id}: {scene.description}"


def tiny_models():
    """The same five things built from random weights (`hf_adaptive_spec.examples_support`)."""
    target, processor = tiny.tiny_vlm()
    drafters = {
        "sage, image-aware drafter (tiny LLaVA)": ("sage", IMAGE_AWARE, tiny.tiny_vlm_drafter(target)),
        "laspec (an untrained LaSpec drafter)": ("laspec", None, tiny.tiny_laspec_drafter(target)),
        "sage, image-blind drafter (tiny text model, int8)": ("sage", None, hf_adaptive_spec.quantize_drafter(
            tiny.tiny_lm(processor.tokenizer, 1, seed=3))),
    }
    return target, processor, drafters, tiny.tiny_image(), "(random weights: no description to compare)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scene", type=int, default=0, help="index of the held-out scene")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--save-image", default=None, help="write the image to this PNG file")
    args = parser.parse_args()

    target, processor, drafters, image, truth = tiny_models() if tiny.tiny_mode() else real_models(args.scene)
    if args.save_image:
        image.save(args.save_image)
    prompt = processor.apply_chat_template(scene_messages(DESCRIBE_REQUEST), add_generation_prompt=True,
                                           tokenize=False)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    image_tokens = int((inputs["input_ids"] == target.config.image_token_id).sum())
    print(f"{inputs['input_ids'].shape[1]} prompt tokens, {image_tokens} of them image tokens")
    print(f"truth : {truth}")

    def timed(**kwargs):
        start = time.perf_counter()
        out = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens,
                              return_dict_in_generate=True, **kwargs)
        return out, time.perf_counter() - start

    timed()  # warm-up
    plain, plain_seconds = timed()
    prompt_length = inputs["input_ids"].shape[1]
    print(f"said  : {processor.decode(plain.sequences[0, prompt_length:], skip_special_tokens=True)}")
    print(f"plain greedy: {plain_seconds:.2f}s")

    for label, (strategy, spec_config, drafter) in drafters.items():
        settings = dict(assistant_model=drafter, spec_strategy=strategy, spec_config=spec_config)
        timed(**settings)  # warm-up: first-use costs
        out, seconds = timed(**settings)
        same = torch.equal(out.sequences, plain.sequences)
        stats = out.spec_stats
        print(f"{label}: {seconds:.2f}s ({plain_seconds / seconds:.2f}x), tau {stats.mean_accepted_length:.2f}, "
              f"identical to plain: {same}")
        if not same:
            raise SystemExit("speculative output differs from plain greedy")


if __name__ == "__main__":
    main()
