"""`hf-adaptive-spec bench --cold`: what the first speculative calls of a fresh process cost.

Each strategy runs in its own fresh process with an empty cost-curve folder and (unless `--cold-keep-kernel`)
an empty CPU-kernel folder, so nothing one-off is cached. In that process, on the first prompt of the bench's
datasets: plain, speculative x3, plain again, then `prepare` (kernel compiled, curve measured), a warm-up and
a last, warmed speculative call. Reported per strategy: the seconds of each call, the first speculative call
against the process's first plain call (both pay torch's first-use costs) and against the second (warm) one,
the third against the warmed one, and what each call spent on setup.
Every speculative output is checked against plain greedy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["run_cold"]


def _worker(options: dict) -> dict:
    """Runs in the fresh process: loads the models, times the calls, returns the record."""
    import argparse

    import torch

    from . import run as bench
    from ..decoding.prepare import prepare
    from .batch_runs import pad_id

    args = argparse.Namespace(**options["args"])
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = bench.load_on_device(args.target, args, "target")
    drafter = bench.load_drafter_option(args.drafter, target, args, args.drafter_int8, bench.load_on_device)
    prompt = options["prompt"]
    inputs = bench.encode_prompt(tokenizer, prompt["messages"], target.device)
    strategy, config = options["strategy"], options["spec_config"]
    common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=pad_id(tokenizer))

    def plain():
        start = time.perf_counter()
        out = target.generate(**inputs, **common)
        return out, time.perf_counter() - start

    def speculative():
        start = time.perf_counter()
        out = target.generate(**inputs, **common, assistant_model=drafter, spec_strategy=strategy, spec_config=config,
                              return_dict_in_generate=True)
        return out, time.perf_counter() - start

    record = {"strategy": strategy, "prompt": prompt["id"], "calls": []}
    reference, seconds = plain()
    record["calls"].append({"call": "plain 1", "seconds": seconds})
    same = True
    for index in range(3):
        out, seconds = speculative()
        same &= bool(torch.equal(out.sequences, reference))
        record["calls"].append({"call": f"{strategy} {index + 1}", "seconds": seconds,
                                "time_setup": out.spec_stats.time_setup, "tau": out.spec_stats.mean_accepted_length})
    _, seconds = plain()
    record["calls"].append({"call": "plain 2", "seconds": seconds})
    prepared = prepare(target, drafter, strategy, spec_config=config)
    speculative()  # warm-up after prepare
    out, seconds = speculative()
    same &= bool(torch.equal(out.sequences, reference))
    record["calls"].append({"call": f"{strategy} warmed", "seconds": seconds, "time_setup": out.spec_stats.time_setup,
                            "tau": out.spec_stats.mean_accepted_length})
    record["prepare_seconds"] = prepared["seconds"]
    record["kernel"] = prepared["kernel"]
    record["same_as_plain"] = same
    times = {call["call"]: call["seconds"] for call in record["calls"]}
    record["first_vs_plain"] = times["plain 2"] / times[f"{strategy} 1"]  # against a warm plain call
    record["first_vs_first_plain"] = times["plain 1"] / times[f"{strategy} 1"]  # both the process's first
    record["third_vs_warmed"] = times[f"{strategy} warmed"] / times[f"{strategy} 3"]
    return record


def run_cold(args, strategies, spec_configs: dict, prompt) -> dict:
    """One fresh process per strategy (see the module docstring); writes `cold.json` and `cold.md` to `args.out`.

    Args:
        args: the bench's parsed options (models, dtype, threads, max_new_tokens, out).
        strategies (list of `str`): the strategies to time.
        spec_configs (`dict`): strategy -> its `spec_config` dict (or None).
        prompt: the bench prompt to run (`data.Prompt`: `id`, `messages`).
    """
    import torch

    from .report import command_line, environment, now

    started = now()
    records = []
    for strategy in strategies:
        with tempfile.TemporaryDirectory(prefix="hf_adaptive_spec_cold_") as fresh:
            env = dict(os.environ, HF_ADAPTIVE_SPEC_COST_CACHE=str(Path(fresh) / "cost"))
            if not getattr(args, "cold_keep_kernel", False):
                env["HF_ADAPTIVE_SPEC_KERNEL_CACHE"] = str(Path(fresh) / "kernels")
            options = {"args": {key: value for key, value in vars(args).items() if _plain(value)},
                       "strategy": strategy, "spec_config": spec_configs.get(strategy),
                       "prompt": {"id": prompt.id, "messages": prompt.messages}}
            options_path = Path(fresh) / "options.json"
            result_path = Path(fresh) / "result.json"
            options_path.write_text(json.dumps(options))
            code = ("import json, sys; from hf_adaptive_spec.bench.cold import _worker; "
                    "json.dump(_worker(json.load(open(sys.argv[1]))), open(sys.argv[2], 'w'))")
            done = subprocess.run([sys.executable, "-c", code, str(options_path), str(result_path)], env=env)
            if done.returncode != 0:
                raise RuntimeError(f"the cold run of {strategy} failed (exit {done.returncode})")
            records.append(json.loads(result_path.read_text()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"command": command_line(), "environment": {**environment(torch.device("cpu"), started),
                                                          "finished": now()},
               "target": args.target, "drafter": args.drafter, "max_new_tokens": args.max_new_tokens,
               "threads": args.threads, "records": records}
    (out / "cold.json").write_text(json.dumps(results, indent=2))
    (out / "cold.md").write_text(cold_table(results))
    print(cold_table(results))
    results["exit_code"] = 0 if all(record["same_as_plain"] for record in records) else 1
    return results


def _plain(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))


def cold_table(results: dict) -> str:
    """Markdown: one row per strategy."""
    lines = ["| strategy | plain 1 s | 1st s | 2nd s | 3rd s | plain 2 s | warmed s | 1st vs plain 1 | 1st vs plain 2 "
             "| 3rd / warmed speed | setup in 1st call s | same as plain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for record in results["records"]:
        calls = {call["call"]: call for call in record["calls"]}
        strategy = record["strategy"]
        lines.append("| " + " | ".join([
            strategy, f"{calls['plain 1']['seconds']:.2f}",
            *(f"{calls[f'{strategy} {i}']['seconds']:.2f}" for i in (1, 2, 3)),
            f"{calls['plain 2']['seconds']:.2f}", f"{calls[f'{strategy} warmed']['seconds']:.2f}",
            f"{record.get('first_vs_first_plain', float('nan')):.2f}x", f"{record['first_vs_plain']:.2f}x",
            f"{record['third_vs_warmed']:.2f}",
            f"{calls[f'{strategy} 1']['time_setup']:.3f}", "yes" if record["same_as_plain"] else "NO"]) + " |")
    return "\n".join(lines) + "\n"
