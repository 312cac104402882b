"""The HTTP load generator: its arrival processes (`traffic` with its options), and runs against a real server on
127.0.0.1 (the tiny model of `tiny_server`). Counts are checked exactly; no timing threshold."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tiny_server import build_engine, build_models, build_tokenizer, running_server  # noqa: E402

from hf_adaptive_spec import traffic  # noqa: E402
from hf_adaptive_spec.serving.http_load import (ARRIVAL_OPTIONS, LoadSpec, arrival_times, load_prompts,  # noqa: E402
                                                markdown_table, run_load)
from hf_adaptive_spec.serving.server import create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-llama"


def test_poisson_arrivals():
    times = arrival_times(20_000, rate=4.0, arrivals="poisson", seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == arrival_times(20_000, rate=4.0, arrivals="poisson", seed=3)
    assert times != arrival_times(20_000, rate=4.0, arrivals="poisson", seed=4)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)  # seeded: the same numbers on every machine
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean


def test_bursty_arrivals():
    times = arrival_times(41, rate=2.0, arrivals="bursty", seed=0, burst_size=4, burst_gap=0.01)
    assert times == sorted(times) and times[0] == 0.0
    bursts = [times[i:i + 4] for i in range(0, len(times), 4)]
    for burst in bursts[:-1]:
        assert [b - burst[0] for b in burst] == pytest.approx([0.0, 0.01, 0.02, 0.03])
    assert len(bursts[-1]) == 1
    together = arrival_times(4_001, rate=2.0, arrivals="bursty", seed=0, burst_size=4)
    assert together[:4] == [0.0] * 4 and all(len(set(together[i:i + 4])) == 1 for i in range(0, 4_000, 4))
    starts = together[::4]
    assert statistics.mean(b - a for a, b in zip(starts, starts[1:])) == pytest.approx(2.0, rel=0.05)
    with pytest.raises(ValueError):
        arrival_times(3, rate=1.0, arrivals="uniform")


def test_arrivals_are_the_shared_generators_with_fixed_bursts_from_time_zero():
    assert ARRIVAL_OPTIONS == traffic.ArrivalOptions(burst_sizes="fixed", first_arrival="at_zero", seeding="seed")
    for kind in traffic.PROCESSES:
        expected = traffic.arrival_times(30, 2.0, kind, 5, ARRIVAL_OPTIONS, burst_size=3, burst_gap=0.02)
        assert arrival_times(30, rate=2.0, arrivals=kind, seed=5, burst_size=3, burst_gap=0.02) == expected


def test_spec_validation_and_prompt_files(tmp_path):
    for bad in (dict(url="127.0.0.1:8000"), dict(rate=0), dict(arrivals="x"), dict(requests=0),
                dict(time_limit=0), dict(prompts=())):
        with pytest.raises(ValueError):
            LoadSpec(**{"url": "http://127.0.0.1:1", **bad}).validate()
    (tmp_path / "a.json").write_text(json.dumps(["one", {"prompt": "two"}]))
    (tmp_path / "b.jsonl").write_text('{"prompt": "three"}\n"four"\n')
    (tmp_path / "c.txt").write_text("five\n\nsix words here\n")
    assert load_prompts(tmp_path / "a.json") == ["one", "two"]
    assert load_prompts(tmp_path / "b.jsonl") == ["three", "four"]
    assert load_prompts(tmp_path / "c.txt") == ["five", "six words here"]


@pytest.fixture(scope="module")
def server_url():
    engine = build_engine("plain", max_batch=4, max_queue=16)
    app = create_app(engine, build_tokenizer(), MODEL, max_context=1 << 17)
    with running_server(app) as url:
        yield url


def _check_counts(report: dict) -> None:
    counts = report["requests"]
    assert counts["total"] == counts["ok"] + counts["failed"] + counts["not_sent"]
    assert counts["failed"] == sum(counts["errors"].values())
    assert len(report["per_request"]) == counts["total"]


@pytest.mark.parametrize("arrivals", ["poisson", "bursty"])
def test_run_against_the_server(server_url, arrivals):
    spec = LoadSpec(url=server_url, rate=20.0, arrivals=arrivals, requests=6, seed=1, max_tokens=8,
                    time_limit=300.0, label=f"tiny {arrivals}")
    report = run_load(spec)
    _check_counts(report)
    assert report["requests"] == {"total": 6, "ok": 6, "failed": 0, "not_sent": 0, "errors": {}}
    assert report["model"] == MODEL
    records = report["per_request"]
    assert report["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    assert all(1 <= r["completion_tokens"] <= 8 and r["status"] == "200" for r in records)
    assert all(0 <= r["ttft_s"] <= r["latency_s"] for r in records)
    tokenizer, reference = build_tokenizer(), build_models("plain")[0]
    for record in records:  # each answer is what plain greedy generate gives its prompt
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}],
                                               add_generation_prompt=True, return_dict=True, return_tensors="pt")
        out = reference.generate(**inputs, max_new_tokens=8, do_sample=False)
        assert record["text"] == tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert [r["scheduled_s"] for r in records] == arrival_times(6, 20.0, arrivals, 1, 4, 0.0)
    assert report["latency_s"] == traffic.summary([r["latency_s"] for r in records], (50, 90, 99))
    for key in ("mean", "p50", "p90", "p99"):
        assert report["latency_s"][key] > 0
    for key in ("mean", "p50", "p90"):
        assert report["ttft_s"][key] > 0
    assert report["throughput_tok_s"] > 0 and report["requests_per_s"] > 0
    delta = report["server"]["delta"]
    assert delta["engine"]["submitted"] == 6 and delta["engine"]["finished"] == 6
    assert delta["server"]["completion_tokens"] == report["completion_tokens"]
    assert delta["server"]["served"] == 6
    table = markdown_table([report, report])
    assert table.count("\n") == 3 and f"| tiny {arrivals} | {arrivals} | 20 | 6 / 6 |" in table


def test_time_limit_bounds_the_run(server_url):
    """A request still open at the time limit is closed (and leaves the server's batch); one whose arrival time
    lies past the limit is never sent."""
    times = arrival_times(3, 0.001, "poisson", seed=0)
    assert times[1] > 100.0  # the second arrives long after the limit
    spec = LoadSpec(url=server_url, rate=0.001, requests=3, seed=0, max_tokens=100_000, time_limit=3.0)
    started = time.monotonic()
    report = run_load(spec)
    assert time.monotonic() - started < 60.0  # stopped by itself (the limit is 3 s; this only bounds a hang)
    _check_counts(report)
    assert report["requests"] == {"total": 3, "ok": 0, "failed": 1, "not_sent": 2, "errors": {"timeout": 1}}
    assert report["latency_s"]["mean"] is None and "| - |" in markdown_table([report])
    with httpx.Client(base_url=server_url, timeout=30, trust_env=False) as client:
        deadline = time.monotonic() + 120.0
        while client.get("/health").json()["engine"]["running"]:
            assert time.monotonic() < deadline, "the abandoned request kept its row"
            time.sleep(0.05)


def test_refusals_are_counted_by_status():
    """Every request to an engine that queues none gets 429: counted by status, nothing answered."""
    engine = build_engine("plain", max_batch=1, max_queue=0)
    app = create_app(engine, build_tokenizer(), MODEL)
    with running_server(app) as url:
        report = run_load(LoadSpec(url=url, rate=50.0, arrivals="bursty", requests=5, max_tokens=4, time_limit=120))
    _check_counts(report)
    assert report["requests"] == {"total": 5, "ok": 0, "failed": 5, "not_sent": 0, "errors": {"429": 5}}
    assert report["throughput_tok_s"] == 0
    assert report["server"]["delta"]["server"]["by_status"]["429"] == 5


def test_command_line(server_url, tmp_path, capsys):
    from hf_adaptive_spec.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nwhy is the sky blue\n")
    out = tmp_path / "run" / "results.json"
    code = main(["loadtest", "--url", server_url, "--rate", "10", "--arrivals", "bursty", "--requests", "3",
                 "--max-tokens", "4", "--prompts", str(prompts), "--out", str(out), "--label", "cli"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["requests"]["ok"] == 3 and report["settings"]["prompts"] == 2
    assert {r["prompt"] for r in report["per_request"]} <= {"hello world", "why is the sky blue"}
    assert "| cli | bursty | 10 | 3 / 3 |" in capsys.readouterr().out


def test_the_api_key_is_sent_and_not_reported(monkeypatch):
    """Against a server with a key: without it every request gets 401; with it (or $HF_ADAPTIVE_SPEC_API_KEY)
    every one is answered, and the report says only that a key was set."""
    from hf_adaptive_spec.serving import http_load

    app = create_app(build_engine("plain"), build_tokenizer(), MODEL, api_key="load-key")
    with running_server(app) as url:
        refused = run_load(LoadSpec(url=url, rate=50.0, requests=2, max_tokens=3, time_limit=120))
        answered = run_load(LoadSpec(url=url, rate=50.0, requests=2, max_tokens=3, time_limit=120,
                                     api_key="load-key"))
        monkeypatch.setenv("HF_ADAPTIVE_SPEC_API_KEY", "load-key")
        parser = argparse.ArgumentParser()
        http_load.add_arguments(parser)
        args = parser.parse_args(["--url", url, "--requests", "1", "--max-tokens", "2"])
        assert http_load.run(args) == 0
    assert refused["requests"]["errors"] == {"401": 2}
    assert answered["requests"]["ok"] == 2 and answered["settings"]["api_key"] == "set"
    assert "load-key" not in json.dumps(answered)
