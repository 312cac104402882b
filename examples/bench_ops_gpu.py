"""Benchmark the Triton kernels of `hf_adaptive_spec.ops` against their torch references on one GPU.

One command, a few minutes on an H100/H200 with the default (realistic) sizes:

    python examples/bench_ops_gpu.py --out bench_ops_gpu.json

Per op and size it checks the kernel against the reference (bitwise for
integer/bool/mask outputs, max abs error for floats), then times both with CUDA
events (warmup, then the median of `--iters` runs), prints a table and writes
everything to `--out` as JSON. Sizes are flags; the default compaction case
(80 layers x K,V x batch 32 x 8 KV heads x 2112 slots x 128 dims, bf16) takes
~22 GiB, and cases over `--max-kv-gib` are skipped.

With HF_ADAPTIVE_SPEC_EXAMPLES=tiny the sizes default to tiny ones (seconds); on a machine without a CUDA GPU
the kernels then run on CPU tensors in the Triton interpreter (`--smoke-cpu`: the check is real, the times
mean nothing). CI runs it so:

    HF_ADAPTIVE_SPEC_EXAMPLES=tiny python examples/bench_ops_gpu.py --out /tmp/bench_ops_tiny.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

#: The sizes of tiny mode: every op and code path, a few milliseconds each in the Triton interpreter.
TINY_SIZES = dict(batches=[1], nodes=8, cache_len=16, layers=[2], kv_heads=2, head_dim=16, accepted=4, vocab=128,
                  top_k=4, visual_tokens=[16], query_heads=4, visual_kv_heads=2, vote_layers=2, warmup=1, iters=2)


def parse_args(argv=None):
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_ops_gpu.json", help="JSON results path")
    parser.add_argument("--ops", default="all",
                        help="comma list of: ancestor_matrix,tree_attention_mask,greedy_accept,compact_kv_,"
                             "sage_confidence,quantize_int8,visual_scores,visual_vote")
    parser.add_argument("--batches", type=ints, default=[1, 8, 32])
    parser.add_argument("--nodes", type=int, default=64, help="tree nodes per row")
    parser.add_argument("--cache-len", type=int, default=2048, help="committed KV slots in front of the tree")
    parser.add_argument("--layers", type=ints, default=[28, 80], help="decoder layers for compaction")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--accepted", type=int, default=8, help="slots kept by compaction (accepted path + root)")
    parser.add_argument("--max-kv-gib", type=float, default=40.0, help="skip compaction cases whose cache exceeds this")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--visual-tokens", type=ints, default=[576, 1024, 4096])
    parser.add_argument("--query-heads", type=int, default=28, help="query heads for visual scoring")
    parser.add_argument("--visual-kv-heads", type=int, default=4, help="KV heads for visual scoring")
    parser.add_argument("--vote-layers", type=int, default=28)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="model dtype")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="check the script itself on CPU tensors in the Triton interpreter (pass tiny sizes; "
                             "the times mean nothing)")
    # hf_adaptive_spec.examples_support.tiny_mode, read here: importing hf_adaptive_spec imports triton, which must
    # come after TRITON_INTERPRET is set
    if os.environ.get("HF_ADAPTIVE_SPEC_EXAMPLES", "real") == "tiny":
        parser.set_defaults(**TINY_SIZES, smoke_cpu=not torch.cuda.is_available())
    return parser.parse_args(argv)


def cuda_time_ms(fn, warmup, iters):
    """Median GPU time of fn() in ms, one CUDA event pair per run (launch gaps included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cpu_time_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def compare(actual, expected):
    """(equal, max_abs_err): bitwise for non-float tensors, error for floats; recurses into tuples/lists."""
    if isinstance(expected, (tuple, list)):
        results = [compare(a, e) for a, e in zip(actual, expected, strict=True)]
        return all(r[0] for r in results), max(r[1] for r in results)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False, float("inf")
    if expected.is_floating_point():
        error = (actual.float() - expected.float()).abs().max().item() if expected.numel() else 0.0
        return error <= 1e-4, error
    return bool(torch.equal(actual, expected)), 0.0


def random_trees(batch, nodes, device, seed=0):
    """Realistic draft trees: each node hangs under one of the few most recent nodes (bushy, depth ~10-20)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, nodes), -1, dtype=torch.long)
    for i in range(1, nodes):
        parents[:, i] = torch.randint(max(0, i - 6), i, (batch,), generator=gen)
    valid = torch.ones(batch, nodes, dtype=torch.bool)
    valid[1::2, nodes - nodes // 8 :] = False  # every other row padded
    parents[~valid] = -1
    return parents.to(device), valid.to(device)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported below
        print("CPU tensors in the Triton interpreter (--smoke-cpu): the comparisons are real, the times mean nothing")
    elif not torch.cuda.is_available():
        sys.exit("bench_ops_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "the kernels' CPU check is `TRITON_INTERPRET=1 python -m pytest tests/test_ops_triton.py`.")
    try:
        import triton
        from hf_adaptive_spec.ops import reference
        from hf_adaptive_spec.ops import triton_kernels as kernels
    except ImportError as error:
        sys.exit(f"bench_ops_gpu.py needs triton: {error} (pip install 'hf_adaptive_spec[triton]')")

    device = torch.device("cpu" if args.smoke_cpu else "cuda")
    timer = cpu_time_ms if args.smoke_cpu else cuda_time_ms
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    wanted = None if args.ops == "all" else set(args.ops.split(","))
    rows = []
    began = time.time()

    def run(op, config, kernel_fn, reference_fn, check=None):
        if wanted is not None and op not in wanted:
            return
        if check is None:
            equal, error = compare(kernel_fn(), reference_fn()) if kernel_fn is not None else (None, None)
        else:
            equal, error = check()
        torch_ms = timer(reference_fn, args.warmup, args.iters)
        triton_ms = timer(kernel_fn, args.warmup, args.iters) if kernel_fn is not None else None
        row = {
            "op": op, "config": config, "torch_ms": round(torch_ms, 4),
            "triton_ms": None if triton_ms is None else round(triton_ms, 4),
            "speedup": None if triton_ms is None else round(torch_ms / triton_ms, 2),
            "equal": equal, "max_abs_err": error,
        }
        rows.append(row)
        speed = "torch only" if triton_ms is None else f"{triton_ms:9.4f} ms  x{row['speedup']:<6}"
        status = "" if equal is None else ("ok" if equal else f"MISMATCH (err {error})")
        print(f"{op:20s} {config:42s} torch {torch_ms:9.4f} ms  triton {speed}  {status}", flush=True)

    nodes, slots = args.nodes, args.cache_len
    for batch in args.batches:
        parents, valid = random_trees(batch, nodes, device, seed=batch)
        slot_valid = torch.ones(batch, slots, dtype=torch.bool, device=device)
        slot_valid[:, : batch % 7] = False  # left padding
        tree = f"B{batch} N{nodes}"
        run("ancestor_matrix", tree, lambda: kernels.ancestor_matrix(parents),
            lambda: reference.ancestor_matrix(parents))
        mask_out = torch.empty(batch, 1, nodes, slots + nodes, dtype=dtype, device=device)
        run("tree_attention_mask", f"{tree} S{slots} {args.dtype}",
            lambda: kernels.tree_attention_mask(parents, valid, slot_valid, dtype),
            lambda: reference.tree_attention_mask(parents, valid, slot_valid, dtype))
        run("tree_attention_mask", f"{tree} S{slots} {args.dtype} out=",
            lambda: kernels.tree_attention_mask(parents, valid, slot_valid, dtype, out=mask_out),
            lambda: reference.tree_attention_mask(parents, valid, slot_valid, dtype))
        gen = torch.Generator().manual_seed(batch)
        tokens = torch.randint(0, 3, (batch, nodes), generator=gen).to(device)
        choice = torch.randint(0, 3, (batch, nodes), generator=gen).to(device)
        max_depth = int(reference.ancestor_matrix(parents)[1].max())
        run("greedy_accept", tree, lambda: kernels.greedy_accept(tokens, parents, valid, choice, max_depth),
            lambda: reference.greedy_accept(tokens, parents, valid, choice, max_depth))

    kv_bytes = torch.empty((), dtype=dtype).element_size()
    length = slots + nodes
    for layers in args.layers:
        for batch in args.batches:
            if wanted is not None and "compact_kv_" not in wanted:
                continue
            gib = 2 * layers * batch * args.kv_heads * length * args.head_dim * kv_bytes / 2**30
            config = f"{layers}L x2 B{batch} H{args.kv_heads} {length}x{args.head_dim} K{args.accepted}"
            if gib > args.max_kv_gib:
                print(f"{'compact_kv_':20s} {config:42s} skipped: {gib:.1f} GiB > --max-kv-gib {args.max_kv_gib}")
                continue
            gen = torch.Generator().manual_seed(layers + batch)
            keep = torch.stack([torch.randperm(nodes, generator=gen)[: args.accepted].sort().values
                                for _ in range(batch)]).to(device)
            cache = [torch.randn(batch, args.kv_heads, length, args.head_dim, device=device, dtype=dtype)
                     for _ in range(2 * layers)]

            def check():  # on copies of 4 layers: same shapes, so the same kernel specialisation
                sample = [t.clone() for t in cache[:4]]
                expected = [t.clone() for t in cache[:4]]
                result = compare(kernels.compact_kv_(sample, keep, slots), reference.compact_kv_(expected, keep, slots))
                return result[0] and all(torch.equal(a, b) for a, b in zip(sample, expected)), result[1]

            # repeated in-place compaction of the same cache: the same work every run
            run("compact_kv_", f"{config} ({gib:.1f} GiB)", lambda: kernels.compact_kv_(cache, keep, slots),
                lambda: reference.compact_kv_(cache, keep, slots), check=check)
            cache.clear()  # free this case's cache before the next one
            if device.type == "cuda":
                torch.cuda.empty_cache()

    for batch in args.batches:
        logits = torch.randn(batch, args.vocab, device=device) * 4
        for name, values in (("fp32", logits), (args.dtype, logits.to(dtype))):
            run("sage_confidence", f"B{batch} V{args.vocab} k{args.top_k} {name}",
                lambda: kernels.sage_confidence(values, args.top_k),
                lambda: reference.sage_confidence(values, args.top_k))

    for batch in args.batches:
        for tokens_n in args.visual_tokens:
            keys = torch.randn(batch, args.visual_kv_heads, tokens_n, args.head_dim, device=device, dtype=dtype)
            query = torch.randn(batch, args.query_heads, args.head_dim, device=device, dtype=dtype)
            config = f"B{batch} T{tokens_n} H{args.query_heads}/{args.visual_kv_heads} D{args.head_dim}"
            run("quantize_int8", config, lambda: kernels.quantize_int8(keys), lambda: reference.quantize_int8(keys))
            quantized, scale = reference.quantize_int8(keys)
            run("visual_scores", config, lambda: kernels.visual_scores(query, quantized, scale),
                lambda: reference.visual_scores(query, quantized, scale))
            scores = torch.rand(args.vote_layers, batch, tokens_n, device=device)
            keep_n = max(1, tokens_n // 4)
            run("visual_vote", f"{config} L{args.vote_layers} keep{keep_n}", None,
                lambda: reference.visual_vote(scores, keep_n, keep_n))

    elapsed = time.time() - began
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "args": vars(args),
        "seconds": round(elapsed, 1),
        "all_equal": all(row["equal"] is not False for row in rows),
        "results": rows,
    }
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(f"\n{len(rows)} cases in {elapsed:.0f} s on {report['device']}; all equal: {report['all_equal']}; "
          f"wrote {args.out}")
    geo = [row["speedup"] for row in rows if row["speedup"]]
    if geo:
        print(f"geometric-mean speedup over torch: x{math.exp(sum(math.log(s) for s in geo) / len(geo)):.2f}")
    return 0 if report["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
