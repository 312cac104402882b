"""The step API between the decoding loop and whatever drives rounds itself (`integration.open_run`,
`Decoding.prefill_result / step / join / leave / close`), the one resolved `SpecRequest`, and each row's own
random generator: a run stepped by hand equals `generate`, a seeded sampled request gives the same tokens whatever
shares its batch, and the serving engine works through the public step API alone."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_adaptive_spec.decoding import integration
from hf_adaptive_spec.decoding.randomness import RowRandom
from hf_adaptive_spec.decoding.request import resolve_request
from hf_adaptive_spec.drafters.laspec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.serving import engine as engine_module
from hf_adaptive_spec.serving.engine import Engine, Request
from tiny_models import build_drafter, build_model, make_inputs, split_rows

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [3, 21, 7, 14, 5, 18]
NEW_TOKENS = [16, 5, 24, 9, 16, 3]
STRATEGIES = ["plain", "chain", "static_tree", "sage", "laspec"]


def _drafter(target, strategy: str):
    if strategy == "plain":
        return None
    if strategy == "laspec":
        torch.manual_seed(0)
        return LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    return build_drafter("llama", target, "small")


def _rows(arch: str = "llama") -> list[dict]:
    return split_rows(arch, make_inputs(arch, batch_size=len(LENGTHS), prompt_lengths=LENGTHS, with_image=False))


def _plain(target, row: dict, max_new_tokens: int) -> list:
    out = target.generate(**row, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, row["input_ids"].shape[1]:].tolist()


def _open(target, request, row: dict, max_new_tokens: int, **kwargs):
    return integration.open_run(target, request, **row, max_new_tokens=max_new_tokens, **kwargs)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_runs_stepped_joined_and_left_by_hand_equal_generate(strategy):
    """Two prefilled runs joined into one batch, stepped, and their finished rows made to leave: every row equals
    plain `generate` of its prompt alone; each step says which tokens each row got and why a row ended."""
    target = build_model("llama")
    request = resolve_request(target, strategy, assistant_model=_drafter(target, strategy), light_trace=True)
    rows = _rows()
    expected = [_plain(target, row, n) for row, n in zip(rows, NEW_TOKENS)]
    runs = [_open(target, request, row, n) for row, n in zip(rows, NEW_TOKENS)]
    got = [run.prefill_result.new_tokens()[0] for run in runs]
    batch, owners = runs[0], [0]
    for index, run in enumerate(runs[1:], start=1):
        batch.join(run)
        run.close()
        owners.append(index)
    reasons = {}
    while owners:
        result = batch.step()
        for owner, tokens, reason in zip(owners, result.new_tokens(), result.finish_reasons()):
            got[owner].extend(tokens)
            if reason is not None:
                reasons[owner] = reason
        leaving = [row for row, owner in enumerate(owners) if owner in reasons]
        if len(leaving) == len(owners):
            break
        if leaving:
            batch.leave(leaving)
            owners = [owner for owner in owners if owner not in reasons]
    batch.close()
    assert got == expected
    eos = target.generation_config.eos_token_id
    assert reasons == {i: "stop" if tokens[-1] == eos else "length" for i, tokens in enumerate(got)}


def test_leave_and_open_run_refuse_what_they_cannot_do():
    target = build_model("llama")
    request = resolve_request(target, "chain", assistant_model=build_drafter("llama", target, "small"))
    rows = _rows()
    run = _open(target, request, rows[1], 8)
    other = _open(target, request, rows[3], 8)
    run.join(other)
    other.close()
    with pytest.raises(ValueError, match="positions in the batch of 2"):
        run.leave([2])
    with pytest.raises(ValueError, match="close the run instead"):
        run.leave([0, 1])
    run.close()
    with pytest.raises(ValueError, match="spec_strategy"):
        integration.open_run(target, request, **rows[0], spec_strategy="sage")
    with pytest.raises(TypeError, match="a call's own fields"):
        request.for_call(strategy="sage")


def test_a_request_is_resolved_and_checked_once_for_every_caller():
    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    with pytest.raises(ValueError, match="needs a drafter"):
        resolve_request(target, "sage")
    with pytest.raises(ValueError, match="drafts nothing"):
        resolve_request(target, "plain", assistant_model=drafter)
    with pytest.raises(ValueError, match="Unknown spec_strategy"):
        resolve_request(target, "beam")
    with pytest.raises(ValueError, match="SpecCalibration"):
        resolve_request(target, "sage", assistant_model=drafter, calibration={"x": 1})
    request = resolve_request(target, "sage", spec_config={"n_max": 6}, assistant_model=drafter)
    assert request.config.n_max == 6 and request.config_for(torch.device("cpu")) is request.config
    # the engine holds the request it resolved; every run it opens reads that one
    engine = Engine(target, drafter, strategy="sage", spec_config={"n_max": 6})
    assert engine.spec.config.n_max == 6


def _sample_alone_and_beside_others(strategy: str, seed: int, max_batch: int) -> tuple[list, list]:
    """Request 0 (seeded) served alone, then beside other sampled requests joining in waves."""
    target = build_model("llama")
    drafter = _drafter(target, strategy)
    rows = _rows()
    alone_engine = Engine(target, drafter, strategy=strategy, max_batch=max_batch).start()
    try:
        alone = alone_engine.submit(Request(input_ids=rows[0]["input_ids"][0], max_new_tokens=24, temperature=1.0,
                                            seed=seed)).result(timeout=120)
    finally:
        alone_engine.stop()
    engine = Engine(target, drafter, strategy=strategy, max_batch=max_batch).start()
    try:
        started = threading.Event()
        others = [engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=n, temperature=1.3,
                                        seed=100 + i), on_tokens=lambda tokens: started.set())
                  for i, (row, n) in enumerate(zip(rows[1:3], NEW_TOKENS[1:3]))]
        assert started.wait(120)  # request 0 joins a running batch
        mine = engine.submit(Request(input_ids=rows[0]["input_ids"][0], max_new_tokens=24, temperature=1.0,
                                     seed=seed))
        others += [engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=n, temperature=0.8, seed=i))
                   for i, (row, n) in enumerate(zip(rows[3:], NEW_TOKENS[3:]))]
        beside = mine.result(timeout=120)
        for handle in others:
            handle.result(timeout=120)
    finally:
        engine.stop()
    return alone, beside


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_seeded_sampled_request_gives_the_same_tokens_whatever_shares_its_batch(strategy):
    alone, beside = _sample_alone_and_beside_others(strategy, seed=7, max_batch=4)
    assert alone == beside
    other_seed, _ = _sample_alone_and_beside_others(strategy, seed=8, max_batch=1)
    assert other_seed != alone  # the seed is what decides the draws (24 tokens of a 256-token vocabulary)


def test_row_draws_depend_on_the_row_alone():
    """Per-row generators: a row's uniform, categorical and exponential draws are the same whatever the other
    rows need (how many draws, how wide their frontier)."""
    def random_for(seeds):
        return RowRandom(rows=[torch.Generator().manual_seed(seed) for seed in seeds])

    probs = torch.softmax(torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0)), -1)
    narrow = torch.tensor([[True, False, False, False], [True, True, False, False], [False] * 4])
    wide = torch.tensor([[True, False, False, False], [True] * 4, [True] * 4])
    a, b = random_for([1, 2, 3]), random_for([1, 9, 3])
    assert torch.equal(a.exponential(probs, narrow)[0], b.exponential(probs, wide)[0])
    only_first = torch.tensor([True, False, False])
    assert a.uniform(only_first)[0] == b.uniform(torch.ones(3, dtype=torch.bool))[0]
    assert a.categorical(probs[:, 0], only_first)[0] == b.categorical(probs[:, 0], torch.ones(3, dtype=torch.bool))[0]
    shared = RowRandom(shared=None)
    with pytest.raises(ValueError, match="own generators"):
        a.join(shared)


class _PublicOnly:
    """A run that exposes the step API alone: any other attribute is an error naming it."""

    API = frozenset({"prefill_result", "step", "join", "leave", "close"})

    def __init__(self, run):
        object.__setattr__(self, "_run", run)

    def __getattr__(self, name):
        if name not in self.API:
            raise AssertionError(f"the engine read Decoding.{name}, which is not part of the step API")
        value = getattr(object.__getattribute__(self, "_run"), name)
        if name == "join":
            return lambda other: value(object.__getattribute__(other, "_run"))
        return value

    def __setattr__(self, name, value):
        raise AssertionError(f"the engine set Decoding.{name}")


@pytest.mark.parametrize("strategy", ["chain", "laspec"])
def test_the_engine_drives_runs_through_the_step_api_alone(monkeypatch, strategy):
    target = build_model("llama")
    drafter = _drafter(target, strategy)
    monkeypatch.setattr(engine_module, "open_run",
                        lambda *args, **kwargs: _PublicOnly(integration.open_run(*args, **kwargs)))
    rows = _rows()
    expected = [_plain(target, row, n) for row, n in zip(rows, NEW_TOKENS)]
    engine = Engine(target, drafter, strategy=strategy, max_batch=3).start()
    try:
        handles = [engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=n))
                   for row, n in zip(rows, NEW_TOKENS)]
        sampled = engine.submit(Request(input_ids=rows[0]["input_ids"][0], max_new_tokens=8, temperature=1.0,
                                        seed=3))
        results = [handle.result(timeout=120) for handle in handles]
        assert len(sampled.result(timeout=120)) >= 1
        stats = engine.stats()
    finally:
        engine.stop()
    assert results == expected
    assert stats["errors"] == 0 and stats["finished"] == len(rows) + 1
    assert sum(stats["verified_nodes"].values()) == stats["row_rounds"]
