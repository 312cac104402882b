"""The batched modes of the bench (`hf_adaptive_spec.bench.concurrency`) on tiny random models: the concurrency
sweep, the arrival traces and the batching scheduler's replay, and exactness of every strategy on left-padded
batches."""

import argparse
import json
import math

import pytest
import torch

from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel, cli, traffic
from hf_adaptive_spec.bench import run as bench
from hf_adaptive_spec.bench import concurrency as bench_concurrency
from hf_adaptive_spec.bench import concurrency_sweep
from hf_adaptive_spec.registry.data import Prompt
from tiny_models import EOS_ID, PAD_ID, build_model, make_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 8


class FakeTokenizer:
    """Chat template = BOS + one id per character (ids in the tiny models' text range), up to 40 characters."""

    chat_template = "fake"
    pad_token_id = PAD_ID
    eos_token_id = EOS_ID

    def apply_chat_template(self, messages, add_generation_prompt, return_tensors, return_dict):
        ids = [1] + [8 + ord(c) % 120 for c in messages[-1]["content"]][:40]
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}

    def decode(self, tokens, skip_special_tokens=False):
        return " ".join(map(str, tokens))


PROMPTS = [Prompt(f"p/{i}", "humaneval", "humaneval", [{"role": "user", "content": text}])
           for i, text in enumerate(["ab", "Write a function that sorts a list of intervals quickly.", "x = 1 + 2",
                                     "Explain beam search in two sentences."])]

_MODELS = {}


def _models():
    if not _MODELS:
        target = build_model("llama")
        _MODELS["target"] = target
        _MODELS["drafter"] = build_model("llama", seed=3, num_layers=1)
        torch.manual_seed(0)
        _MODELS["laspec"] = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    return _MODELS


def _tiny_loader(name, args, role):
    return _models()[role], FakeTokenizer()


def _args(tmp_path, *extra):
    parser = bench.add_arguments(argparse.ArgumentParser())
    return parser.parse_args(["--max-new-tokens", str(MAX_NEW), "--out", str(tmp_path / "out"), "--no-progress",
                              "--device", "cpu", "--warmup", "0", *extra])


def _run(tmp_path, *extra):
    return bench_concurrency.run(_args(tmp_path, *extra), model_loader=_tiny_loader,
                                 prompt_loader=lambda dataset, limit: PROMPTS[:limit])


