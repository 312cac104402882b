"""The served load bench: every method behind a real server on 127.0.0.1, driven by the load generator; answers
checked against the speculation-off server; tables and structure counts from the engine's counters."""

from __future__ import annotations

import pytest

from hf_adaptive_spec.bench import served as bench_served
from hf_adaptive_spec.bench.batch_runs import LoadMethod
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


def test_repeated_passes_rotate_the_order_and_compare_each_pass_with_its_own_off():
    """`repeats`: each pass serves the trace with every method again, the order rotated per pass; every run is
    checked against the same pass's `off` and carries its pass."""
    import io

    target, drafter = build_models("chain")
    methods = bench_served.served_methods(False, ["sage"], chain_lengths=(2,), tree_sizes=())
    progress = io.StringIO()
    results = bench_served.run_served(target, build_tokenizer(), drafter, "tiny", methods, rates=[50.0],
                                      arrivals=["poisson"], requests=3, max_new_tokens=4, max_batch=2, max_queue=8,
                                      seed=0, prompts=PROMPTS, warmup=0, time_limit=120, progress=progress,
                                      repeats=2)
    assert results["failures"] == []
    assert [(run["method"], run["repeat"]) for run in results["runs"]] == [
        ("off", 0), ("chain2", 0), ("sage", 0), ("off", 1), ("chain2", 1), ("sage", 1)]
    served_order = [line.split(": ")[1].split(" ")[0] for line in progress.getvalue().splitlines()]
    assert served_order == ["off", "chain2", "sage", "chain2", "sage", "off"]
    with pytest.raises(ValueError, match="repeats"):
        bench_served.run_served(target, build_tokenizer(), drafter, "tiny", methods, rates=[50.0],
                                arrivals=["poisson"], requests=1, max_new_tokens=2, max_batch=1, max_queue=1, seed=0,
                                prompts=PROMPTS, repeats=0, progress=None)


def _run(method, repeat, throughput, latency, vs_off):
    return {"method": method, "arrivals": "bursty", "rate": 4.0, "repeat": repeat, "throughput_tok_s": throughput,
            "vs_off": vs_off, "latency_s": {"mean": latency, "p50": latency, "p90": latency, "p99": latency},
            "ttft_s": {"mean": 0.1, "p90": 0.1}, "structure": {"nodes_per_row_round": 0.5, "plain_step_share": 0.5}}


def test_the_pass_table_divides_by_the_same_passs_off():
    results = {"runs": [_run("off", 0, 100.0, 2.0, 1.0), _run("laspec", 0, 90.0, 2.5, 0.9),
                        _run("off", 1, 80.0, 4.0, 1.0), _run("laspec", 1, 88.0, 3.0, 1.1)],
               "failures": [],
               "settings": {"target": "t", "drafter": "d", "requests": 2, "max_new_tokens": 4, "max_batch": 2,
                            "machine": "test", "date": "2026-12-05"}}
    ratios = bench_served.pass_ratios(results)
    assert ratios[("bursty", 4.0, "laspec")]["throughput"] == [0.9, 1.1]
    assert ratios[("bursty", 4.0, "laspec")]["latency"] == pytest.approx([1.25, 0.75])
    table = bench_served.served_markdown(results)
    assert "| 4 | laspec (pass 2) |" in table
    assert "| bursty | 4 | laspec | 0.90x, 1.10x (mean 1.00x) | 1.25x, 0.75x (mean 1.00x) |" in table
