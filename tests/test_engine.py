"""The continuous-batching engine: each request's output equals what plain `generate` gives that request alone,
whatever joined or left the batch around it (greedy), for every strategy, text and image requests."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_adaptive_spec.cost.pauses import DraftingPauses
from hf_adaptive_spec.drafters.laspec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.serving.engine import Engine, EngineStopped, QueueFull, Request
from tiny_models import build_drafter, build_model, make_inputs, split_rows

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [3, 21, 7, 14, 5, 18, 9, 11]
NEW_TOKENS = [16, 5, 24, 9, 16, 3, 12, 20]
TIE = 1e-4


def _drafter(arch: str, target, strategy: str, gate: float = 0.0):
    if strategy == "plain":
        return None
    if strategy == "laspec":
        torch.manual_seed(0)
        drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
        with torch.no_grad():
            for layer in drafter.layers:
                layer.visual_gate.fill_(gate)
        return drafter
    return build_drafter(arch, target, "small")


def _requests(arch: str, with_image: bool = True) -> list[dict]:
    return split_rows(arch, make_inputs(arch, batch_size=len(LENGTHS), prompt_lengths=LENGTHS,
                                        with_image=with_image))


def _plain(target, row: dict, max_new_tokens: int, **kwargs) -> tuple[list, list]:
    """Plain greedy tokens of one request alone, and the top-2 logit gap at each step."""
    out = target.generate(**row, do_sample=False, max_new_tokens=max_new_tokens, output_logits=True,
                          return_dict_in_generate=True, **kwargs)
    gaps = [float(step[0].topk(2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, row["input_ids"].shape[1]:].tolist(), gaps


def _assert_same(got: list, plain: tuple, label: str) -> None:
    """Equal, or different only after a step where plain decoding itself is a numerical tie (top-2 gap < 1e-4)."""
    tokens, gaps = plain
    if got == tokens:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, tokens)) if a != b), min(len(got), len(tokens)))
    assert first < len(gaps) and gaps[first] < TIE, f"{label}: differs from plain at step {first}: {got} vs {tokens}"


def _submit_staggered(engine, rows, new_tokens, **request_kwargs):
    """Submit in three waves, each after the previous wave produced a token (rows join a running batch)."""
    handles = []
    for start in range(0, len(rows), 3):
        wave = []
        for row, count in zip(rows[start:start + 3], new_tokens[start:start + 3]):
            extra = {k: v for k, v in row.items() if k != "input_ids"}
            first = threading.Event()
            handle = engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=count, model_inputs=extra,
                                           **request_kwargs), on_tokens=lambda tokens, e=first: e.set())
            wave.append((handle, first))
        for handle, first in wave:
            assert first.wait(120)
        handles.extend(handle for handle, _ in wave)
    return handles


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
@pytest.mark.parametrize("strategy", ["plain", "chain", "static_tree", "sage", "laspec"])
def test_requests_that_join_and_leave_keep_every_output_exact(arch, strategy):
    target = build_model(arch)
    drafter = _drafter(arch, target, strategy)
    rows = _requests(arch)
    plain = [_plain(target, row, n) for row, n in zip(rows, NEW_TOKENS)]
    engine = Engine(target, drafter, strategy=strategy, max_batch=4).start()
    try:
        handles = _submit_staggered(engine, rows, NEW_TOKENS)
        results = [handle.result(timeout=120) for handle in handles]
        stats = engine.stats()
    finally:
        engine.stop()
    for i, (got, expected) in enumerate(zip(results, plain)):
        _assert_same(got, expected, f"{arch}/{strategy} request {i}")
    assert all(handle.finish_reason in ("length", "stop") for handle in handles)
    assert stats["finished"] == len(rows) and stats["running"] == 0 and stats["prefills"] == len(rows)
    assert stats["tokens"] + stats["prefills"] == sum(len(r) for r in results)


def test_image_and_text_requests_share_a_laspec_batch_with_a_live_visual_branch(monkeypatch):
    from hf_adaptive_spec.drafters.block import BlockDrafter

    joined_with_vision = []
    join = BlockDrafter.join

    def recording_join(self, other):
        join(self, other)
        joined_with_vision.append(self.uses_vision and self.visual_embeds is not None)

    monkeypatch.setattr(BlockDrafter, "join", recording_join)
    arch = "qwen2_vl"
    target = build_model(arch)
    drafter = _drafter(arch, target, "laspec", gate=0.5)
    image_rows, text_rows = _requests(arch), _requests(arch, with_image=False)
    rows = [image_rows[i] if i % 2 else text_rows[i] for i in range(len(LENGTHS))]
    plain = [_plain(target, row, n) for row, n in zip(rows, NEW_TOKENS)]
    engine = Engine(target, drafter, strategy="laspec", max_batch=3).start()
    try:
        results = [h.result(timeout=120) for h in _submit_staggered(engine, rows, NEW_TOKENS)]
    finally:
        engine.stop()
    for i, (got, expected) in enumerate(zip(results, plain)):
        _assert_same(got, expected, f"request {i}")
    assert any(joined_with_vision)  # the visual branch ran in a batch of joined rows


def test_each_request_keeps_its_own_stop_ids_and_limits():
    target = build_model("llama")
    rows = _requests("llama")
    # a stop id each request meets early: its plain output's third token
    stops = [_plain(target, row, 8)[0][2] for row in rows]
    plain = [_plain(target, row, n, eos_token_id=[target.generation_config.eos_token_id, stop])
             for row, n, stop in zip(rows, NEW_TOKENS, stops)]
    engine = Engine(target, build_drafter("llama", target, "small"), strategy="chain", max_batch=4).start()
    try:
        handles = [engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=n, stop_token_ids=(stop,)))
                   for row, n, stop in zip(rows, NEW_TOKENS, stops)]
        results = [h.result(timeout=120) for h in handles]
    finally:
        engine.stop()
    for i, (got, expected) in enumerate(zip(results, plain)):
        _assert_same(got, expected, f"request {i}")
        assert handles[i].finish_reason == ("stop" if got[-1] == stops[i] else "length")


def test_a_sampled_request_uses_its_own_processors_beside_others():
    """top_k=1 sampling is greedy: a request with it equals plain greedy although it shares its batch with requests
    sampling at temperature 1.5 (each row's logits processors apply to its rows only)."""
    target = build_model("llama")
    rows = _requests("llama")
    plain = [_plain(target, row, n) for row, n in zip(rows, NEW_TOKENS)]
    engine = Engine(target, build_drafter("llama", target, "small"), strategy="chain", max_batch=8).start()
    try:
        handles = [engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=n, temperature=1.5,
                                         top_k=1 if i % 2 == 0 else 0, seed=i))
                   for i, (row, n) in enumerate(zip(rows, NEW_TOKENS))]
        results = [h.result(timeout=120) for h in handles]
    finally:
        engine.stop()
    for i in range(0, len(rows), 2):
        _assert_same(results[i], plain[i], f"request {i}")
    for i in range(1, len(rows), 2):
        assert 1 <= len(results[i]) <= NEW_TOKENS[i]