# ----------------------------------------------------------------------------
# The sweep and the arrivals through the command's path
# ----------------------------------------------------------------------------
def test_load_sweep_and_arrivals_on_tiny_models(tmp_path, monkeypatch):
    from hf_adaptive_spec.ops import cpu_linear

    monkeypatch.setattr(cpu_linear, "enabled", lambda wait=False: False)  # `prepare` must not wait for a build
    output = _run(tmp_path, "--load-sweep", "1", "3", "--arrivals", "bursty", "--rate", "20", "--requests", "5",
                       "--max-batch", "3", "--seed", "4")
    assert output["exit_code"] == 0
    sweep = output["load_sweep"]
    assert sweep["ok"], sweep["failures"]
    names = ["plain", "plain_mode", "chain1", "chain2", "chain4", "chain8", "tree8", "tree16", "sage"]
    assert list(sweep["methods"]) == names
    assert sweep["methods"]["chain4"]["strategy"] == "chain" and sweep["methods"]["tree8"]["strategy"] == "static_tree"
    assert sweep["methods"]["sage"]["spec_config"] == {"verify_cost": True}
    assert sweep["prepare"]["batch_sizes"] == [1, 2, 3] and sweep["prepare"]["strategies"] == ["sage"]
    assert sweep["prepare"]["error"] is None
    records = sweep["records"]
    assert [(r["level"], r["method"]) for r in records] == [(b, m) for b in (1, 3) for m in names]
    for r in records:
        assert r["error"] is None and r["matches_plain"] is True, r
        assert r["tokens_per_s"] > 0 and r["speedup_vs_plain"] > 0 and r["speedup_vs_plain_mode"] > 0
        assert r["new_tokens"] == sum(r["row_tokens"]) and len(r["row_tokens"]) == r["level"]
        if r["family"] == "fixed":
            assert 0 < r["nodes_per_round"] <= sweep["methods"][r["method"]]["size"]
            assert r["candidates_per_round"] == r["nodes_per_round"]  # no cost rule: nothing trimmed
        if r["family"] != "plain":
            assert r["tau"] >= 1.0
    assert {r["order"] for r in records if r["level"] == 1} == set(range(len(names)))
    first = {r["method"]: r["order"] for r in records if r["level"] == 1}
    second = {r["method"]: r["order"] for r in records if r["level"] == 3}
    assert first["plain"] == 0 and second["plain"] == len(names) - 1  # order rotated per level
    assert [level["prompt_ids"] for level in sweep["levels"]] == [["p/0"], ["p/0", "p/1", "p/2"]]
    for best in sweep["best_fixed"]:
        fixed = [r for r in records if r["level"] == best["level"] and r["family"] == "fixed"]
        assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in fixed)
        assert best["method"] == max(fixed, key=lambda r: r["tokens_per_s"])["method"]
    assert [b["level"] for b in sweep["best_fixed"]] == [1, 3]

    out = tmp_path / "out"
    saved = json.loads((out / "load_sweep.json").read_text())
    assert saved["settings"]["levels"] == [1, 3] and len(saved["records"]) == len(records)
    markdown = (out / "load_sweep.md").read_text()
    assert "| best fixed |" in markdown and "| sage |" in markdown and "Every row equals plain greedy" in markdown

    arrivals = output["arrivals"]
    assert arrivals["ok"], arrivals["failures"]
    assert arrivals["arrival_times"] == bench_concurrency.make_arrivals("bursty", 20, 5, seed=4)
    assert list(arrivals["methods"]) == ["plain", "plain_mode", "chain4", "sage"]
    for name, summary in arrivals["methods"].items():
        assert summary["error"] is None and summary["failures"] == 0
        assert summary["requests"] == 5 and summary["tokens"] == 5 * MAX_NEW and summary["tokens_per_s"] > 0
        assert summary["max_latency_s"] >= summary["p90_latency_s"] > 0
        assert all(len(batch["requests"]) <= 3 for batch in arrivals["batches"][name])
        assert sorted(r for batch in arrivals["batches"][name] for r in batch["requests"]) == list(range(5))
        for request in arrivals["requests"][name]:
            assert request["latency"] == pytest.approx(request["finish"] - request["arrival"])
            assert request["latency"] > 0
        latencies = [request["latency"] for request in arrivals["requests"][name]]
        assert summary["p90_latency_s"] == traffic.percentile(latencies, 90)
    assert arrivals["methods"]["plain"]["mean_latency_vs_plain"] == pytest.approx(1.0)
    assert arrivals["methods"]["plain_mode"]["tokens_per_s_vs_plain_mode"] == pytest.approx(1.0)
    assert sweep["methods"]["plain_mode"] == {"family": "plain_mode", "strategy": "plain", "spec_config": None,
                                              "size": None}
    assert "/ over the plain mode" in markdown and "| plain_mode |" in markdown
    assert "| chain4 |" in (out / "arrivals.md").read_text() and "p90 by linear interpolation" in (
        out / "arrivals.md").read_text()
    settings = json.loads((out / "arrivals.json").read_text())["settings"]
    assert settings["arrivals"] == "bursty" and settings["percentile"] == "linear"
    assert settings["arrival_options"] == {"burst_sizes": "random", "first_arrival": "after_gap",
                                           "seeding": "process_and_seed"}

    pytest.importorskip("matplotlib")
    assert (out / bench_concurrency.PLOT_FILES["structure"]).stat().st_size > 1000
    assert (out / bench_concurrency.PLOT_FILES["throughput"]).stat().st_size > 1000


def test_load_sweep_with_a_laspec_drafter():
    models = _models()
    methods, skipped = bench_concurrency.load_methods(True, ["laspec", "sage"], block_size=4)
    assert [m.name for m in methods] == ["plain", "plain_mode", "chain1", "chain2", "chain4", "tree8", "tree16",
                                         "laspec", "sage"]
    assert set(skipped) == {"chain8"}  # deeper than the drafter's block
    chain2 = next(m for m in methods if m.name == "chain2")
    assert chain2.strategy == "laspec" and chain2.spec_config["top_k"] == 1 and chain2.spec_config["n_max"] == 2
    assert chain2.spec_config["verify_cost"] is False and chain2.spec_config["context_lookup"] == 0
    sweep = bench_concurrency.run_load_sweep(models["target"], FakeTokenizer(), models["laspec"], PROMPTS, [1, 3],
                                             methods, MAX_NEW, warmup=0)
    assert not sweep["failures"]["count"], sweep["failures"]
    assert all(r["matches_plain"] and r["tokens_per_s"] > 0 for r in sweep["records"])
    by_name = {r["method"]: r for r in sweep["records"] if r["level"] == 3}
    assert 0 < by_name["chain1"]["nodes_per_round"] <= 1 and 0 < by_name["tree16"]["nodes_per_round"] <= 16
    assert by_name["laspec"]["candidates_per_round"] >= by_name["laspec"]["nodes_per_round"]


