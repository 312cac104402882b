"""`hf-adaptive-spec bench --memory`: peak memory of plain `generate` and of each strategy on long prompts.

Each (method, prompt length) runs in a fresh process: the target and the drafter are loaded (both, for every
method, so that every baseline holds the same weights), one short call of the method pages the weights in and
makes its one-off allocations, the peak is reset, one `generate` call runs, and the
peak growth over the memory held before the call is reported: on a CPU the resident set (`VmHWM - VmRSS` from
`/proc/self/status`, the peak reset through `/proc/self/clear_refs`), on a GPU `torch.cuda.max_memory_allocated`
over `memory_allocated`. A speculative call's growth holds the target's cache and activations and the drafter's
own cache and activations; plain's the target's. The prompt is real text (HumanEval and MT-Bench prompts,
tokenized and repeated up to the length), greedy, and every speculative output is checked against plain's.
The workers run with `MALLOC_MMAP_THRESHOLD_=65536`: glibc then maps every tensor of 64 KiB or more on its own
and returns it on free, so the resident peak is the peak of live tensors, not of what malloc kept cached
(without it, the same plain call measured 139 and 185 MiB in two processes).

Each speculative record also has the peak within each phase of the call (`PHASES`: prefill, start_rounds with
the cost curve and planner, the first round, the other rounds), so an excess shows where it is made, and every
record the peak after the prefill (`decode_peak_growth_bytes`: plain's decoding steps, a speculative call's
rounds), which a long prompt's prefill does not hide. `--memory-cold` skips the short call: the measured call
is then the first of its process (nothing of this library cached in memory yet, its one-off allocations inside
the call), for plain as for every strategy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["add_arguments", "run_memory", "UNTRAINED_LASPEC"]

# a drafter name for memory runs of targets without a trained drafter: a fresh (random) 1-layer LaSpec drafter
UNTRAINED_LASPEC = "untrained-laspec"
DEFAULT_PROMPTS = (2048, 8192, 16384)


def add_arguments(parser) -> None:
    group = parser.add_argument_group(
        "memory (hf_adaptive_spec.bench.memory: peak memory per method, one process each)")
    group.add_argument("--memory", action="store_true",
                       help="report the peak memory of plain generate and of each strategy on long prompts instead "
                       "of timing them (--drafter untrained-laspec: a fresh LaSpec drafter for any target)")
    group.add_argument("--memory-prompts", nargs="+", type=int, default=list(DEFAULT_PROMPTS), metavar="TOKENS",
                       help=f"prompt lengths in tokens (default {' '.join(map(str, DEFAULT_PROMPTS))})")
    group.add_argument("--memory-cold", action="store_true",
                       help="measure the first call of each fresh process (no short call before it: the cost curve "
                       "not yet in memory, one-off allocations inside the measured call)")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _long_prompt(tokenizer, length: int):
    """`(1, length)` token ids of real prompt text, repeated up to `length`."""
    import torch

    from ..registry.data import load_prompts

    text = "\n\n".join(message["content"] for dataset in ("humaneval", "mtbench")
                       for prompt in load_prompts(dataset, limit=40) for message in prompt.messages)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    repeats = -(-length // ids.shape[0])
    return torch.cat([ids] * repeats)[:length][None, :]


# the phases of a speculative call whose peaks are reported (`Decoding` methods, in the order they run)
PHASES = ("prefill", "start_rounds", "first_round", "rounds")


class _Segments:
    """The peak of each part of one call in this process, the peak counter reset between parts: a speculative
    call's `PHASES` (prefill: the target's and the drafter's; start_rounds: strategy, cost curve, planner; the
    first round; the other rounds), plain's prefill (its target's first forward) and decoding; the part before
    and after them is "rest". `peaks[name]` is the highest reading of `read()` within a part of that name."""

    def __init__(self, target, read, reset):
        self.target, self.read, self.reset = target, read, reset
        self.peaks, self.rounds, self.speculative = {}, 0, False

    def close_part(self, name: str) -> None:
        self.peaks[name] = max(self.peaks.get(name, 0), self.read())
        self.reset()

    def __enter__(self):
        from ..adapters.target_states import thread_confined
        from ..decoding import loop

        self.loop = loop
        self.saved = {name: getattr(loop.Decoding, name) for name in ("prefill", "start_rounds", "step")}
        self.close_part("rest")

        def marked(name, original):
            def method(run, *args, **kwargs):
                self.speculative = True
                self.close_part("rest")  # what ran since the last part (generate's own work between them)
                out = original(run, *args, **kwargs)
                if name == "step":
                    self.rounds += 1
                self.close_part("first_round" if name == "step" and self.rounds == 1 else
                                "rounds" if name == "step" else name)
                return out
            return method

        for name, original in self.saved.items():
            setattr(loop.Decoding, name, marked(name, original))

        def first_forward(module, args, output):  # plain generate: its prefill is the target's first forward
            self.hook.remove()  # before a speculative call's runners look for hooks (`adapters.lean`)
            if not self.speculative:
                self.close_part("plain_prefill")

        self.hook = self.target.register_forward_hook(thread_confined(first_forward))
        return self

    def __exit__(self, *exc):
        self.hook.remove()
        self.close_part("rest")
        for name, original in self.saved.items():
            setattr(self.loop.Decoding, name, original)


def _load(spec: dict):
    from .. import loading
    from ..chat_template import text_tokenizer

    target, processor = loading.load_model(spec["target"], spec["dtype"], progress=False)
    if spec["drafter"] == UNTRAINED_LASPEC:
        import torch

        from ..drafters.laspec import LaSpecDrafterConfig
        from ..drafters.laspec import LaSpecDrafterModel

        torch.manual_seed(0)
        drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, num_hidden_layers=1)).eval()
    else:
        drafter = loading.load_assistant(spec["drafter"], target, int8=False, dtype=spec["dtype"])
    device = spec["device"]
    return target.to(device), drafter.to(device), text_tokenizer(processor)


def _worker(spec: dict) -> dict:
    """One method at one prompt length, in this (fresh) process."""
    import torch

    import hf_adaptive_spec  # noqa: F401  (the generate hook)

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    target, drafter, tokenizer = _load(spec)
    device = torch.device(spec["device"])
    input_ids = _long_prompt(tokenizer, spec["prompt_tokens"]).to(device)
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                  max_new_tokens=spec["max_new_tokens"], pad_token_id=tokenizer.pad_token_id or 0)
    if spec["method"] != "plain":
        kwargs.update(assistant_model=drafter, spec_strategy=spec["method"])
    record = measure_call(target, kwargs, device, cold=bool(spec.get("cold")))
    out = record.pop("output")
    return {"method": spec["method"], "prompt_tokens": spec["prompt_tokens"], **record,
            "new_tokens": int(out.shape[1] - input_ids.shape[1]), "tokens": out[0, input_ids.shape[1]:].tolist()}


def measure_call(target, kwargs: dict, device, cold: bool = False) -> dict:
    """Peak growth of one `target.generate(**kwargs)` over what the process held before it (after a short call
    of the same kind unless `cold`): `peak_growth_bytes`, `phase_peak_growth_bytes` (speculative calls: the peak
    within each of `PHASES`), `decode_peak_growth_bytes` (the peak after the prefill: plain's decoding steps, a
    speculative call's rounds), `measure`, `cold` and the `output`."""
    import torch

    device = torch.device(device)
    input_ids = kwargs["input_ids"]
    if not cold:
        with torch.no_grad():  # one short call first: weights paged in, one-off allocations (kernels, pools) made
            target.generate(**{**kwargs, "input_ids": input_ids[:, :16],
                               "attention_mask": kwargs["attention_mask"][:, :16], "max_new_tokens": 4})
    if device.type == "cuda":
        def peak():
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device)

        def reset():
            torch.cuda.reset_peak_memory_stats(device)

        torch.cuda.synchronize(device)
        reset()
        before = torch.cuda.memory_allocated(device)
    else:
        def peak():
            return _status_kib("VmHWM") * 1024

        def reset():
            Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from here

        reset()
        before = _status_kib("VmRSS") * 1024
    with torch.no_grad():
        with _Segments(target, peak, reset) as parts:
            out = target.generate(**kwargs)
    peaks = {name: value - before for name, value in parts.peaks.items()}
    after_prefill = [peaks[name] for name in ("start_rounds", "first_round", "rounds") if name in peaks]
    if "plain_prefill" in peaks:  # plain generate: its decoding steps are all that ran after the prefill
        after_prefill = [peaks["rest"]]
    return {"peak_growth_bytes": max(peaks.values()), "cold": cold, "output": out,
            "phase_peak_growth_bytes": {name: peaks[name] for name in PHASES if name in peaks},
            "decode_peak_growth_bytes": max(after_prefill) if after_prefill else None,
            "measure": "cuda max_memory_allocated" if device.type == "cuda" else "peak RSS (VmHWM)"}


