"""Make target data and train a LaSpec drafter within one time budget (e.g. one rented GPU for 10 minutes).

    python examples/train_drafter_timed.py --target smollm2-135m-instruct --budget 480 --out my-drafter

`train-drafter` makes all its data, then trains for --steps (or --max-train-seconds). This script shares a
budget between the two: it answers the prompts in chunks (shuffled, so any prefix mixes the sources) until
`--data-fraction` of the budget is spent, then trains with what is left (`TrainConfig.max_seconds`) and saves
the folder with its model card. On one H200 (2026-11-30): 5120 prompts x 2 answers in 165 s (SmolLM2-135M,
batches of 512), then 85 ms per training step at 16 sequences x 32 anchors (CHANGELOG.md,
2026-11-30).

With HF_ADAPTIVE_SPEC_EXAMPLES=tiny, a tiny random-weight target stands in for --target (seconds, nothing
downloaded; CI runs it so):

    HF_ADAPTIVE_SPEC_EXAMPLES=tiny python examples/train_drafter_timed.py --budget 20 --out /tmp/tiny-drafter \
        --specs templates --max-prompts 8 --max-new-tokens 16 --steps 4
"""
import argparse
import random
import shutil
import sys
import time
from pathlib import Path

T0 = time.time()
parser = argparse.ArgumentParser()
parser.add_argument("--target", default=None,
                    help="registry name or folder (required unless HF_ADAPTIVE_SPEC_EXAMPLES=tiny)")
parser.add_argument("--target-name", default="smollm2-135m-instruct")
parser.add_argument("--budget", type=float, required=True, help="seconds for this whole script")
parser.add_argument("--data-fraction", type=float, default=0.42, help="share of the budget for making data")
parser.add_argument("--reserve", type=float, default=25.0, help="seconds kept for saving at the end")
parser.add_argument("--out", required=True)
parser.add_argument("--specs", nargs="+", default=["humaneval[24:]", "mtbench[24:]", "stdlib", "stdlib_methods",
                                                   "templates", "docs"])
parser.add_argument("--max-prompts", type=int, default=0)
parser.add_argument("--chunk", type=int, default=1024)
parser.add_argument("--generate-batch-size", type=int, default=512)
parser.add_argument("--samples-per-prompt", type=int, default=2)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--layers", type=int, default=1)
parser.add_argument("--fuse-previous-state", action="store_true", help="see LaSpecDrafterConfig.fuse_previous_state")
parser.add_argument("--batch-sequences", type=int, default=16)
parser.add_argument("--anchors", type=int, default=32)
parser.add_argument("--steps", type=int, default=100_000,
                    help="training steps at most (the budget may end training sooner)")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--eval-every", type=int, default=1000)
parser.add_argument("--eval-fraction", type=float, default=0.04)
parser.add_argument("--copy-to", default=None, help="also copy the final files into this folder")
args = parser.parse_args()


def log(*parts):
    print(f"[{time.time() - T0:6.1f}s]", *parts, flush=True)


import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel  # noqa: E402
from hf_adaptive_spec.examples_support import tiny_mode, tiny_pair  # noqa: E402
from hf_adaptive_spec.loading import load_model  # noqa: E402
from hf_adaptive_spec.training.cli import (  # noqa: E402
    _prompts, save_drafter_folder, set_frequent_vocabulary, split_held_out)
from hf_adaptive_spec.training.data import build_examples  # noqa: E402
from hf_adaptive_spec.training.trainer import TrainConfig, train_drafter  # noqa: E402

accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
if tiny_mode():
    target, _, tokenizer = tiny_pair()
elif args.target is None:
    parser.error("--target is required (or HF_ADAPTIVE_SPEC_EXAMPLES=tiny for a tiny random-weight target)")
else:
    target, tokenizer = load_model(args.target)
target = target.to(accelerator.device).eval().requires_grad_(False)
config = LaSpecDrafterConfig.for_target(target, block_size=4, num_hidden_layers=args.layers,
                                        fuse_previous_state=args.fuse_previous_state,
                                        target_model_name=args.target_name)
prompts = _prompts(args.specs)
random.Random(0).shuffle(prompts)
if args.max_prompts:
    prompts = prompts[: args.max_prompts]
log(f"device {accelerator.device}, {len(prompts)} prompts, torch {torch.__version__}")
data_deadline = T0 + args.data_fraction * args.budget
examples, used = [], 0
for start in range(0, len(prompts), args.chunk):
    chunk = prompts[start : start + args.chunk]
    t = time.time()
    examples += build_examples(target, tokenizer, config.target_layer_ids, prompts=chunk,
                               max_new_tokens=args.max_new_tokens, batch_size=args.generate_batch_size,
                               progress=False, samples_per_prompt=args.samples_per_prompt, temperature=0.7,
                               generate_dtype=torch.bfloat16, batch_tokens=16384)
    used += len(chunk)
    log(f"data: {used} prompts, {len(examples)} sequences (chunk {time.time() - t:.1f} s)")
    if time.time() + (time.time() - t) > data_deadline:
        break
if torch.cuda.is_available():
    torch.cuda.empty_cache()
train_examples, eval_examples = split_held_out(examples, args.eval_fraction)
log(f"{len(train_examples)} train / {len(eval_examples)} held-out sequences, "
    f"{sum(len(e) for e in train_examples)} train tokens")

drafter = LaSpecDrafterModel(config).to(accelerator.device).attach_target(target)
draft_vocab = set_frequent_vocabulary(drafter, train_examples, 16384)  # trained over: ~2x faster steps
train_seconds = args.budget - (time.time() - T0) - args.reserve
train_config = TrainConfig(steps=args.steps, learning_rate=args.lr, batch_sequences=args.batch_sequences,
                           anchors=args.anchors, loss="acceptance", checkpoint_every=0, eval_every=args.eval_every,
                           max_seconds=max(train_seconds, 5.0))
t = time.time()
result = train_drafter(drafter, train_examples, eval_examples, train_config, out_dir=None,
                       accelerator=accelerator, progress=False, log=log)
train_seconds = time.time() - t
drafter = accelerator.unwrap_model(drafter).eval()
device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
description = (
    f"the target's greedy answers (plus {args.samples_per_prompt - 1} sampled at T=0.7) ({args.max_new_tokens} "
    f"tokens max) to {used} prompts of {' '.join(args.specs)} (hf_adaptive_spec order, shuffled with seed 0; "
    f"the standard-library sources from Python {sys.version.split()[0]}), teacher-forced; blocks anchored in "
    f"the answers; made and trained on one {device_name}")
out = Path(args.out)
save_drafter_folder(drafter, out, train_examples, eval_examples, result, target=args.target_name,
                    data_description=description, train_seconds=train_seconds, device=str(accelerator.device),
                    draft_vocab=draft_vocab)
if result["evals"]:
    log(f"held-out tau_chain {result['evals'][-1]['tau_chain']:.3f} after {result['config']['steps_run']} steps")
if args.copy_to:
    dest = Path(args.copy_to) / "drafter"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "README.md", "training_log.json"):
        shutil.copy(out / name, dest / name)
log("done")