def test_fixed_picks_the_fixed_structures(tmp_path):
    assert bench_concurrency.fixed_structures(None) == (bench_concurrency.CHAIN_LENGTHS, bench_concurrency.TREE_SIZES)
    assert bench_concurrency.fixed_structures(["tree8", "chain2", "chain1", "chain2"]) == ((2, 1), (8,))
    results = _run(tmp_path, "--load-sweep", "2", "--fixed", "chain2", "tree4")["load_sweep"]
    assert list(results["methods"]) == ["plain", "plain_mode", "chain2", "tree4", "sage"]
    assert {r["method"] for r in results["records"]} == {"plain", "plain_mode", "chain2", "tree4", "sage"}
    without = _run(tmp_path, "--load-sweep", "2", "--fixed", "chain2", "--no-plain-mode")["load_sweep"]
    assert list(without["methods"]) == ["plain", "chain2", "sage"]
    assert all(r["matches_plain"] for r in results["records"])


def test_repeated_passes_keep_each_methods_fastest(monkeypatch):
    """With repeats, every method runs that many timed passes per level (each pass's order rotated once more),
    scores its fastest and checks every pass's rows against plain's."""
    models = _models()
    methods, _ = bench_concurrency.load_methods(False, ["sage"])
    methods = [m for m in methods if m.name in ("plain", "chain2", "sage")]
    seconds = iter([5.0, 4.0, 3.0, 1.0, 2.0, 9.0, 6.0, 7.0, 8.0, 3.5, 2.5, 1.5])
    original = bench_concurrency.decode_batch
    calls = []

    def decode_batch(method, *args, **kwargs):
        run = original(method, *args, **kwargs)
        calls.append(method.name)
        return bench_concurrency.BatchRun(run.rows, next(seconds), run.stats)

    monkeypatch.setattr(concurrency_sweep, "decode_batch", decode_batch)  # what the sweep runs
    sweep = bench_concurrency.run_load_sweep(models["target"], FakeTokenizer(), models["drafter"], PROMPTS, [1, 2],
                                             methods, MAX_NEW, warmup=0, repeats=2)
    # level 1: order plain, chain2, sage then chain2, sage, plain; level 2 starts one further
    assert calls == ["plain", "chain2", "sage", "chain2", "sage", "plain",
                     "chain2", "sage", "plain", "sage", "plain", "chain2"]
    records = {(r["level"], r["method"]): r for r in sweep["records"]}
    assert records[1, "plain"]["repeat_seconds"] == [5.0, 9.0] and records[1, "plain"]["seconds"] == 5.0
    assert records[1, "chain2"]["seconds"] == 1.0 and records[1, "sage"]["seconds"] == 2.0
    assert records[1, "chain2"]["speedup_vs_plain"] == pytest.approx(5.0)
    assert records[2, "sage"]["repeat_seconds"] == [7.0, 3.5] and records[2, "plain"]["seconds"] == 2.5
    assert all(r["matches_plain"] for r in sweep["records"])
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench_concurrency.run_load_sweep(models["target"], FakeTokenizer(), models["drafter"], PROMPTS, [1], methods,
                                         MAX_NEW, warmup=0, repeats=0)


def test_best_fixed_is_picked_after_the_fact_among_exact_fixed_runs():
    def record(level, method, rate, family="fixed", matches=True):
        return {"level": level, "method": method, "family": family, "error": None, "matches_plain": matches,
                "tokens_per_s": rate, "speedup_vs_plain": rate / 10, "tau": 2.0, "nodes_per_round": 1.0}

    records = [record(1, "plain", 10, "plain"), record(1, "chain1", 12), record(1, "chain4", 15),
               record(1, "laspec", 30, "adaptive"), record(4, "chain1", 20), record(4, "chain4", 25, matches=False),
               record(8, "chain4", 5, matches=False)]
    best = bench_concurrency.best_fixed(records)
    assert [(b["level"], b["method"], b["tokens_per_s"]) for b in best] == [(1, "chain4", 15), (4, "chain1", 20)]


