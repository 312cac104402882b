"""Speculative decoding on a trained vision-language model, with a held-out image: output == plain greedy.

The target is `scenes-vlm-135m`: the real SmolLM2-135M-Instruct with a vision tower, a projector and low-rank
updates of its layers this library trained (`hf-adaptive-spec train-vlm`) on scenes of four coloured shapes
(`hf_adaptive_spec.scenes.dataset`, from the `easy-vqa` package). It is assembled offline from the registry's SmolLM2
and the shipped trained parts on first use.
The scene shown here is built from easy-vqa's TEST images, which training never saw.

Three drafters, each on the same image:
  * `laspec`: the shipped LaSpec block drafter, reading the target's own states and the few image tokens the
    target attends to each round;
  * `sage` with an image-aware independent drafter: the VLM itself with int8 weights (sees the image);
  * `sage` with an image-blind drafter: the text SmolLM2, int8 (same vocabulary; never sees the image).

    python examples/vlm_with_image.py [--scene 3]
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

import hf_adaptive_spec
from hf_adaptive_spec.drafters.hub import load_drafter
from hf_adaptive_spec.registry.models import fetch
from hf_adaptive_spec.scenes.dataset import DESCRIBE_REQUEST, make_scenes, scene_messages
from hf_adaptive_spec.scenes.vlm import fetch_scenes_vlm


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scene", type=int, default=0, help="index of the held-out scene")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--save-image", default=None, help="write the scene's image to this PNG file")
    args = parser.parse_args()

    path = fetch_scenes_vlm()
    target = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    scene = make_scenes("test", 1, start=args.scene)[0]
    if args.save_image:
        scene.image.save(args.save_image)
    prompt = processor.apply_chat_template(scene_messages(DESCRIBE_REQUEST), add_generation_prompt=True,
                                           tokenize=False)
    inputs = processor(text=[prompt], images=[scene.image], return_tensors="pt")
    print(f"scene {scene.id}: {inputs['input_ids'].shape[1]} prompt tokens, 64 of them image tokens")
    print(f"truth : {scene.description}")

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

    drafters = {
        "laspec (LaSpec drafter)": ("laspec", load_drafter("laspec-scenes-vlm-135m", target)),
        "sage, image-aware drafter (the VLM, int8)": ("sage", hf_adaptive_spec.quantize_drafter(target)),
        "sage, image-blind drafter (text SmolLM2, int8)": (
            "sage", hf_adaptive_spec.quantize_drafter(
                AutoModelForCausalLM.from_pretrained(fetch("smollm2-135m-instruct")).eval())),
    }
    for label, (strategy, drafter) in drafters.items():
        timed(assistant_model=drafter, spec_strategy=strategy)  # warm-up: the cost curve, first-use costs
        out, seconds = timed(assistant_model=drafter, spec_strategy=strategy)
        same = torch.equal(out.sequences, plain.sequences)
        stats = out.spec_stats
        print(f"{label}: {seconds:.2f}s ({plain_seconds / seconds:.2f}x), tau {stats.mean_accepted_length:.2f}, "
              f"identical to plain: {same}")
        if not same:
            raise SystemExit("speculative output differs from plain greedy")


if __name__ == "__main__":
    main()
