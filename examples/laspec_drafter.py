"""A LaSpec block drafter: use the shipped one for SmolLM2-135M-Instruct, or train your own in a few steps.

    python examples/laspec_drafter.py                      # shipped drafter, laspec vs plain greedy
    python examples/laspec_drafter.py --train-steps 30     # also train a (tiny-budget) drafter and save it

The shipped drafter ships inside the package (`hf_adaptive_spec.list_drafters()`), so this runs offline
once the target is in the model cache (`hf-adaptive-spec fetch smollm2-135m-instruct`, 93 MB). The output
of `spec_strategy="laspec"` is identical to plain greedy decoding; how much faster it is depends on the
drafter (see docs/benchmarks.md for the measured figures of the shipped one).

With HF_ADAPTIVE_SPEC_EXAMPLES=tiny it runs on tiny random-weight stand-ins instead (a random target and an
untrained LaSpec drafter sized for it: seconds, nothing downloaded; CI runs it so).
"""

import argparse
import tempfile
import time

import torch

import hf_adaptive_spec
from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel, load_drafter
from hf_adaptive_spec.examples_support import tiny_laspec_drafter, tiny_mode, tiny_pair

PROMPT = "Write a Python function `is_palindrome(s)` that ignores case and punctuation."


def run(target, tokenizer, drafter, prompt, max_new_tokens):
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    start = time.perf_counter()
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    plain_seconds = time.perf_counter() - start
    start = time.perf_counter()
    out = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter,
                          spec_strategy="laspec", return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    stats = out.spec_stats
    print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    print(f"same as plain greedy: {torch.equal(plain, out.sequences)}; tau {stats.mean_accepted_length:.2f}; "
          f"{plain_seconds / seconds:.2f}x vs plain ({stats.pruned_tokens} candidate nodes trimmed by the cost rule)")


def load_target_and_drafter():
    """(target, tokenizer, drafter): SmolLM2-135M-Instruct and its shipped drafter, or tiny stand-ins."""
    if tiny_mode():
        target, _, tokenizer = tiny_pair()
        return target, tokenizer, tiny_laspec_drafter(target)
    from hf_adaptive_spec.registry.models import load

    target, tokenizer = load("smollm2-135m-instruct")
    print("shipped drafters:", hf_adaptive_spec.list_drafters())
    return target, tokenizer, load_drafter("laspec-smollm2-135m-instruct", target)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=0, help="also train a drafter for this many steps")
    args = parser.parse_args()

    target, tokenizer, drafter = load_target_and_drafter()
    run(target, tokenizer, drafter, args.prompt, args.max_new_tokens)

    if args.train_steps:
        from hf_adaptive_spec.training import TrainConfig, build_examples, train_drafter

        prompts = [[{"role": "user", "content": text}] for text in (
            "Explain what a hash map is.", "Write a haiku about rain.", "Sort a list in Python.",
            "What causes tides?")]
        config = LaSpecDrafterConfig.for_target(target, block_size=4)
        examples = build_examples(target, tokenizer, config.target_layer_ids, prompts=prompts, max_new_tokens=48)
        drafter = LaSpecDrafterModel(config).attach_target(target)
        train_drafter(drafter, examples[1:], examples[:1], TrainConfig(steps=args.train_steps, eval_every=0))
        folder = tempfile.mkdtemp(prefix="laspec-")
        drafter.save_pretrained(folder)  # an ordinary HF folder: AutoModel.from_pretrained / push_to_hub
        run(target, tokenizer, load_drafter(folder, target), args.prompt, args.max_new_tokens)


if __name__ == "__main__":
    main()