# ----------------------------------------------------------------------------
# Exactness on left-padded batches with rows of very different lengths
# ----------------------------------------------------------------------------
LENGTHS = {1: [23], 3: [3, 40, 17], 8: [3, 40, 7, 25, 12, 33, 5, 18]}


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_every_strategy_matches_plain_greedy_per_row(batch_size):
    models = _models()
    target = models["target"]
    inputs = make_inputs("llama", batch_size=batch_size, prompt_lengths=LENGTHS[batch_size])
    width = inputs["input_ids"].shape[1]
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=10)
    expected = bench_concurrency.row_tokens(plain, width, [EOS_ID])
    # an EOS that one row emits early: rows then end at different steps
    eos = int(plain[-1, width + 3])
    plain_eos = target.generate(**inputs, do_sample=False, max_new_tokens=10, eos_token_id=eos)
    expected_eos = bench_concurrency.row_tokens(plain_eos, width, [eos])
    assert len(expected_eos[-1]) == expected_eos[-1].index(eos) + 1 <= 4
    for strategy, drafter in (("chain", "drafter"), ("static_tree", "drafter"), ("sage", "drafter"),
                              ("laspec", "laspec")):
        out = target.generate(**inputs, do_sample=False, max_new_tokens=10, assistant_model=models[drafter],
                              spec_strategy=strategy)
        assert bench_concurrency.row_tokens(out, width, [EOS_ID]) == expected, strategy
        out = target.generate(**inputs, do_sample=False, max_new_tokens=10, assistant_model=models[drafter],
                              spec_strategy=strategy, eos_token_id=eos)
        assert bench_concurrency.row_tokens(out, width, [eos]) == expected_eos, strategy


