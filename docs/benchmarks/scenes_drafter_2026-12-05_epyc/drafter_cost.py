"""What a drafted token of scenes-vlm-drafter-16m costs, against a target step, inside the library's rounds.

Target step: the plain mode (spec_strategy="plain": the library's forward, one token per step), seconds per
token. Drafter: a fixed chain of 4 (no adaptation, no cost trimming), seconds of drafting per drafted token
(`SpecStats.time_draft / drafted_tokens`: the drafter's forwards and the tree's bookkeeping). Held-out scenes,
greedy, 64 new tokens, best of 3 runs per scene. Run: python drafter_cost.py [--scenes 6]
"""

import argparse
import json

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

import hf_adaptive_spec
from hf_adaptive_spec.bench.inputs import encode_prompt
from hf_adaptive_spec.loading import resolve_path
from hf_adaptive_spec.scenes.dataset import DESCRIBE_REQUEST, make_scenes, scene_messages

parser = argparse.ArgumentParser()
parser.add_argument("--scenes", type=int, default=6)
args = parser.parse_args()
torch.set_num_threads(2)
target_path = resolve_path("scenes-vlm-135m")
target = AutoModelForImageTextToText.from_pretrained(target_path, attn_implementation="sdpa").eval()
processor = AutoProcessor.from_pretrained(target_path)
drafter = AutoModelForImageTextToText.from_pretrained(resolve_path("scenes-vlm-drafter-16m"),
                                                      attn_implementation="sdpa").eval()
step, drafted = [], []
for scene in make_scenes("test", args.scenes):
    inputs = encode_prompt(processor, scene_messages(DESCRIBE_REQUEST), "cpu", scene.image)
    best_step = best_draft = float("inf")
    for _ in range(3):
        out = target.generate(**inputs, max_new_tokens=64, do_sample=False, spec_strategy="plain",
                              return_dict_in_generate=True)
        stats = out.spec_stats
        best_step = min(best_step, (stats.time_total - stats.time_prefill) / max(1, stats.new_tokens - 1))
        out = target.generate(**inputs, max_new_tokens=64, do_sample=False, assistant_model=drafter,
                              spec_strategy="chain", return_dict_in_generate=True,
                              spec_config={"num_draft_tokens": 4, "adaptive": False})
        stats = out.spec_stats
        best_draft = min(best_draft, stats.time_draft / max(1, stats.drafted_tokens))
    step.append(best_step)
    drafted.append(best_draft)
result = {"scenes": args.scenes, "target_step_ms": 1e3 * sum(step) / len(step),
          "drafted_token_ms": 1e3 * sum(drafted) / len(drafted)}
result["ratio"] = result["drafted_token_ms"] / result["target_step_ms"]
print(json.dumps(result, indent=1))
