"""SAGE tree speculative decoding with a real pair: Qwen2.5-Coder-1.5B-Instruct verified, 0.5B drafting.

Streams the speculative answer with `TextStreamer`, then runs plain greedy `generate` on the same prompt,
checks both outputs are identical and prints tau (tokens per target forward) and the speed-up. The models
come from the offline registry (`hf_adaptive_spec.registry.models`: converted once from GGUF wheels on PyPI, then
loaded from the cache in seconds). A single run is a demo, not a measurement: for numbers use
`python -m hf_adaptive_spec.bench` (warm-up, interleaving, many prompts).

    python examples/text_pair.py --max-new-tokens 128
    HF_ADAPTIVE_SPEC_EXAMPLES=tiny python examples/text_pair.py   # tiny random-weight models (CI), no download
"""

import argparse
import time

import torch
from transformers import TextStreamer

import hf_adaptive_spec  # noqa: F401  (adds spec_strategy / spec_config to generate)
from hf_adaptive_spec import SageConfig
from hf_adaptive_spec.examples_support import tiny_mode, tiny_pair

PROMPT = "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number iteratively."


def load_pair():
    """(target, drafter, tokenizer): the Qwen2.5-Coder pair, or tiny random stand-ins in tiny mode."""
    if tiny_mode():
        return tiny_pair()
    from hf_adaptive_spec.registry.models import load

    target, tokenizer = load("qwen2.5-coder-1.5b-instruct")
    drafter, _ = load("qwen2.5-coder-0.5b-instruct")
    return target, drafter, tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target, drafter, tokenizer = load_pair()
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    greedy = dict(do_sample=False, max_new_tokens=args.max_new_tokens)

    print("--- sage (streamed) ---")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    out = target.generate(**inputs, **greedy, assistant_model=drafter, spec_strategy="sage",
                          spec_config=SageConfig(), streamer=streamer, return_dict_in_generate=True)
    spec_seconds = time.perf_counter() - start

    start = time.perf_counter()
    plain = target.generate(**inputs, **greedy)
    plain_seconds = time.perf_counter() - start

    stats = out.spec_stats
    new_tokens = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    same = torch.equal(out.sequences, plain)
    print("--- stats ---")
    print(f"identical to plain greedy: {same}")
    print(f"tau (tokens per target forward): {stats.mean_accepted_length:.2f} over {stats.rounds} rounds; "
          f"acceptance rate {stats.acceptance_rate:.2f}")
    print(f"sage {new_tokens / spec_seconds:.2f} tokens/s vs plain {new_tokens / plain_seconds:.2f} tokens/s: "
          f"{plain_seconds / spec_seconds:.2f}x")
    print("time split:", {k: f"{v:.2f}s" for k, v in stats.to_dict().items() if k.startswith("time_")})
    if not same:
        raise SystemExit("speculative output differs from plain greedy")


if __name__ == "__main__":
    main()