def test_a_cancelled_request_leaves_and_the_others_stay_exact():
    target = build_model("llama")
    rows = _requests("llama")[:4]
    counts = [40, 12, 12, 12]
    plain = [_plain(target, row, n) for row, n in zip(rows, counts)]
    engine = Engine(target, build_drafter("llama", target, "small"), strategy="sage", max_batch=4).start()
    try:
        started = threading.Event()
        handles = [engine.submit(Request(input_ids=rows[0]["input_ids"][0], max_new_tokens=counts[0]),
                                 on_tokens=lambda tokens: started.set())]
        handles += [engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=n))
                    for row, n in zip(rows[1:], counts[1:])]
        assert started.wait(60)
        handles[0].cancel()
        results = [h.result(timeout=120) for h in handles]
        stats = engine.stats()
    finally:
        engine.stop()
    assert handles[0].finish_reason in ("cancelled", "length")  # it may have finished before the cancel arrived
    assert results[0] == plain[0][0][: len(results[0])]
    for i in range(1, 4):
        _assert_same(results[i], plain[i], f"request {i}")
    assert stats["running"] == 0


def test_the_batch_cache_narrows_when_its_oldest_rows_leave():
    """A long-lived batch does not grow without end: once the rows that joined first leave, the columns no row
    holds are dropped."""
    target = build_model("llama")
    rows = _requests("llama")
    engine = Engine(target, build_drafter("llama", target, "small"), strategy="chain", max_batch=2)
    engine.start()
    widths = []
    try:
        for round_trip in range(3):
            handles = [engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=6 + 6 * (i % 2)),
                                     on_tokens=lambda tokens: widths.append(_width(engine)))
                       for i, row in enumerate(rows)]
            for handle in handles:
                handle.result(timeout=120)
    finally:
        engine.stop()
    longest = max(LENGTHS) + 12 + 16  # a prompt, its tokens, one round's slack
    assert max(w for w in widths if w is not None) <= 2 * longest


def _width(engine):
    batch = engine._batches[False]
    return None if batch is None else batch.run.target.committed_length


