"""The knobs of the three strategies: ChainConfig, StaticTreeConfig, SageConfig, and spec_config as a dict.

Every config field left at None takes a per-device default when generate resolves it (CPU values are
smaller: on a CPU a verification forward over many tokens is not free). Whatever the settings, greedy
output equals plain greedy output; the settings only change speed.

The models are the Qwen2.5-Coder 1.5B/0.5B pair from the offline registry (`hf_adaptive_spec.registry.models`);
with HF_ADAPTIVE_SPEC_EXAMPLES=tiny, tiny random-weight stand-ins (seconds anywhere, nothing downloaded: CI).

    python examples/custom_strategy_settings.py [--max-new-tokens 48]
    HF_ADAPTIVE_SPEC_EXAMPLES=tiny python examples/custom_strategy_settings.py
"""

import argparse
import dataclasses
import time

import torch

import hf_adaptive_spec  # noqa: F401  (adds spec_strategy / spec_config to generate)
from hf_adaptive_spec import ChainConfig, SageConfig, StaticTreeConfig
from hf_adaptive_spec.examples_support import tiny_mode, tiny_pair
from hf_adaptive_spec.strategies import default_tree_paths


def load_pair():
    """(target, drafter, inputs): the Qwen2.5-Coder pair and a chat prompt (tiny stand-ins in tiny mode)."""
    if tiny_mode():
        target, drafter, tokenizer = tiny_pair()
    else:
        from hf_adaptive_spec.registry.models import load

        target, tokenizer = load("qwen2.5-coder-1.5b-instruct")
        drafter, _ = load("qwen2.5-coder-0.5b-instruct")
    messages = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    return target, drafter, dict(inputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    # 1. Defaults differ per device: None fields are filled in by `resolve`.
    for device in ("cpu", "cuda"):
        resolved = SageConfig().resolve(torch.device(device))
        print(f"SageConfig() on {device}: d {resolved.d_min}-{resolved.d_max}, "
              f"width {resolved.w_min}-{resolved.w_max}, n_max {resolved.n_max}")
    print("ChainConfig() on cpu:", ChainConfig().resolve(torch.device("cpu")))
    print("StaticTreeConfig() on cpu, paths:", StaticTreeConfig().resolve(torch.device("cpu")).paths)

    # 2. Invalid settings fail early, naming the field.
    try:
        SageConfig(d_min=5, d_max=3).resolve(torch.device("cpu"))
    except ValueError as exc:
        print("rejected:", exc)

    target, drafter, inputs = load_pair()
    generate_kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    start = time.perf_counter()
    plain = target.generate(**inputs, **generate_kwargs)
    plain_seconds = time.perf_counter() - start

    settings = [
        # a chain of 3 drafts that grows by 2 after a fully accepted round, shrinks by 1 otherwise, within 1..6
        ("chain", ChainConfig(num_draft_tokens=3, min_draft_tokens=1, max_draft_tokens=6, adaptive=True)),
        # a fixed chain of exactly 4 drafts
        ("chain", ChainConfig(num_draft_tokens=4, max_draft_tokens=4, adaptive=False)),
        # a hand-written tree: top-1 and top-2 at the root, then the top-1 path continues 3 more levels
        ("static_tree", StaticTreeConfig(paths=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)])),
        # the 10 most likely paths up to depth 4 under a prior acceptance per candidate rank
        ("static_tree", StaticTreeConfig(paths=default_tree_paths(10, 4))),
        # SAGE: depth 2..5 and width 1..2 by the drafter's confidence, at most 10 nodes, alpha from this round
        ("sage", SageConfig(d_min=2, d_max=5, w_min=1.0, w_max=2.0, n_max=10, alpha_source="current_root")),
        # spec_config may be a plain dict of the strategy's config fields (handy from JSON or a CLI)
        ("sage", {"n_max": 12, "theta_scale": 0.05, "adaptive_history": False}),
    ]
    print(f"\nplain greedy: {args.max_new_tokens / plain_seconds:.1f} tokens/s")
    for strategy, config in settings:
        start = time.perf_counter()
        out = target.generate(**inputs, **generate_kwargs, assistant_model=drafter, spec_strategy=strategy,
                              spec_config=config, return_dict_in_generate=True)
        seconds = time.perf_counter() - start
        stats = out.spec_stats
        shown = config if isinstance(config, dict) else {
            f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != f.default}
        print(f"{strategy:11s} {shown}\n    identical to plain: {torch.equal(out.sequences, plain)}, "
              f"tau {stats.mean_accepted_length:.2f}, accepted {stats.accepted_tokens}/{stats.drafted_tokens} "
              f"drafted, {stats.rounds} rounds, {stats.new_tokens / seconds:.1f} tokens/s")
        assert torch.equal(out.sequences, plain), "speculative output differs from plain greedy"


if __name__ == "__main__":
    main()
