"""Drafting is priced: an independent drafter expands a level only while it pays for the drafter forward and the
verification it adds (`cost.DraftPricing`). On fixed synthetic costs: free drafting drafts what the strategy
shapes, expensive drafting one level, an always-right drafter as deep as the strategy's cap; output stays exact."""

from __future__ import annotations

import pytest
import torch

from hf_adaptive_spec.cost import CostModel, CostProfile, DraftPricing
from hf_adaptive_spec.drafters.independent import IndependentDrafter
from hf_adaptive_spec.strategies import SageConfig, SageStrategy
from tiny_models import build_drafter, build_model, make_inputs

FLAT = CostProfile(sizes=[1, 64], seconds=[1.0, 1.0])  # verification costs the same at any size


def _tree(pricing, config=None, batch_size=2):
    target = build_model("llama")
    drafter = IndependentDrafter(build_drafter("llama", target, "copy"))
    inputs = make_inputs("llama", batch_size=batch_size)
    drafter.prefill(inputs["input_ids"], inputs["attention_mask"], {})
    drafter.set_pending(torch.full((batch_size, 1), 9), torch.ones(batch_size, 1, dtype=torch.bool))
    config = (config or SageConfig(d_min=3, d_max=8, w_min=1.0, w_max=2.0, n_max=20, theta_scale=0.0,
                                   verify_cost=True)).resolve("cpu")
    strategy = SageStrategy(config, batch_size, torch.device("cpu"))
    with torch.no_grad():
        tree = drafter.draft(strategy, None, torch.full((batch_size,), 20), pricing=pricing)
    return tree, strategy


def _pricing(accept: float, draft_seconds: float, profile=FLAT):
    cost = CostModel(profile, max_tokens=64, device="cpu")
    cost.seconds_per_token = torch.tensor(1.0)
    calibrator = cost.calibrator
    calibrator.total[:] = 1000.0
    calibrator.accepted[:] = 1000.0 * accept  # every drafter probability: accepted with this chance
    return DraftPricing(cost, draft_seconds=lambda width: draft_seconds)


def test_free_drafting_drafts_what_the_strategy_shapes():
    unpriced, _ = _tree(None)
    priced, _ = _tree(_pricing(accept=0.05, draft_seconds=0.0))
    assert torch.equal(priced.tokens, unpriced.tokens) and torch.equal(priced.parents, unpriced.parents)
    assert unpriced.num_levels > 1


def test_expensive_drafting_stops_after_one_level():
    pricing = _pricing(accept=0.9, draft_seconds=100.0)  # a drafter forward costs 100 tokens' time
    tree, _ = _tree(pricing)
    assert tree.num_levels == 1 and pricing.stopped_levels == 1
    assert bool((tree.drafter_slot[:, 1:] < 0).all())  # nothing of the last level was run by the drafter


def test_an_always_right_drafter_goes_as_deep_as_the_cap():
    unpriced, strategy = _tree(None)
    sure = _pricing(accept=0.999, draft_seconds=0.3)  # a level costs 0.3 tokens' time and adds ~1 token
    tree, _ = _tree(sure)
    assert tree.num_levels == unpriced.num_levels == int(strategy.depth().max())
    unsure = _pricing(accept=0.2, draft_seconds=0.3)  # the same cost, a drafter right 1 time in 5
    assert _tree(unsure)[0].num_levels < unpriced.num_levels


@pytest.mark.parametrize("free_tokens", [2, 3])
def test_verification_cost_counts_too(free_tokens):
    """Verifying more than `free_tokens` tokens (root included) costs 50 steps: the level that would add the
    next token is not drafted, even when drafting is free and the drafter always right."""
    sizes = list(range(1, free_tokens + 2)) + [64]
    seconds = [1.0] * free_tokens + [50.0, 50.0]
    pricing = _pricing(accept=0.999, draft_seconds=0.0, profile=CostProfile(sizes=sizes, seconds=seconds))
    chain = SageConfig(d_min=3, d_max=8, w_min=1.0, w_max=1.0, n_max=20, theta_scale=0.0, verify_cost=True)
    tree, _ = _tree(pricing, chain, batch_size=1)
    assert tree.num_levels == free_tokens - 1


@pytest.mark.measured_cost  # drafting is priced by this machine's timings: only the tree's size depends on them
@pytest.mark.parametrize("batch_size", [1, 2])
def test_priced_drafting_keeps_generate_exact(batch_size, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_CACHE", str(tmp_path))
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=batch_size)
    expected = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    for drafter in (build_drafter("llama", target, "copy"), build_drafter("llama", target, "small")):
        out = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                              spec_strategy="sage", spec_config={"verify_cost": True}, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
