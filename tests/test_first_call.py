"""The first speculative call does no hidden one-off work: no timed sweeps of the cost curve, no kernel compile
inside `generate`; `prepare` does both when asked, and the rounds correct the prior curve they start from."""

from __future__ import annotations

import pytest
import torch

import hf_adaptive_spec
from hf_adaptive_spec import cost
from hf_adaptive_spec.cost import store as cost_store
from hf_adaptive_spec.ops import cpu_linear
from tiny_models import build_drafter, build_model, make_inputs

pytestmark = pytest.mark.measured_cost  # these tests run the real cost-curve lookup


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    """No stored cost curve and no compiled kernel; records measurements, in-call builds and background builds."""
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(cost_store, "_MEMORY", {})
    calls = {"measure": 0, "build": 0, "background": 0}
    measure = cost.measure_verifier_cost

    def measuring(*args, **kwargs):
        calls["measure"] += 1
        return measure(*args, **kwargs)

    def building(isa):
        calls["build"] += 1
        raise AssertionError("the kernel must not be compiled inside a call")

    monkeypatch.setattr(cost_store, "measure_verifier_cost", measuring)
    monkeypatch.setattr(cpu_linear, "_build", building)
    monkeypatch.setattr(cpu_linear, "build_in_background", lambda: calls.__setitem__("background", 1))
    return calls


# enough rounds (>= 8) for the rounds to stand in for the prior curve
CONFIGS = {"sage": {"verify_cost": True, "d_max": 2}, "chain": {"verify_cost": True, "num_draft_tokens": 1,
           "adaptive": False}, "laspec": None}


@pytest.mark.parametrize("strategy", ["sage", "chain", "laspec"])
def test_a_first_call_measures_and_builds_nothing(fresh_machine, strategy):
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=1)
    if strategy == "laspec":
        from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel

        torch.manual_seed(0)
        drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    else:
        drafter = build_drafter("llama", target, "copy")
    expected = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    out = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                          spec_strategy=strategy, spec_config=CONFIGS[strategy], return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert fresh_machine["measure"] == 0 and fresh_machine["build"] == 0
    if cpu_linear._cpu_supported() is None and cpu_linear._mode() == "auto":
        assert fresh_machine["background"] == 1  # compiled out of the call's way
    assert out.spec_stats.time_setup >= out.spec_stats.time_profile >= 0.0
    # the rounds measured the prior curve: the next call starts from their figures
    (profile,) = cost_store._MEMORY.values()
    assert profile.source == "rounds"


def test_prepare_measures_ahead_and_calls_then_read_it(fresh_machine, monkeypatch):
    monkeypatch.setattr(cpu_linear, "enabled", lambda wait=False: False)  # the kernel is tested on its own
    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    result = hf_adaptive_spec.prepare(target, drafter, batch_sizes=(1, 2))
    assert fresh_machine["measure"] == 2 and [p["batch_size"] for p in result["profiles"]] == [1, 2]
    assert all(p.source == "measured" for p in cost_store._MEMORY.values()) and len(cost_store._MEMORY) == 2
    stored = list((cost_store._cost_dir()).glob("*.json"))
    assert len(stored) == 2
    monkeypatch.setattr(cost_store, "_MEMORY", {})  # a new process: read from disk, never measured again
    for batch_size in (1, 2):
        inputs = make_inputs("llama", batch_size=batch_size)
        target.generate(**inputs, max_new_tokens=8, do_sample=False, assistant_model=drafter, spec_strategy="sage",
                        spec_config={"verify_cost": True})
    assert fresh_machine["measure"] == 2


def test_prepare_waits_for_the_kernel(monkeypatch):
    waited = []
    monkeypatch.setattr(cpu_linear, "enabled", lambda wait=False: waited.append(wait) or False)
    monkeypatch.setattr(cost_store, "_MEMORY", {})
    monkeypatch.setattr(cost_store, "_store", lambda profile, use_disk=True: cost_store._MEMORY.__setitem__(profile.key, profile))
    target = build_model("llama")
    hf_adaptive_spec.prepare(target, build_drafter("llama", target, "small"))
    assert waited[0] is True


def test_a_prior_curve_takes_its_level_from_the_first_round():
    prior = cost.prior_profile("cpu", key="k")
    assert prior.source == "prior" and prior.seconds[0] == 1.0
    model = cost.CostModel(prior, max_tokens=8, device="cpu")
    from test_cost import _tree

    tree = _tree([-1, 0, 1], [1.0, 0.9, 0.6])
    model.observe(tree, torch.tensor([[11, 12, 0]]), round_seconds=0.03, tokens=torch.tensor(3),
                  verify_seconds=0.02)
    assert float(model.seconds_per_token) == pytest.approx(0.01)
    assert model.scale * prior.time(3) == pytest.approx(0.02)
    assert cost.refine_profile(prior, {3: [0.02] * 8}, use_disk=False).source == "rounds"  # replaced, however close


def test_cold_worker_times_first_calls_and_checks_outputs(monkeypatch, tmp_path):
    """The fresh-process worker of `bench --cold` (here in-process, on tiny models): every call timed, outputs
    checked against plain, prepare run before the warmed call."""
    import argparse
    from types import SimpleNamespace

    from hf_adaptive_spec.bench import run as bench
    from hf_adaptive_spec.bench import cold

    monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_store, "_MEMORY", {})
    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    inputs = make_inputs("llama", batch_size=1)
    monkeypatch.setattr(bench, "load_on_device", lambda name, args, role: (target if role == "target" else drafter,
                                                                           SimpleNamespace(pad_token_id=0)))
    monkeypatch.setattr(bench, "encode_prompt", lambda tokenizer, messages, device: inputs)
    monkeypatch.setattr(cpu_linear, "enabled", lambda wait=False: False)
    args = argparse.Namespace(target="t", drafter="d", drafter_int8=False, threads=None, max_new_tokens=12,
                              device="cpu", dtype="float32")
    record = cold._worker({"args": vars(args), "strategy": "sage", "spec_config": {"verify_cost": True},
                           "prompt": {"id": "p0", "messages": []}})
    assert [call["call"] for call in record["calls"]] == ["plain 1", "sage 1", "sage 2", "sage 3", "plain 2",
                                                         "sage warmed"]
    assert record["same_as_plain"] and record["first_vs_plain"] > 0 and record["third_vs_warmed"] > 0
    table = cold.cold_table({"records": [record]})
    assert table.count("\n") == 3 and "| sage |" in table
