"""Every bench mode's results file records its command and environment (commit, date, machine, versions)."""

import argparse
import json
import subprocess
import sys
import types

from hf_adaptive_spec.bench import run as bench
from hf_adaptive_spec.bench import cold as bench_cold
from hf_adaptive_spec.bench import memory as bench_memory

REAL_RUN = subprocess.run


def _args(tmp_path, *extra):
    parser = bench.add_arguments(argparse.ArgumentParser())
    return parser.parse_args(["--out", str(tmp_path / "out"), "--device", "cpu", "--max-new-tokens", "4",
                              "--no-progress", *extra])


def _check_provenance(results):
    assert results["command"]  # the command as typed
    env = results["environment"]
    for key in ("started", "finished", "git_commit", "cpu_model", "threads", "torch", "transformers",
                "hf_adaptive_spec", "python"):
        assert key in env, key
    assert env["started"] <= env["finished"]


def test_memory_results_record_command_and_environment(tmp_path, monkeypatch):
    record = {"method": "plain", "prompt_tokens": 8, "peak_growth_bytes": 2**20, "new_tokens": 2, "tokens": [1, 2],
              "measure": "peak RSS (VmHWM)"}

    def fake_run(command, **kwargs):
        if command[0] != sys.executable:
            return REAL_RUN(command, **kwargs)
        spec = json.loads(command[-1])
        return types.SimpleNamespace(returncode=0, stdout=json.dumps({**record, "method": spec["method"]}), stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = _args(tmp_path, "--memory", "--memory-prompts", "8", "--strategies", "chain", "--drafter", "d",
                 "--target", "t")
    bench_memory.run_memory(args)
    results = json.loads((tmp_path / "out" / "memory.json").read_text())
    _check_provenance(results)
    assert [r["method"] for r in results["records"]] == ["plain", "chain"]
    assert all(r["matches_plain"] for r in results["records"])


def test_cold_results_record_command_and_environment(tmp_path, monkeypatch):
    def fake_run(command, **kwargs):
        if command[0] != sys.executable:
            return REAL_RUN(command, **kwargs)
        options = json.loads(open(command[-2]).read())
        with open(command[-1], "w") as out:
            json.dump({"strategy": options["strategy"], "first_call_seconds": 1.0, "second_call_seconds": 0.5,
                       "same_as_plain": True}, out)
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(bench_cold, "cold_table", lambda results: "table")
    prompt = types.SimpleNamespace(id="p", messages=[{"role": "user", "content": "hi"}])
    bench_cold.run_cold(_args(tmp_path, "--cold"), ["chain"], {}, prompt)
    results = json.loads((tmp_path / "out" / "cold.json").read_text())
    _check_provenance(results)
    assert [r["strategy"] for r in results["records"]] == ["chain"]
