"""What the package has to prove on a GPU, in one run from a clone (no weights, no network).

    pip install -e ".[test]"            # with the torch of your CUDA
    python tools/gpu_check.py --out gpu_check.json

1. Exactness: tiny random models of several families (full attention, sliding windows, a VLM), fp32 and bf16,
   batch 1 and 2: every strategy (and the drafter-less `plain` mode) against plain greedy `generate`. In fp32
   any difference is a failure; in bf16 a difference is reported with plain's top-2 logit gap at the first
   differing step (a numerical tie of bf16 rounding, or not).
2. Triton kernels against their torch references (`tests/test_ops_triton.py`, compiled, not interpreted).
3. The lean forward against transformers' forward on a SmolLM2-shaped random Llama (bitwise, and both times),
   the check that decides whether `LeanForward.applies` may admit CUDA tensors.
4. Timings of one 64-token greedy call per method on a 4-layer tiny model (sanity only: tiny models say
   nothing about speed).

Exit status 1 when an fp32 output differs or the kernel tests fail. `--device cpu` runs the same checks on
a CPU (minutes), which is how the script itself is tested.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny model factories of the test suite

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import hf_adaptive_spec  # noqa: E402,F401
from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel, ops  # noqa: E402
from hf_adaptive_spec.adapters import lean as lean_module  # noqa: E402
from hf_adaptive_spec.adapters.attention import tree_attention  # noqa: E402

STRATEGIES = ("chain", "static_tree", "sage", "laspec", "plain")
FAMILIES = ("llama", "qwen2_vl", "gemma2", "mistral")


def _family(name: str, device, dtype):
    import tiny_families
    import tiny_models

    if name in tiny_families.FAMILIES:
        target = tiny_families.build(name)
        drafter = tiny_families.drafter(name, target, "small")
        inputs = {1: tiny_families.make_inputs(name, 1), 2: tiny_families.make_inputs(name, 2)}
    else:
        target = tiny_models.build_model(name)
        drafter = tiny_models.build_drafter(name, target, "small")
        inputs = {1: tiny_models.make_inputs(name, 1), 2: tiny_models.make_inputs(name, 2)}
    torch.manual_seed(0)
    laspec = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    moved = [m.to(device=device, dtype=dtype) for m in (target, drafter, laspec)]
    inputs = {b: {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
                  for k, v in x.items()} for b, x in inputs.items()}
    return (*moved, inputs)


def _first_gap(plain, sequences, prompt_length) -> float | None:
    differ = (plain.sequences != sequences).any(0).nonzero()
    if differ.numel() == 0:
        return None
    step = int(differ[0]) - prompt_length
    top = plain.logits[step].float().topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def exactness(device, dtypes) -> list:
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for family in FAMILIES:
            target, drafter, laspec, inputs = _family(family, device, dtype)
            for batch, batch_inputs in inputs.items():
                settings = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_logits=True)
                plain = target.generate(**batch_inputs, **settings)
                for strategy in STRATEGIES:
                    draft = {} if strategy == "plain" else {"assistant_model": laspec if strategy == "laspec" else drafter}
                    try:
                        out = target.generate(**batch_inputs, **settings, **draft, spec_strategy=strategy)
                        equal = bool(torch.equal(out.sequences, plain.sequences))
                        gap = None if equal else _first_gap(plain, out.sequences, batch_inputs["input_ids"].shape[1])
                        row = {"dtype": dtype_name, "family": family, "batch": batch, "strategy": strategy,
                               "equal": equal, "plain_top2_gap_at_first_difference": gap}
                    except Exception as error:  # reported, not raised: the other checks still run
                        row = {"dtype": dtype_name, "family": family, "batch": batch, "strategy": strategy,
                               "equal": False, "error": f"{type(error).__name__}: {error}"}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def triton_kernels(device) -> dict:
    if device.type != "cuda":
        return {"skipped": "not a CUDA device (the suite runs them interpreted on CPUs)"}
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_ops_triton.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    tail = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-500:]]
    return {"returncode": done.returncode, "summary": tail[0]}


def _smollm2_shaped(dtype, device):
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def lean_check(device, dtypes, sizes=(1, 5, 16), repeats: int = 20, context: int = 300) -> list:
    rows = []
    for dtype_name in dtypes:
        model = _smollm2_shaped(getattr(torch, dtype_name), device)
        lean = lean_module.lean_forward(model)  # called directly: `applies` (CPU only) is what the package checks
        for size in sizes:
            if lean is None:
                rows.append({"dtype": dtype_name, "size": size, "skipped": lean_module._unsupported(model)})
                continue
            prompt = torch.randint(0, model.config.vocab_size, (1, context), device=device)
            cache = DynamicCache()
            model(input_ids=prompt, cache=cache, use_cache=True)
            parents = torch.tensor([[-1] + list(range(size - 1))], device=device)
            if size > 2:
                parents[0, -1] = 0  # one branch: a tree, not only a chain
            valid = torch.ones(1, size, dtype=torch.bool, device=device)
            mask, depths = ops.tree_attention_mask(parents, valid, torch.ones(1, context, dtype=torch.bool,
                                                                              device=device), model.dtype)
            tokens = torch.randint(0, model.config.vocab_size, (1, size), device=device)
            positions = context + depths

            def stock(target_cache):
                return model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=target_cache,
                             use_cache=True).logits

            def fast(target_cache):
                return lean(tokens, mask, positions, target_cache).logits

            with tree_attention(model):
                first, second = copy.deepcopy(cache), copy.deepcopy(cache)
                expected, got = stock(first), fast(second)
                equal = bool(torch.equal(expected, got)) and all(
                    torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                    for a, b in zip(first.layers, second.layers))
                times = {"transformers": [], "lean": []}
                for _ in range(repeats + 3):
                    for name, run in (("transformers", stock), ("lean", fast)):
                        _sync(device)
                        start = time.perf_counter()
                        run(cache)
                        _sync(device)
                        times[name].append(time.perf_counter() - start)
                        cache.crop(-size)
            medians = {name: statistics.median(values[3:]) for name, values in times.items()}
            row = {"dtype": dtype_name, "size": size, "bitwise_equal": equal,
                   "max_abs_diff": float((expected - got).abs().max()),
                   "ms_transformers": 1e3 * medians["transformers"], "ms_lean": 1e3 * medians["lean"]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def timings(device) -> dict:
    import tiny_models

    target = tiny_models.build_model("llama", num_layers=4).to(device)
    drafter = tiny_models.build_drafter("llama", target, "copy").to(device)
    inputs = {k: v.to(device) for k, v in tiny_models.make_inputs("llama", 1).items()}
    seconds = {}
    for method in ("generate",) + STRATEGIES[:3] + ("plain",):
        draft = {} if method in ("generate", "plain") else {"assistant_model": drafter}
        strategy = {} if method == "generate" else {"spec_strategy": method}
        runs = []
        for _ in range(3):
            _sync(device)
            start = time.perf_counter()
            target.generate(**inputs, max_new_tokens=64, do_sample=False, **draft, **strategy)
            _sync(device)
            runs.append(time.perf_counter() - start)
        seconds[method] = min(runs)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--skip", nargs="*", default=[], choices=["exactness", "triton", "lean", "timings"])
    parser.add_argument("--out", default=None, help="write every result as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    report = {"device": str(device), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    if "exactness" not in args.skip:
        report["exactness"] = exactness(device, args.dtypes)
    if "triton" not in args.skip:
        report["triton"] = triton_kernels(device)
        print(json.dumps({"triton": report["triton"]}), flush=True)
    if "lean" not in args.skip:
        report["lean"] = lean_check(device, args.dtypes)
    if "timings" not in args.skip:
        report["timings_s"] = timings(device)
        print(json.dumps({"timings_s": report["timings_s"]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    failed = [r for r in report.get("exactness", []) if r["dtype"] == "float32" and not r["equal"]]
    failed += [report["triton"]] if report.get("triton", {}).get("returncode") not in (None, 0) else []
    print(f"{'FAILED' if failed else 'passed'}: {len(failed)} fp32 difference(s) or kernel failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
