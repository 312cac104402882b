"""Is the lean forward bitwise transformers' forward on this device, and how much faster? (developer tooling)

The package runs `hf_adaptive_spec.lean` on CPUs only, the one device it has been measured on. This script
needs no weights (a random SmolLM2-135M-shaped Llama), so it runs in one short call on a lent GPU:

    python tools/device/lean_check.py --device cuda --out $OUT/lean_check.json

For each dtype and tree size it prefills a 300-token cache, then runs transformers' forward and the lean
forward on the same tree (a chain with one branch) over copies of that cache, checks logits and every
cache slot for bitwise equality, and times both (median of `--repeats`, synchronized). On 2 CPU cores
(2026-12-01, Intel Xeon, fp32, without the package's CPU kernels, which the loop adds) it printed bitwise-equal results
and 0.88 (1 token, 33 vs 38 ms) and 0.91 (5 tokens, 52 vs 57 ms) of transformers' time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_adaptive_spec import lean as lean_module
from hf_adaptive_spec import ops
from hf_adaptive_spec.attention import tree_attention
from hf_adaptive_spec.lean import lean_forward


def smollm2_shaped(dtype, device):
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def check(model, size: int, repeats: int, context: int = 300) -> dict:
    device = model.device
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    cache = DynamicCache()
    model(input_ids=prompt, cache=cache, use_cache=True)
    parents = torch.tensor([[-1] + list(range(size - 1))], device=device)
    if size > 2:
        parents[0, -1] = 0  # one branch: a tree, not only a chain
    valid = torch.ones(1, size, dtype=torch.bool, device=device)
    mask, depths = ops.tree_attention_mask(parents, valid, torch.ones(1, context, dtype=torch.bool, device=device),
                                           model.dtype)
    tokens = torch.randint(0, model.config.vocab_size, (1, size), device=device)
    positions = context + depths
    lean = lean_forward(model)  # called directly below: `applies` (CPU only) is what the package checks
    if lean is None:
        return {"size": size, "skipped": lean_module._unsupported(model)}

    def hf(target_cache):
        return model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=target_cache,
                     use_cache=True, output_hidden_states=True).logits

    def fast(target_cache):
        return lean(tokens, mask, positions, target_cache, output_hidden_states=True).logits

    with tree_attention(model):
        first, second = copy.deepcopy(cache), copy.deepcopy(cache)
        expected, got = hf(first), fast(second)
        equal = bool(torch.equal(expected, got)) and all(
            torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(first.layers, second.layers))
        times = {"transformers": [], "lean": []}
        for _ in range(repeats + 3):
            for name, run in (("transformers", hf), ("lean", fast)):
                sync(device)
                start = time.perf_counter()
                run(cache)
                sync(device)
                times[name].append(time.perf_counter() - start)
                cache.crop(-size)
    medians = {name: statistics.median(values[3:]) for name, values in times.items()}
    return {"size": size, "bitwise_equal": equal, "max_abs_diff": float((expected - got).abs().max()),
            "ms_transformers": 1e3 * medians["transformers"], "ms_lean": 1e3 * medians["lean"],
            "ratio": medians["lean"] / medians["transformers"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 5, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for dtype in args.dtypes:
        model = smollm2_shaped(getattr(torch, dtype), device)
        for size in args.sizes:
            row = {"device": str(device), "dtype": dtype, **check(model, size, args.repeats)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
