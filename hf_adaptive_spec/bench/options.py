"""The benchmark's command line: its options (`add_arguments`, shared by every bench mode) and the checks
every mode runs on them."""

from __future__ import annotations

import argparse
import json

from .. import traffic
from ..scenes.vlm import SCENES_VLM
from . import memory as bench_memory
from . import vision as bench_vision
from .stats import PLAIN_MODE

__all__ = ["DEFAULT_DRAFTER", "DEFAULT_STOCK_BEST", "DEFAULT_TARGET", "add_arguments", "check_run_options"]


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
#: Stock assisted generation, "tuned" for a CPU where a drafter step costs ~0.4 target steps: a short
#: starting draft that adapts per round (+2 when all accepted, -1 otherwise) and resets every call (so
#: interleaved runs stay independent), stopping early when the drafter's top probability drops below 0.3.
DEFAULT_STOCK_BEST = {
    "num_assistant_tokens": 5,
    "num_assistant_tokens_schedule": "heuristic_transient",
    "assistant_confidence_threshold": 0.3,
}


def _spec_config_arg(text: str) -> tuple:
    name, sep, payload = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--spec-config wants STRATEGY=JSON, got {text!r}.")
    try:
        value = json.loads(payload)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--spec-config {name}: invalid JSON ({exc}).") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--spec-config {name}: the JSON must be an object of config fields.")
    return name.strip(), value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON ({exc}).") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object.")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the benchmark options to `parser` (used by `main` and by the `hf-adaptive-spec bench` subcommand)."""
    from .. import STRATEGIES
    from ..registry.data import list_datasets

    models = parser.add_argument_group("models")
    models.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"registry name (hf_adaptive_spec.registry.models), {SCENES_VLM} or local HF folder "
                        f"(a VLM when its config has a vision_config) (default {DEFAULT_TARGET})")
    models.add_argument("--drafter", default=DEFAULT_DRAFTER,
                        help=f"registry name, shipped LaSpec drafter name (e.g. laspec-smollm2-135m-instruct) "
                        f"or local HF folder (default {DEFAULT_DRAFTER})")
    models.add_argument("--drafter-int8", action="store_true",
                        help="quantize the DRAFTER's Linear layers to dynamic int8 (CPU only); the target is unchanged")
    models.add_argument("--baseline-drafter", default=None, metavar="NAME",
                        help="a second drafter whose --baseline-strategies run in the same run, interleaved with "
                        "the others (methods STRATEGY:NAME), e.g. the independent model a new LaSpec drafter is "
                        "to beat; with a LaSpec --drafter, stock assisted generation uses this one")
    models.add_argument("--baseline-drafter-int8", action="store_true",
                        help="quantize the baseline drafter's Linear layers to dynamic int8 (CPU only)")
    models.add_argument("--baseline-strategies", nargs="+", default=["sage"], metavar="STRATEGY",
                        help="strategies run with --baseline-drafter (default sage)")
    models.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    models.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="compute dtype of both models (default float32; bf16 is slower on CPUs)")

    work = parser.add_argument_group("workload")
    work.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"],
                      choices=list_datasets() + [bench_vision.SCENES],
                      help="prompt sets (default: humaneval mtbench; scenes: held-out image prompts for a VLM)")
    work.add_argument("--limit", type=int, default=None,
                      help="prompts per data set, categories interleaved (default: all; scenes: "
                      f"{bench_vision.SCENES_DEFAULT_LIMIT})")
    work.add_argument("--skip", type=int, default=0,
                      help="leave out the first N prompts of each data set (held-out runs: prompts that no training "
                      "or tuning used; default 0)")
    work.add_argument("--max-new-tokens", type=int, default=128, help="(default 128)")

    meth = parser.add_argument_group("methods")
    meth.add_argument("--strategies", nargs="+", default=None, metavar="STRATEGY",
                      help=f"spec_strategy names (default: every registered one the drafter can serve: "
                      f"{' '.join(STRATEGIES)}; laspec only with a LaSpec drafter)")
    meth.add_argument("--spec-config", action="append", type=_spec_config_arg, default=[],
                      metavar="STRATEGY=JSON", help='spec_config of a strategy, e.g. sage=\'{"n_max": 12}\' '
                      "(repeatable)")
    meth.add_argument("--visual-tokens", nargs="+", type=int, default=None, metavar="M",
                      help="sweep the visual tokens the drafter sees: one method per M (e.g. 0 1 2 4 8 16 64). "
                      "laspec (the default swept strategy): laspec_mM, spec_config num_visual_tokens=M over any "
                      "--spec-config laspec=...; another strategy (--visual-strategy) with an image-aware "
                      "independent drafter: STRATEGY_mM, spec_config visual_tokens=M")
    meth.add_argument("--visual-strategy", default=None, metavar="STRATEGY",
                      help="the strategy a --visual-tokens sweep runs (default laspec; one of --strategies)")
    meth.add_argument("--visual-selection", nargs="+", default=None, choices=("prefill", "round"),
                      help="with an independent drafter: when the M tokens are chosen, once after the prefill "
                      "(prefill, default) or after every round (round: methods STRATEGY_mM_round); both to compare")
    meth.add_argument("--stock-best-kwargs", type=_json_object, default=dict(DEFAULT_STOCK_BEST), metavar="JSON",
                      help="drafter generation-config settings of the stock_best run "
                      f"(default {json.dumps(DEFAULT_STOCK_BEST)})")
    meth.add_argument("--no-stock", action="store_true", help="skip both stock assisted-generation runs")
    meth.add_argument("--no-plain-mode", action="store_true",
                      help=f"skip the {PLAIN_MODE} run (spec_strategy='plain': the library's forward without a "
                      "drafter, the second baseline: what speculation adds on top of the faster forward)")

    runs = parser.add_argument_group("run")
    runs.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    runs.add_argument("--warmup", type=int, default=1, help="untimed runs of each method before timing (default 1)")
    runs.add_argument("--seed", type=int, default=0, help="torch.manual_seed (default 0)")
    runs.add_argument("--out", default="bench_results", help="output folder (default bench_results/)")
    runs.add_argument("--no-plots", action="store_true")
    runs.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    runs.add_argument("--cold", action="store_true",
                      help="time the first calls of a fresh process instead (one per strategy; no cost curve, no "
                           "compiled kernel): first speculative call vs plain, third vs warmed "
                           "(hf_adaptive_spec.bench.cold)")
    runs.add_argument("--cold-keep-kernel", action="store_true",
                      help="with --cold: keep the machine's compiled CPU kernel (only the cost curve is fresh)")

    load = parser.add_argument_group("load (hf_adaptive_spec.bench.concurrency: batched prompts instead of one at a "
                                     "time)")
    load.add_argument("--load-sweep", nargs="+", type=int, default=None, metavar="B",
                      help="concurrency sweep: at each level B the first B prompts decode as one left-padded batch, "
                      "plain vs fixed chains and trees vs the adaptive rules of --strategies (default laspec and "
                      "sage with a LaSpec drafter, else sage), e.g. 1 2 4 8 16 32")
    load.add_argument("--load-repeats", type=int, default=1, metavar="R",
                      help="with --load-sweep: timed passes per level, each method keeping its fastest (default 1)")
    load.add_argument("--fixed", nargs="+", default=None, metavar="NAME",
                      help="the fixed structures to run: chainK (K draft tokens in a line) and treeN (N draft "
                      "nodes), e.g. chain1 chain2 tree8 (default chain1 chain2 chain4 chain8 tree8 tree16)")
    load.add_argument("--arrivals", choices=traffic.PROCESSES, default=None,
                      help="replay timed request arrivals through a batching scheduler (plain vs a chain vs the "
                      "adaptive rules): mean and p90 latency, throughput")
    load.add_argument("--rate", type=float, default=1.0, help="with --arrivals: mean requests per second (default 1)")
    load.add_argument("--requests", type=int, default=32, help="with --arrivals: requests in the trace (default 32)")
    load.add_argument("--max-batch", type=int, default=8, help="with --arrivals: most requests per batch (default 8)")
    bench_memory.add_arguments(parser)
    return parser


def check_run_options(args) -> None:
    """The options every bench mode shares: --max-new-tokens, --limit, --warmup."""
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1.")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1.")
    if getattr(args, "skip", 0) < 0:
        raise ValueError("--skip must be >= 0.")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0.")