def test_pad_encodings_and_row_tokens():
    encoded = [{"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)},
               {"input_ids": torch.tensor([[9]]), "attention_mask": torch.ones(1, 1, dtype=torch.long)}]
    batch = bench_concurrency.pad_encodings(encoded, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    sequences = torch.tensor([[5, 6, 7, 11, 2, 0], [0, 0, 9, 12, 13, 14]])
    assert bench_concurrency.row_tokens(sequences, 3, [2]) == [[11, 2], [12, 13, 14]]
    assert bench_concurrency.row_tokens(sequences, 3) == [[11, 2, 0], [12, 13, 14]]


# ----------------------------------------------------------------------------
# Arrival traces and the scheduler
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", bench_concurrency.ARRIVAL_KINDS)
def test_arrivals_are_deterministic_in_the_seed_with_the_mean_rate(kind):
    trace = bench_concurrency.make_arrivals(kind, rate=2.0, requests=4000, seed=7)
    assert trace == bench_concurrency.make_arrivals(kind, rate=2.0, requests=4000, seed=7)
    assert trace != bench_concurrency.make_arrivals(kind, rate=2.0, requests=4000, seed=8)
    assert len(trace) == 4000 and trace == sorted(trace) and trace[0] > 0
    assert len(trace) / trace[-1] == pytest.approx(2.0, rel=0.1)
    distinct = len(set(trace))
    if kind == "poisson":
        assert distinct == len(trace)
    else:  # bursts of mean size BURST_SIZE arrive at one instant
        assert len(trace) / distinct == pytest.approx(traffic.BURST_SIZE, rel=0.1)
    # the shared generator with the replay's options: random burst sizes, the first arrival after a gap
    assert bench_concurrency.ARRIVAL_OPTIONS == traffic.ArrivalOptions(
        burst_sizes="random", first_arrival="after_gap", seeding="process_and_seed")
    assert trace == traffic.arrival_times(4000, 2.0, kind, 7, bench_concurrency.ARRIVAL_OPTIONS)


def test_arrival_errors():
    with pytest.raises(ValueError, match="arrival process must be one of poisson, bursty; got 'uniform'"):
        bench_concurrency.make_arrivals("uniform", 1.0, 4)
    with pytest.raises(ValueError, match="rate"):
        bench_concurrency.make_arrivals("poisson", 0.0, 4)
    with pytest.raises(ValueError, match="requests"):
        bench_concurrency.make_arrivals("bursty", 1.0, 0)


def test_replay_reproduces_hand_computed_latencies():
    calls = []

    def run_batch(ids):  # a batch takes 1 s + 0.5 s per request
        calls.append(ids)
        return 1.0 + 0.5 * len(ids)

    arrivals = [0.0, 0.0, 0.5, 1.0, 5.0]
    replayed = bench_concurrency.replay(arrivals, run_batch, max_batch=2)
    # t=0: {0, 1} run 2 s -> 2; t=2: {2, 3} arrived, run 2 s -> 4; idle until 5: {4} runs 1.5 s -> 6.5
    assert calls == [[0, 1], [2, 3], [4]]
    assert replayed["finish"] == [2.0, 2.0, 4.0, 4.0, 6.5]
    assert replayed["latency"] == [2.0, 2.0, 3.5, 3.0, 1.5]
    assert [b["start"] for b in replayed["batches"]] == [0.0, 2.0, 5.0]
    assert replayed["makespan"] == 6.5
    summary = bench_concurrency.summarize_replay(replayed, tokens=[4, 4, 4, 4, 4])
    assert summary["mean_latency_s"] == pytest.approx(12.0 / 5)
    # linear interpolation: rank 0.9 * 4 = 3.6 between 3.0 and 3.5 of [1.5, 2, 2, 3, 3.5]
    assert summary["p90_latency_s"] == pytest.approx(3.3) and summary["max_latency_s"] == 3.5
    assert summary["batches"] == 3 and summary["mean_batch_size"] == pytest.approx(5 / 3)
    assert summary["busy_s"] == 5.5 and summary["tokens_per_s"] == pytest.approx(20 / 6.5)
    assert bench_concurrency.replay(arrivals, run_batch, max_batch=2) == replayed  # deterministic

    # a queue longer than the batch limit, arrivals given out of order (ties by index), a late start
    calls.clear()
    replayed = bench_concurrency.replay([3.0, 1.0, 1.0, 1.0, 1.0], run_batch, max_batch=3)
    assert calls == [[1, 2, 3], [4, 0]]  # t=1: three of four; t=3.5: the fourth and request 0 (arrived at 3)
    assert replayed["finish"] == [5.5, 3.5, 3.5, 3.5, 5.5]
    assert replayed["latency"] == [2.5, 2.5, 2.5, 2.5, 4.5]
    summary = bench_concurrency.summarize_replay(replayed)
    assert summary["p90_latency_s"] == pytest.approx(3.7) and summary["makespan_s"] == 4.5  # 2.5 + 0.6 * 2.0
    assert "tokens" not in summary
    with pytest.raises(ValueError, match="max_batch"):
        bench_concurrency.replay([0.0], run_batch, max_batch=0)


# ----------------------------------------------------------------------------
# Options and the command
# ----------------------------------------------------------------------------
def test_load_option_errors(tmp_path):
    with pytest.raises(ValueError, match="fixed chains and trees run already"):
        _run(tmp_path, "--load-sweep", "1", "--strategies", "static_tree")
    with pytest.raises(ValueError, match="need.*LaSpec drafter"):
        _run(tmp_path, "--load-sweep", "1", "--strategies", "laspec")
    with pytest.raises(ValueError, match="not among the adaptive rules"):
        _run(tmp_path, "--load-sweep", "1", "--spec-config", "chain={\"num_draft_tokens\": 2}")
    with pytest.raises(ValueError, match="--spec-config sage"):
        _run(tmp_path, "--load-sweep", "1", "--spec-config", "sage={\"nope\": 2}")
    with pytest.raises(ValueError, match=">= 1"):
        _run(tmp_path, "--load-sweep", "0")
    with pytest.raises(ValueError, match="--load-repeats"):
        _run(tmp_path, "--load-sweep", "1", "--load-repeats", "0")
    with pytest.raises(ValueError, match="--rate"):
        _run(tmp_path, "--arrivals", "poisson", "--rate", "0")
    with pytest.raises(ValueError, match="--cold"):
        _run(tmp_path, "--load-sweep", "1", "--cold")
    for bad in ("chain0", "tree", "chains2", "dag4"):
        with pytest.raises(ValueError, match=f"--fixed {bad}: name chainK"):
            _run(tmp_path, "--load-sweep", "1", "--fixed", "chain2", bad)
    with pytest.raises(ValueError, match="--fixed picks"):
        bench.run(_args(tmp_path, "--fixed", "chain2"), model_loader=_tiny_loader)
    with pytest.raises(ValueError, match=r"bench\.concurrency"):  # the per-prompt bench points to the batched modes
        bench.run(_args(tmp_path, "--load-sweep", "1"), model_loader=_tiny_loader)


def test_cli_dispatches_the_load_modes(monkeypatch):
    seen = []
    monkeypatch.setattr(bench_concurrency, "run", lambda args: seen.append(args) or {"exit_code": 0})
    argv = ["bench", "--target", "t", "--drafter", "d", "--load-sweep", "1", "2", "4", "--arrivals", "poisson",
            "--rate", "2.5", "--requests", "12", "--max-batch", "4"]
    assert cli.main(argv) == 0
    (args,) = seen
    assert args.load_sweep == [1, 2, 4] and args.arrivals == "poisson"
    assert args.rate == 2.5 and args.requests == 12 and args.max_batch == 4
    assert math.isclose(args.rate, 2.5)
