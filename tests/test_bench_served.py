"""The served load bench: every method behind a real server on 127.0.0.1, driven by the load generator; answers
checked against the speculation-off server; tables and structure counts from the engine's counters."""

from __future__ import annotations

import pytest

from hf_adaptive_spec.bench import served as bench_served
from hf_adaptive_spec.bench.load_batches import LoadMethod
from tiny_server import build_models, build_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ("tell me a story about cats", "why is the sky blue", "hello world", "what about dogs")


def test_served_methods_replace_stock_plain_with_speculation_off():
    methods = bench_served.served_methods(False, ["sage"], chain_lengths=(2,), tree_sizes=(4,))
    assert [m.name for m in methods] == ["off", "chain2", "tree4", "sage"]
    assert methods[0].strategy == "plain" and methods[0].family == "plain"
    # one long-lived server per method: each keeps its batch sizes' verdicts across runs, as an engine does
    assert all(m.calibration.keep_pauses for m in methods[1:])
    assert len({id(m.calibration) for m in methods}) == len(methods)


def test_every_method_serves_the_trace_and_answers_like_speculation_off():
    target, drafter = build_models("chain")
    methods = bench_served.served_methods(False, ["sage"], chain_lengths=(2,), tree_sizes=(4,))
    results = bench_served.run_served(target, build_tokenizer(), drafter, "tiny", methods, rates=[50.0],
                                      arrivals=["bursty"], requests=5, max_new_tokens=6, max_batch=3, max_queue=16,
                                      seed=0, prompts=PROMPTS, warmup=1, time_limit=120, progress=None)
    assert results["failures"] == []
    assert [run["method"] for run in results["runs"]] == ["off", "chain2", "tree4", "sage"]
    for run in results["runs"]:
        assert run["requests"]["ok"] == 5 and run["mismatched_requests"] == []
        structure = run["structure"]
        assert structure["row_rounds"] > 0
        if run["method"] == "off":
            assert structure["plain_step_share"] == 1.0 and run["vs_off"] == 1.0
        if run["method"] == "chain2":
            assert 0 < structure["nodes_per_row_round"] <= 2
    results["settings"] = {"target": "tiny", "drafter": "tiny-drafter", "requests": 5, "max_new_tokens": 6,
                           "max_batch": 3, "machine": "test", "date": "2026-12-04"}
    table = bench_served.served_markdown(results)
    assert "### bursty arrivals" in table and "| 50 | chain2 |" in table


def test_a_differing_answer_is_a_failure(monkeypatch):
    """An answer that differs from the speculation-off server's is reported (the check can fail)."""
    target, drafter = build_models("chain")
    answers = bench_served._answers

    def altered(report):
        out = answers(report)
        return out if report.get("label") == "off" else {i: text + " x" for i, text in out.items()}

    monkeypatch.setattr(bench_served, "_answers", altered)
    methods = [LoadMethod("off", "plain", "plain"),
               LoadMethod("chain2", "fixed", "chain", {"num_draft_tokens": 2, "min_draft_tokens": 2,
                                                       "max_draft_tokens": 2, "adaptive": False,
                                                       "verify_cost": False}, 2)]
    results = bench_served.run_served(target, build_tokenizer(), drafter, "tiny", methods, rates=[50.0],
                                      arrivals=["poisson"], requests=3, max_new_tokens=4, max_batch=2, max_queue=8,
                                      seed=0, prompts=PROMPTS, warmup=0, time_limit=120, progress=None)
    assert [f["method"] for f in results["failures"]] == ["chain2"]
    assert "differ" in results["failures"][0]["error"]


def test_an_independent_drafter_is_served_int8_as_serve_serves_it():
    import argparse

    parser = argparse.ArgumentParser()
    bench_served.add_arguments(parser)
    assert parser.parse_args([]).drafter_int8 is True
    assert parser.parse_args(["--no-drafter-int8"]).drafter_int8 is False