def _methods(args) -> list:
    from ..strategies import STRATEGIES

    laspec = args.drafter == UNTRAINED_LASPEC or _is_laspec(args.drafter)
    names = args.strategies or [name for name, cls in STRATEGIES.items()
                                if (laspec or not cls.requires_block_drafter) and not cls.drafts_nothing]
    names = [name for name in names if name != "plain"]  # plain generate runs first, always
    return ["plain"] + list(names)


def _is_laspec(name: str) -> bool:
    from ..loading import is_laspec

    return is_laspec(name)


def run_memory(args) -> dict:
    """Every method at every prompt length, one fresh process each; writes `memory.json` to `args.out` and
    prints a Markdown table (growth in MiB and its ratio over plain's at the same length)."""
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    from .report import command_line, environment, now

    started = now()
    records = []
    for length in args.memory_prompts:
        plain_tokens = None
        for method in _methods(args):
            spec = {"target": args.target, "drafter": args.drafter, "dtype": args.dtype, "device": device,
                    "method": method, "prompt_tokens": length, "max_new_tokens": args.max_new_tokens,
                    "threads": args.threads, "cold": bool(getattr(args, "memory_cold", False))}
            done = subprocess.run([sys.executable, "-m", "hf_adaptive_spec.bench.memory", json.dumps(spec)],
                                  capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
            if done.returncode != 0:
                record = {"method": method, "prompt_tokens": length, "error": done.stderr.strip()[-2000:]}
            else:
                record = json.loads(done.stdout.strip().splitlines()[-1])
                if method == "plain":
                    plain_tokens = record["tokens"]
                record["matches_plain"] = record["tokens"] == plain_tokens
            records.append(record)
            print(_row(record, records), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    result = {"command": command_line(), "environment": {**environment(torch.device(device), started),
                                                         "finished": now()},
              "target": args.target, "drafter": args.drafter, "device": device, "dtype": args.dtype,
              "max_new_tokens": args.max_new_tokens, "records": records}
    (out / "memory.json").write_text(json.dumps(result, indent=1))
    print("\n" + memory_table(records))
    print("\n" + phase_table(records))
    failed = any("error" in r or not r.get("matches_plain", True) for r in records)
    result["exit_code"] = 1 if failed else 0
    return result


def _plain_record(records: list, length: int) -> dict | None:
    for record in records:
        if record["method"] == "plain" and record["prompt_tokens"] == length and "error" not in record:
            return record
    return None


def _plain_growth(records: list, length: int):
    record = _plain_record(records, length)
    return record["peak_growth_bytes"] if record is not None else None


def _row(record: dict, records: list) -> str:
    if "error" in record:
        return f"{record['method']:>12} {record['prompt_tokens']:>6} tokens: failed: {record['error'][-300:]}"
    plain = _plain_growth(records, record["prompt_tokens"])
    ratio = f" ({record['peak_growth_bytes'] / plain:.2f}x plain)" if plain else ""
    phases = ", ".join(f"{name} {value / 2**20:.0f}"
                       for name, value in record.get("phase_peak_growth_bytes", {}).items())
    return (f"{record['method']:>12} {record['prompt_tokens']:>6} tokens: peak growth "
            f"{record['peak_growth_bytes'] / 2**20:.1f} MiB{ratio}, same output: {record['matches_plain']}"
            + (f" (peak after {phases} MiB)" if phases else ""))


def memory_table(records: list) -> str:
    """Markdown: one row per method, one column pair (MiB, ratio over plain) per prompt length."""
    lengths = sorted({r["prompt_tokens"] for r in records})
    methods = list(dict.fromkeys(r["method"] for r in records))
    head = "| method | " + " | ".join(f"{n} tokens: MiB | vs plain" for n in lengths) + " |"
    rule = "|---|" + "---:|---:|" * len(lengths)
    rows = [head, rule]
    for method in methods:
        cells = []
        for length in lengths:
            record = next((r for r in records if r["method"] == method and r["prompt_tokens"] == length), None)
            plain = _plain_growth(records, length)
            if record is None or "error" in record:
                cells += ["failed", ""]
                continue
            growth = record["peak_growth_bytes"]
            mark = "" if record.get("matches_plain", True) else " (output differs)"
            cells += [f"{growth / 2**20:.0f}{mark}", f"{growth / plain:.2f}x" if plain else ""]
        rows.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def phase_table(records: list) -> str:
    """Markdown: the peak growth (MiB) within each phase of each speculative call (`PHASES`), its whole call's and
    plain's beside it, and the peaks after the prefill (its rounds', plain's decoding steps')."""
    head = "| method | tokens | " + " | ".join(PHASES) + " | whole call | plain's call | after prefill | plain's |"
    rows = [head, "|---|---:|" + "---:|" * (len(PHASES) + 4)]
    for record in records:
        phases = record.get("phase_peak_growth_bytes")
        if "error" in record or not phases:
            continue
        plain = _plain_record(records, record["prompt_tokens"]) or {}

        def mib(value):
            return f"{value / 2**20:.0f}" if value is not None else ""

        cells = [mib(phases.get(name)) for name in PHASES]
        cells += [mib(record["peak_growth_bytes"]), mib(plain.get("peak_growth_bytes")),
                  mib(record.get("decode_peak_growth_bytes")), mib(plain.get("decode_peak_growth_bytes"))]
        rows.append(f"| {record['method']} | {record['prompt_tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
