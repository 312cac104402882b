"""Rows that finished leave the batch between rounds (`retire_rows`): the output equals plain greedy row for row,
and what the call returns (sequences, scores, the target's cache, statistics) is laid out as without retirement."""

from __future__ import annotations

import pytest
import torch

from hf_adaptive_spec.drafters.laspec import LaSpecDrafterConfig, LaSpecDrafterModel
from tiny_models import build_drafter, build_model, make_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 16
LENGTHS = [3, 21, 7, 14, 5, 18]


def _laspec(target, gate: float = 0.0):
    torch.manual_seed(0)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    with torch.no_grad():
        for layer in drafter.layers:
            layer.visual_gate.fill_(gate)
    return drafter


def _early_eos(target, inputs):
    """An EOS that rows emit at different steps (so they finish, and leave, at different rounds): the token that
    most rows emit between their 3rd and their 12th."""
    width = inputs["input_ids"].shape[1]
    rows = target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)[:, width:].tolist()
    candidates = {token for row in rows for token in row[2: MAX_NEW - 4]}
    return max(sorted(candidates), key=lambda token: sum(token in row[: MAX_NEW - 4] for row in rows))


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
@pytest.mark.parametrize("strategy", ["chain", "static_tree", "sage", "laspec"])
def test_rows_that_leave_the_batch_keep_every_output_exact(arch, strategy):
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=len(LENGTHS), prompt_lengths=LENGTHS)
    eos = _early_eos(target, inputs)
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                            return_dict_in_generate=True, output_scores=True)
    drafter = _laspec(target, gate=0.5 if arch != "llama" else 0.0) if strategy == "laspec" else \
        build_drafter(arch, target, "small")
    runs = {}
    for retire in (True, False):
        out = target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                              assistant_model=drafter, spec_strategy=strategy, spec_runtime={"retire_rows": retire},
                              return_dict_in_generate=True, output_scores=True)
        assert torch.equal(out.sequences, plain.sequences), (strategy, retire)
        runs[retire] = out
    retired, kept = runs[True], runs[False]
    assert retired.spec_stats.retired_rows > 0 and kept.spec_stats.retired_rows == 0
    assert len(retired.scores) == len(kept.scores) == len(plain.scores)
    for ours, theirs in zip(retired.scores, kept.scores):  # rows that ended: zeros in both
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # the target's cache comes back laid out for every row, as without retirement
    for ours, theirs in zip(retired.cache.layers, kept.cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-4, rtol=1e-4)
    stats = retired.spec_stats
    assert len(stats.accepted_lengths) == stats.row_rounds
    assert stats.new_tokens == kept.spec_stats.new_tokens


def test_processors_that_read_the_row_index_keep_every_row():
    """`prefix_allowed_tokens_fn` sees each row's index in the batch: rows never leave, the output stays exact."""
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=3, prompt_lengths=[4, 12, 6])
    eos = _early_eos(target, inputs)

    def allowed(batch_id, ids):
        return list(range(8, 128)) if batch_id != 1 else list(range(8, 64)) + [eos]

    kwargs = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, prefix_allowed_tokens_fn=allowed)
    plain = target.generate(**inputs, **kwargs)
    out = target.generate(**inputs, **kwargs, assistant_model=build_drafter("llama", target, "small"),
                          spec_strategy="chain", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.spec_stats.retired_rows == 0


def test_retire_rows_is_a_checked_setting():
    from hf_adaptive_spec import RuntimeConfig

    with pytest.raises(TypeError, match="retire_rows"):
        RuntimeConfig(retire_rows="yes")
    assert RuntimeConfig(retire_rows=False).to_dict()["retire_rows"] is False


@pytest.mark.measured_cost  # the cost rule on this machine's curves: each smaller batch is priced on its own
@pytest.mark.parametrize("strategy", ["sage", "laspec"])
def test_the_cost_rule_prices_the_smaller_batch(strategy, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_CACHE", str(tmp_path))
    from hf_adaptive_spec.cost import CostModel

    keys = []
    original = CostModel.use_profile

    def use_profile(self, profile, rows):
        keys.append((profile.key, rows))
        original(self, profile, rows)

    monkeypatch.setattr(CostModel, "use_profile", use_profile)
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=len(LENGTHS), prompt_lengths=LENGTHS)
    eos = _early_eos(target, inputs)
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos)
    drafter = _laspec(target) if strategy == "laspec" else build_drafter("llama", target, "small")
    out = target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                          assistant_model=drafter, spec_strategy=strategy, spec_config={"verify_cost": True},
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.spec_stats.retired_rows > 0 and keys
    # a smaller batch's curve each time, and a token priced at its share of that batch's step
    assert all(f"batch{rows}|" in key and rows < len(LENGTHS) for key, rows in keys)


def test_sampled_rows_leave_the_batch_too():
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=len(LENGTHS), prompt_lengths=LENGTHS)
    eos = _early_eos(target, inputs)
    torch.manual_seed(0)
    out = target.generate(**inputs, do_sample=True, temperature=0.05, max_new_tokens=MAX_NEW, eos_token_id=eos,
                          assistant_model=build_drafter("llama", target, "small"), spec_strategy="sage",
                          return_dict_in_generate=True)  # nearly greedy: rows end at their EOS, at different rounds
    assert out.spec_stats.retired_rows > 0
    width = inputs["input_ids"].shape[1]
    for row in out.sequences[:, width:].tolist():  # each row: tokens up to its EOS, then padding only
        if eos in row:
            assert all(token == 0 for token in row[row.index(eos) + 1:])