def test_bad_requests_a_full_queue_and_a_stopped_engine_are_refused():
    target = build_model("llama")
    engine = Engine(target, None, strategy="plain", max_batch=1, max_queue=1)
    with pytest.raises(EngineStopped):
        engine.submit(Request(input_ids=[5, 6, 7]))
    for bad, match in [({"input_ids": []}, "empty"), ({"input_ids": [5], "max_new_tokens": 0}, "max_new_tokens"),
                       ({"input_ids": [5], "temperature": -1.0}, "temperature"),
                       ({"input_ids": [5], "top_p": 0.0}, "top_p"), ({"input_ids": [10 ** 6]}, "vocabulary"),
                       ({"input_ids": [5], "stop_token_ids": (-3,)}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=match):
            engine.submit(Request(**bad))
    with pytest.raises(ValueError, match="drafter"):
        Engine(target, None, strategy="chain")
    with pytest.raises(ValueError, match="drafts nothing"):
        Engine(target, build_drafter("llama", target, "small"), strategy="plain")
    with pytest.raises(ValueError, match="visual_selection='prefill'"):
        Engine(target, build_drafter("llama", target, "small"), strategy="sage",
               spec_config={"visual_tokens": 8, "visual_selection": "round"})
    engine.start()
    gate, started = threading.Event(), threading.Event()
    try:
        # the first request holds the only row, and the engine's thread, until `gate` opens (its callback waits)
        first = engine.submit(Request(input_ids=[5, 6, 7], max_new_tokens=8),
                              on_tokens=lambda tokens: (started.set(), gate.wait(60)))
        assert started.wait(60)
        waiting = engine.submit(Request(input_ids=[5, 6], max_new_tokens=2))
        with pytest.raises(QueueFull):
            engine.submit(Request(input_ids=[5], max_new_tokens=2))
        gate.set()
        first.result(timeout=60)
        waiting.result(timeout=60)
    finally:
        gate.set()
        engine.stop()
    with pytest.raises(EngineStopped):
        engine.submit(Request(input_ids=[5, 6, 7]))


def test_an_engine_without_a_calibration_prices_on_the_environments_fixed_curve(monkeypatch):
    """An engine's own calibration keeps pause verdicts across batches and, like a `generate` call without one,
    prices on the fixed curve `HF_ADAPTIVE_SPEC_COST_PROFILE` names (tests: flat, no timings followed)."""
    target = build_model("llama")
    drafter = _drafter("llama", target, "laspec")
    fixed = Engine(target, drafter, strategy="laspec").calibration
    assert fixed.keep_pauses and fixed.cost_profile is not None and fixed.cost_profile.seconds == [1.0, 1.0]
    monkeypatch.delenv("HF_ADAPTIVE_SPEC_COST_PROFILE")
    timed = Engine(target, drafter, strategy="laspec").calibration
    assert timed.keep_pauses and timed.cost_profile is None


@pytest.mark.measured_cost  # the timed cost rule, on the fake clock (the engine's worker thread reads it too)
def test_the_pause_verdicts_outlive_the_batches(monkeypatch):
    """The engine keeps whether drafting pays at each batch size across its batches (`keep_pauses`): a verdict
    learned in one batch (timings injected: drafted rounds slower than root-only ones) pauses the next batch of
    that size from its first round, after the first batch closed."""

    target = build_model("llama")
    drafter = _drafter("llama", target, "laspec")
    engine = Engine(target, drafter, strategy="laspec", max_batch=2).start()
    assert engine.calibration.keep_pauses and engine.calibration.cost_profile is None  # timed: no fixed curve set
    observed = DraftingPauses.observe_rate
    monkeypatch.setattr(DraftingPauses, "observe_rate",  # drafted: 2 s a token, root-only: 1 s
                        lambda self, drafted, seconds, tokens: observed(self, drafted, 2.0 if drafted else 1.0, 1))
    decisions = []
    decide = DraftingPauses.pause_drafting
    monkeypatch.setattr(DraftingPauses, "pause_drafting",
                        lambda self, active_rows=None: decisions.append(decide(self, active_rows)) or decisions[-1])
    row = _requests("llama", with_image=False)[1]
    first = engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=24))
    first.result(120)
    assert any(decisions)  # the first batch paused once its rates were measured
    states = engine.calibration.pauses(drafter, "laspec")
    assert states[1].pausing
    decisions.clear()
    second = engine.submit(Request(input_ids=row["input_ids"][0], max_new_tokens=6))
    assert second.result(120) == first.tokens[:6]
    engine.stop()
    assert decisions[0]  # a new batch of the same size: paused from its first round
