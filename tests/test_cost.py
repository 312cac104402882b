"""The verifier cost profile and the marginal-cost rule (hf_adaptive_spec.cost)."""

import gc
import json

import pytest
import torch

from hf_adaptive_spec import SageConfig, cost
from hf_adaptive_spec.cost import model as cost_model
from hf_adaptive_spec.cost import store as cost_store
from hf_adaptive_spec.adapters.compat import output_cache
from hf_adaptive_spec.cost import AcceptanceCalibrator, CostModel, CostProfile, choose_nodes, choose_prefix, survival
from hf_adaptive_spec.cost.pauses import DraftingPauses
from hf_adaptive_spec.adapters.runner import ModelRunner
from hf_adaptive_spec.trees import DraftTree
from tiny_models import build_drafter, build_model, make_inputs


def _tree(parents, probs, tokens=None):
    parents = torch.tensor([parents])
    n = parents.shape[1]
    probs = torch.tensor([probs], dtype=torch.float32)
    depths = torch.zeros_like(parents)
    for i in range(1, n):
        depths[0, i] = depths[0, parents[0, i]] + 1
    return DraftTree(
        tokens=torch.tensor([tokens]) if tokens is not None else torch.arange(n)[None] + 10,
        parents=parents, valid=torch.ones_like(parents, dtype=torch.bool), probs=probs, cum_probs=probs,
        depths=depths, drafter_slot=torch.full_like(parents, -1), num_levels=int(depths.max()),
    )


def _rows(*trees):
    """One batch of the same-shaped single-row trees."""
    return DraftTree(**{name: torch.cat([getattr(tree, name) for tree in trees]) for name in
                        ("tokens", "parents", "valid", "probs", "cum_probs", "depths", "drafter_slot")},
                     num_levels=max(tree.num_levels for tree in trees))


def test_profile_interpolates_and_extends():
    profile = CostProfile(sizes=[1, 2, 4, 8], seconds=[1.0, 1.0, 2.0, 4.0])
    assert profile.time(0) == 0.0
    assert profile.time(3) == pytest.approx(1.5)
    assert profile.time(6) == pytest.approx(3.0)
    assert profile.time(10) == pytest.approx(5.0)  # last slope 0.5 per token
    assert profile.table(4).tolist() == pytest.approx([0.0, 1.0, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError, match="ascending"):
        CostProfile(sizes=[2, 1], seconds=[1.0, 1.0])
    with pytest.raises(ValueError, match="positive"):
        CostProfile(sizes=[1], seconds=[0.0])


def test_choose_prefix_skips_the_expensive_middle_of_a_step_curve():
    # a CPU-like curve: flat to 3 tokens, a jump at 4, flat again to 16
    table = torch.tensor([0.0] + [1.0] * 3 + [2.0] * 13)
    # one row, 12 nodes; a confident chain (pi 0.95^d)
    pi = torch.tensor([[1.0] + [0.95 ** d for d in range(1, 13)]])
    keep, n = choose_prefix(pi, table, seconds_per_token=1.0)
    # n=2: gain 0.95+0.90=1.85, cost 1 -> 0.85; n=12: gain ~8.9, cost 2 -> ~6.9 (anything from 3 to 11 is worse)
    assert n == 12 and bool(keep.all())
    # an unsure chain: keep what fits in the flat part
    pi = torch.tensor([[1.0] + [0.5 ** d for d in range(1, 13)]])
    keep, n = choose_prefix(pi, table, seconds_per_token=1.0)
    assert n == 2
    assert keep[0].tolist() == [True, True, True] + [False] * 10


def test_choose_prefix_keeps_ancestors_and_shares_n_across_the_batch():
    pi = torch.tensor([[1.0, 0.9, 0.1, 0.8, 0.05], [1.0, 0.2, 0.2, 0.1, 0.0]])
    table = torch.tensor([0.0, 1.0, 1.1, 1.2, 1.3, 1.4])
    keep, n = choose_prefix(pi, table, seconds_per_token=1.0)
    # summed gain of the n best per row: n=1: 1.1, n=2: 1.1+0.8+0.2 = 2.1 ... marginal cost 0.1 per token
    assert n == 3
    assert keep[0].tolist() == [True, True, True, True, False]
    assert keep[1].tolist() == [True, True, True, True, False]  # pi 0 (padding) never kept


def test_survival_multiplies_along_paths():
    tree = _tree([-1, 0, 0, 1, 3], [1.0, 0.5, 0.4, 0.5, 0.5])
    pi = survival(tree, tree.probs)
    assert pi[0].tolist() == pytest.approx([1.0, 0.5, 0.4, 0.25, 0.125])


def test_calibrator_learns_from_verified_nodes():
    calibrator = AcceptanceCalibrator(num_bins=4, prior_weight=1.0)
    tree = _tree([-1, 0, 0], [1.0, 0.9, 0.9], tokens=[5, 6, 7])
    before = float(calibrator(torch.tensor(0.9)))
    for _ in range(20):  # the target always chooses 7 after the root: node 1 is wrong, node 2 right
        calibrator.observe(tree, torch.tensor([[7, 0, 0]]))
    assert before == pytest.approx(0.875)
    assert float(calibrator(torch.tensor(0.9))) == pytest.approx((0.875 + 20) / 41)


def test_one_rows_calibration_on_host_lists_equals_the_tensor_path():
    """`CostModel.observe` of one CPU row counts on host lists the cells the calibrators' tensor `observe` counts
    (drafter bins, lookup codes with and without the drafter's agreement), bin edges included."""
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, 0.05, 0.1, 0.35, 0.5, 0.95, 1.0, 0.15, 0.45])  # exact multiples of 1 / 20 and near
    for case in range(200):
        size = int(torch.randint(2, 12, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, size)]
        probs = torch.where(torch.rand(size, generator=gen) < 0.3, edges[torch.randint(0, len(edges), (size,),
                                                                                       generator=gen)],
                            torch.rand(size, generator=gen)).tolist()
        tree = _tree(parents, probs, tokens=torch.randint(0, 3, (size,), generator=gen).tolist())
        if case % 2:
            tree.lookup = torch.where(torch.rand(1, size, generator=gen) < 0.5,
                                      torch.randint(1, 40, (1, size), generator=gen), 0)
        choice = torch.randint(0, 3, (1, size), generator=gen)
        host = CostModel(CostProfile(sizes=[1, 8], seconds=[0.01, 0.02]), max_tokens=16, device="cpu")
        tensors = CostModel(CostProfile(sizes=[1, 8], seconds=[0.01, 0.02]), max_tokens=16, device="cpu")
        host.observe(tree, choice, 0.1, torch.tensor(2))
        tensors.calibrator.observe(tree, choice)
        tensors.lookup_calibrator.observe(tree, choice)
        for mine, theirs in ((host.calibrator, tensors.calibrator), (host.lookup_calibrator, tensors.lookup_calibrator)):
            assert torch.equal(mine.total, theirs.total) and torch.equal(mine.accepted, theirs.accepted), case


def test_subset_keeps_structure():
    tree = _tree([-1, 0, 0, 1, 2, 3], [1.0, 0.9, 0.5, 0.8, 0.4, 0.7])
    keep = torch.tensor([[True, True, False, True, False, True]])
    sub = tree.subset(keep)
    assert sub.tokens[0].tolist() == [10, 11, 13, 15]
    assert sub.parents[0].tolist() == [-1, 0, 1, 2]
    assert sub.depths[0].tolist() == [0, 1, 2, 3]
    assert sub.num_levels == 3


def test_a_rows_prefix_subset_equals_the_gathered_one():
    """One row keeping its first m nodes takes views; any kept set equals the gathering path (a batch of the row
    twice), field by field, prefixes and not."""
    gen = torch.Generator().manual_seed(1)
    prefixes = 0
    for case in range(200):
        size = int(torch.randint(1, 10, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, size)]
        tree = _tree(parents, torch.rand(size, generator=gen).tolist())
        if case % 2:
            tree.lookup = torch.randint(0, 3, (1, size), generator=gen)
        keep = [True] + [bool(torch.rand(1, generator=gen) < 0.7) for _ in range(1, size)]
        for node in range(1, size):  # closed under ancestors
            keep[node] = keep[node] and keep[parents[node]]
        if case % 3 == 0:  # a prefix
            m = int(torch.randint(1, size + 1, (1,), generator=gen))
            keep = [node < m for node in range(size)]
        prefixes += keep == sorted(keep, reverse=True)
        one = tree.subset(torch.tensor([keep]))
        both = _rows(tree, tree)
        both.lookup = None if tree.lookup is None else tree.lookup.repeat(2, 1)
        two = both.subset(torch.tensor([keep, keep]))
        for name in ("tokens", "parents", "valid", "probs", "cum_probs", "depths", "drafter_slot", "lookup"):
            a, b = getattr(one, name), getattr(two, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b[:1])), (case, name)
        assert one.num_levels == two.num_levels
    assert prefixes > 60


def test_measured_profile_leaves_the_cache_unchanged_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_store, "_MEMORY", {})
    target = build_model("qwen2")
    inputs = make_inputs("qwen2", batch_size=2)
    out = target(**inputs, use_cache=True)
    cache = output_cache(out)
    keys = [layer.keys.clone() for layer in cache.layers]
    position_ids = torch.arange(inputs["input_ids"].shape[1]).expand(2, -1)
    runner = ModelRunner(target, cache, inputs["attention_mask"].bool(), position_ids)
    profile = cost.verifier_cost_profile(runner, sizes=(1, 2, 4), repeats=1, measure=True)
    assert profile.sizes == [1, 2, 4] and all(s > 0 for s in profile.seconds)
    # batch 2 through the lean forward: rows of different sizes run packed, so the width alone is timed too
    assert runner.lean and profile.width_sizes == [1, 2, 4] and profile.width_seconds[0] == profile.seconds[0]
    assert all(torch.equal(a, layer.keys) for a, layer in zip(keys, cache.layers))
    files = list((tmp_path / "_verifier_cost").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"] == profile.key
    monkeypatch.setattr(cost_store, "_MEMORY", {})
    monkeypatch.setattr(cost_store, "measure_verifier_cost", lambda *a, **k: pytest.fail("should read the disk copy"))
    assert cost.verifier_cost_profile(runner, sizes=(1, 2, 4)).seconds == profile.seconds


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_cost_rule_trims_trees_and_output_stays_exact(arch, monkeypatch):
    target = build_model(arch)
    drafter = build_drafter(arch, target, "copy")
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    # verifying more than 2 new tokens (root + 1 draft) costs 100 steps: only one draft token can pay
    steep = CostProfile(sizes=[1, 2, 3], seconds=[1.0, 1.0, 100.0])
    config = SageConfig(d_min=4, d_max=4, w_min=1, w_max=2, n_max=8, theta_scale=0.0, verify_cost=True, plan=False)
    out = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                          spec_strategy="sage", spec_config=config, return_dict_in_generate=True,
                          spec_calibration=cost.SpecCalibration(steep))
    assert torch.equal(out.sequences, expected)
    stats = out.spec_stats
    assert stats.drafted_tokens <= stats.row_rounds  # at most one draft node per row and round
    assert stats.pruned_tokens > 0
    # a flat curve keeps whole trees (the copy drafts with the target's own float weights: every draft accepted)
    flat = CostProfile(sizes=[1, 64], seconds=[1.0, 1.0])
    out = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                          spec_strategy="sage", spec_config=config, return_dict_in_generate=True,
                          spec_calibration=cost.SpecCalibration(flat), spec_runtime={"compact_weights": False})
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.mean_accepted_length == pytest.approx(5.0, abs=0.6)


def test_a_row_without_draft_nodes_adds_no_gain_to_the_batch():
    """Two rows, the same confident chain: with both drafted, two draft nodes pay for T(3) - T(1); when one row
    has no valid node (a finished row drafts nothing), only the other's gain counts and one node is all that
    pays."""
    chain = _tree([-1, 0, 1], [1.0, 0.9, 0.9])
    tree = _rows(chain, chain)
    # T(2) - T(1) = 0.5 s, T(3) - T(2) = 1.0 s at 1 s per token: node a pays for one row (pi 0.9 > 0.5), node b
    # (pi 0.81) pays only when two rows gain it (1.62 > 1.0)
    model = CostModel(CostProfile(sizes=[1, 2, 3], seconds=[1.0, 1.5, 2.5]), max_tokens=8, device="cpu",
                      live_scale=False)
    model.seconds_per_token = torch.tensor(1.0)
    keep, n = model.prune(tree)
    assert int(n) == 2 and keep.all()
    tree.valid[0, 1:] = False
    keep, n = model.prune(tree)
    assert int(n) == 1
    assert keep.tolist() == [[True, False, False], [True, True, False]]


def test_cost_model_tracks_seconds_per_token():
    model = CostModel(CostProfile(sizes=[1], seconds=[2.0]), max_tokens=8, device="cpu", smoothing=0.5)
    assert float(model.seconds_per_token) == 2.0
    tree = _tree([-1, 0], [1.0, 0.9])
    model.observe(tree, torch.tensor([[11, 0]]), round_seconds=2.0, tokens=torch.tensor(2))
    assert float(model.seconds_per_token) == pytest.approx(1.5)
    model.observe(tree, torch.tensor([[11, 0]]), round_seconds=9.0, tokens=torch.tensor(0))  # nothing produced
    assert float(model.seconds_per_token) == pytest.approx(1.5)


def test_measured_verification_times_rescale_the_profile():
    """A profile measured when the machine was 4x slower prices nodes as the machine is now once rounds are timed."""
    slow = CostProfile(sizes=[1, 2, 3], seconds=[4.0, 4.0, 8.0])  # 4x what a forward costs now
    tree = _tree([-1, 0, 1], [1.0, 0.9, 0.6])  # root -> a -> b
    model = CostModel(slow, max_tokens=8, device="cpu", smoothing=0.5)
    model.seconds_per_token = torch.tensor(1.5)  # live: 1.5 s per token
    # b's pi ~ 0.9 * 0.6 ~ 0.55 does not pay T(3) - T(2) = 4 s at 1.5 s/token (2.7 tokens)
    assert int(model.prune(tree)[1]) == 1
    for _ in range(12):  # the loop measures forwards over these 3 tokens at 2 s (profile: 8 s)
        model.observe(tree, torch.tensor([[11, 12, 0]]), round_seconds=3.0, tokens=torch.tensor(2),
                      verify_seconds=2.0)
    assert model.scale == pytest.approx(0.25, rel=1e-3)
    model.seconds_per_token = torch.tensor(1.5)
    assert int(model.prune(tree)[1]) == 2  # T(3) - T(2) is now 1 s: b pays
    fixed = CostModel(slow, max_tokens=8, device="cpu", live_scale=False)  # e.g. a GPU: host times are launches
    fixed.observe(tree, torch.tensor([[11, 12, 0]]), 3.0, torch.tensor(2), verify_seconds=2.0)
    assert fixed.scale == 1.0
    assert CostModel(slow, max_tokens=8, device="cpu").live_scale
    assert not CostModel(slow, max_tokens=8, device="meta").live_scale


def _record_cost_models(monkeypatch) -> list:
    """Every `CostModel` the loop makes from now on, in order."""
    made = []
    original = CostModel.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(CostModel, "__init__", init)
    return made


@pytest.mark.measured_cost
def test_calibration_is_kept_across_generate_calls_only_by_the_callers_object(tmp_path, monkeypatch):
    """What the cost rule learned (acceptance per bin, lookup acceptance, live scale) carries over to the next
    call only through a `SpecCalibration` the caller passes, per drafter and setting; without one every call
    starts from the priors; `reset` forgets; another profile's scale starts fresh."""
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_CACHE", str(tmp_path))  # curves the rounds correct are kept there
    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    inputs = make_inputs("llama", batch_size=1)
    made = _record_cost_models(monkeypatch)
    config = SageConfig(verify_cost=True)
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)

    def spec(**kwargs):
        out = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=kwargs.pop("drafter", drafter),
                              spec_strategy="sage", spec_config=config, **kwargs)
        assert torch.equal(out, expected)
        return made[-1]

    prior = float(AcceptanceCalibrator().total.sum())
    alone = [spec(), spec()]  # no object: nothing persists
    assert alone[0].calibration is not alone[1].calibration
    assert float(alone[1].calibrator.total.sum()) > prior  # it learned within its call, from the priors

    calibration = cost.SpecCalibration()
    first, second = spec(spec_calibration=calibration), spec(spec_calibration=calibration)
    assert second.calibrator is first.calibrator and second.calibration is first.calibration
    seen = float(first.calibrator.total.sum())
    assert seen > float(alone[1].calibrator.total.sum())  # the verified nodes of both calls
    assert first.scale != 1.0  # the prior curve's level is arbitrary: real forwards set it
    assert calibration.settings() == [f"sage|{first.profile.key}"]
    second_drafter = build_drafter("llama", target, "small")
    other = spec(spec_calibration=calibration, drafter=second_drafter)
    assert other.calibrator is not first.calibrator and len(calibration.settings()) == 2
    del second_drafter, other, made[-1]
    gc.collect()
    assert len(calibration.settings()) == 1  # a drafter's entries go with the drafter
    calibration.reset()
    assert calibration.settings() == [] and spec(spec_calibration=calibration).calibrator is not first.calibrator
    scale = first.scale
    fresh = CostModel(CostProfile(sizes=[1], seconds=[2.0]), max_tokens=8, device="cpu", calibration=first.calibration)
    assert fresh.scale == 1.0 and fresh.calibrator is first.calibrator and scale != 1.0


def test_a_fixed_cost_profile_follows_no_timing(tmp_path, monkeypatch):
    """`SpecCalibration(cost_profile=...)`: the rule prices on that curve as given, rounds cost their size's time on
    it (not their measured time), the curve is never rescaled, and drafting is neither priced by time nor paused;
    so two calls verify the same nodes. `HF_ADAPTIVE_SPEC_COST_PROFILE` gives it to calls without one."""
    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    inputs = make_inputs("llama", batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    curve = CostProfile(sizes=[1, 2, 3, 8], seconds=[1.0, 1.2, 1.6, 4.0])
    made = _record_cost_models(monkeypatch)
    runs = []
    for _ in range(2):
        out = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                              spec_strategy="sage", spec_config={"verify_cost": True}, return_dict_in_generate=True,
                              spec_calibration=cost.SpecCalibration(curve))
        assert torch.equal(out.sequences, expected)
        model = made[-1]
        assert model.profile is curve and not model.live_scale and model.scale == 1.0 and not model.observed
        assert float(model.seconds_per_token) >= 1.0 / 8  # priced from the curve: no round takes a second here
        runs.append((out.spec_stats.drafted_tokens, out.spec_stats.pruned_tokens, out.spec_stats.rounds))
    assert runs[0] == runs[1]
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"sizes": [1, 4], "seconds": [2.0, 3.0]}))
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_PROFILE", str(path))
    assert cost.SpecCalibration.from_env().cost_profile.seconds == [2.0, 3.0]
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_PROFILE", "flat")
    target.generate(**inputs, max_new_tokens=4, assistant_model=drafter, spec_strategy="sage",
                    spec_config={"verify_cost": True})
    assert made[-1].profile.seconds == [1.0, 1.0] and not made[-1].live_scale
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_PROFILE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="HF_ADAPTIVE_SPEC_COST_PROFILE"):
        cost.SpecCalibration.from_env()
    with pytest.raises(TypeError, match="CostProfile"):
        cost.SpecCalibration(cost_profile=[1.0])


def test_spec_calibration_is_checked():
    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    inputs = make_inputs("llama", batch_size=1)
    with pytest.raises(ValueError, match="SpecCalibration"):
        target.generate(**inputs, max_new_tokens=2, assistant_model=drafter, spec_strategy="sage",
                        spec_calibration={})
    with pytest.raises(ValueError, match="spec_calibration is for speculative calls"):
        target.generate(**inputs, max_new_tokens=2, spec_calibration=cost.SpecCalibration())


@pytest.mark.measured_cost
def test_a_tokens_price_follows_the_batch_size():
    """t_token is kept per batch size: a batch that grows from one row to four prices a token at the four-row
    profile's T(1) / 4 (not at the one-row rounds' rate, several times higher, which made every node look worth
    verifying), and a size seen before takes up its own rate again."""
    one = CostProfile(sizes=[1, 2], seconds=[0.4, 0.2])  # one row: torch's slower one-row product
    four = CostProfile(sizes=[1, 2], seconds=[0.2, 0.25])
    model = CostModel(one, max_tokens=8, device="cpu", rows=1, smoothing=1.0)
    assert float(model.seconds_per_token) == pytest.approx(0.4)
    tree = _tree([-1, 0], [1.0, 0.9])
    model.observe(tree, torch.tensor([[11, 0]]), round_seconds=0.6, tokens=torch.tensor(2))
    assert float(model.seconds_per_token) == pytest.approx(0.3)
    model.use_profile(four, rows=4)  # three requests join
    assert float(model.seconds_per_token) == pytest.approx(0.05)
    model.observe(tree, torch.tensor([[11, 0]]), round_seconds=0.48, tokens=torch.tensor(8))
    assert float(model.seconds_per_token) == pytest.approx(0.06)
    model.use_profile(one, rows=1)  # they leave
    assert float(model.seconds_per_token) == pytest.approx(0.3)
    model.use_profile(four, rows=4)
    assert float(model.seconds_per_token) == pytest.approx(0.06)


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_paused_rounds_keep_the_output_exact(arch, monkeypatch):
    from hf_adaptive_spec.drafters.laspec import LaSpecDrafterConfig, LaSpecDrafterModel

    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    torch.manual_seed(0)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=3)).eval()
    calls = []
    monkeypatch.setattr(DraftingPauses, "pause_drafting", lambda self, active_rows=None: calls.append(1) or len(calls) % 2 == 0)
    out = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.paused_rounds == len(calls) // 2 > 0


@pytest.mark.parametrize("pattern", ["alternate", "streaks"])
@pytest.mark.parametrize("strategy", ["sage", "chain"])
def test_an_independent_drafter_catches_up_after_paused_rounds(strategy, pattern, monkeypatch):
    """Paused rounds run no drafter forward: their bonus tokens wait, and the next drafted round's first forward
    runs them as one chain. Outputs equal plain greedy whether pauses alternate or run several rounds long."""
    from hf_adaptive_spec.drafters.independent import IndependentDrafter

    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=3, prompt_lengths=[5, 9, 3])
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    drafter = build_drafter("llama", target, "small")
    calls, widths = [], []
    # alternate: paused every other round; streaks: five paused rounds, then one drafted
    paused = (lambda n: n % 2 == 0) if pattern == "alternate" else (lambda n: n % 6 != 0)
    monkeypatch.setattr(DraftingPauses, "pause_drafting",
                        lambda self, active_rows=None: calls.append(1) or paused(len(calls)))
    original = IndependentDrafter.draft

    def draft(self, *args, **kwargs):
        widths.append(self.pending.shape[1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(IndependentDrafter, "draft", draft)
    config = {"verify_cost": True} if strategy == "sage" else {"verify_cost": True, "adaptive": False}
    out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                          spec_strategy=strategy, spec_config=config, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.paused_rounds > 0
    assert max(widths) >= (2 if pattern == "alternate" else 6)  # the waiting tokens ran in one forward


@pytest.mark.parametrize("alpha_source, pauses", [("current_root", True), ("previous_root", False)])
def test_sage_pauses_only_when_each_round_plans_itself(alpha_source, pauses):
    from hf_adaptive_spec.strategies.sage import SageConfig, SageStrategy

    strategy = SageStrategy(SageConfig(alpha_source=alpha_source).resolve(torch.device("cpu")), 1, torch.device("cpu"))
    assert strategy.may_pause is pauses


def test_rounds_correct_a_profile_that_disagrees_with_them(tmp_path, monkeypatch):
    """A curve measured while the machine was busy (here 4x too slow, and 9x at 3 tokens) is corrected from the
    forwards rounds time, in memory and on disk; one that agrees with them is left as it is."""
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_store, "_MEMORY", {})
    busy = CostProfile(sizes=[1, 2, 4, 8], seconds=[4.0, 4.0, 8.0, 8.0], key="test|busy")
    observed = {1: [1.0] * 4, 3: [0.6] * 3, 8: [2.0]}  # T(3) profiled at 6 s, measured 0.6 s
    refined = cost.refine_profile(busy, observed)
    assert refined.sizes == [1, 2, 3, 4, 8]
    assert refined.seconds == pytest.approx([1.0, 1.0, 0.6, 2.0, 2.0])  # x0.25 (median ratio), 3 measured
    assert cost_store._MEMORY["test|busy"] is refined
    (stored,) = (tmp_path / "_verifier_cost").glob("*.json")
    assert json.loads(stored.read_text()) == refined.to_dict()
    assert cost.refine_profile(refined, {1: [1.1] * 5, 3: [0.55] * 3}) is refined  # agrees within 25%
    assert cost.refine_profile(busy, {1: [1.0] * 4}) is busy  # too few forwards to judge


@pytest.mark.measured_cost
def test_generate_refines_the_stored_profile(tmp_path, monkeypatch):
    """The loop feeds its verification times back: a stored profile 1000x slower than this machine (seconds
    where forwards take milliseconds) is replaced after one call."""
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_store, "_MEMORY", {})
    slow = CostProfile(sizes=[1, 2, 4, 8, 16], seconds=[5.0, 5.0, 6.0, 7.0, 8.0], key="test|slow")
    monkeypatch.setattr("hf_adaptive_spec.decoding.loop.verifier_cost_profile",
                        lambda runner: cost_store._MEMORY.get(slow.key, slow))
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=1)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=build_drafter("llama", target, "copy"),
                          spec_strategy="chain", spec_config={"verify_cost": True, "num_draft_tokens": 1,
                                                              "adaptive": False})
    assert torch.equal(out, expected)
    refined = cost_store._MEMORY[slow.key]
    assert refined is not slow and max(refined.seconds) < 1.0
    assert list((tmp_path / "_verifier_cost").glob("*.json"))


def test_a_packed_batch_gives_an_easy_and_a_hard_row_their_own_sizes():
    """A forward that runs each row's real tokens only costs its tokens plus its width: the rule takes the nodes
    of all rows in one order of pi, so a confident row verifies a deep chain and a hopeless one its root alone
    (the shared count of a padded forward gives both the same); a steep width curve shortens the deep row; a
    flat chain curve keeps every node; ties keep each row closed under ancestors."""
    pi = torch.tensor([[1.0, 0.9, 0.85, 0.8, 0.75], [1.0, 0.05, 0.02, 0.01, 0.005]])
    chain = torch.tensor([0.0] + [1.0 + 0.1 * (n - 1) for n in range(1, 12)], dtype=torch.float64)  # T(n), B = 2
    flat_width = torch.tensor([0.0] + [1.0] * 11, dtype=torch.float64)
    # one more node in one row: +0.05 s (half a token per row); at 0.5 s per token a node pays from pi 0.1
    keep, counts = choose_nodes(pi, chain, flat_width, 0.5)
    assert counts.tolist() == [4, 0] and keep.tolist() == [[True] * 5, [True] + [False] * 4]
    shared, n = choose_prefix(pi, chain, 0.5)
    assert int(n) == 4 and shared.all()  # the padded rule: both rows pay for the widest, so both verify 4
    # a width of 4 or more costs 1.3 s more than the tokens in it: the deep row stops at 2 nodes (W = 3)
    steeper = torch.tensor([0.0] + [1.0 + 0.5 * (n - 1) for n in range(1, 12)], dtype=torch.float64)
    steep_width = torch.tensor([0.0, 1.0, 1.0, 1.1, 2.4, 2.9] + [3.4] * 6, dtype=torch.float64)
    assert choose_nodes(pi, steeper, steep_width, 0.5)[1].tolist() == [2, 0]
    assert choose_nodes(pi, steeper, flat_width, 0.5)[1].tolist() == [4, 0]  # the same tokens, width free
    flat = torch.tensor([0.0] + [1.0] * 11, dtype=torch.float64)
    assert choose_nodes(pi, flat, flat_width, 0.5)[1].tolist() == [4, 4]
    tied = torch.tensor([[1.0, 0.5, 0.5, 0.5, 0.5], [1.0, 0.5, 0.5, 0.5, 0.5]])  # a chain of equal pi per row
    jump = torch.tensor([0.0, 1.0, 1.05, 2.0] + [3.0] * 8, dtype=torch.float64)  # two nodes pay, a third not
    keep, counts = choose_nodes(tied, jump, flat_width, 0.11)
    assert counts.tolist() == [2, 0] and keep[0].tolist() == [True, True, True, False, False]


def test_the_cost_model_prices_rows_apart_only_for_a_packed_forward_with_a_width_curve():
    """`CostModel(packed=True)` with a profile that has a width curve: per-row counts (`choose_nodes`), and a
    verified block priced by its real tokens and width; without either: the shared count, priced by width."""
    easy = _tree([-1, 0, 1, 2], [1.0, 0.95, 0.95, 0.95])
    hard = _tree([-1, 0, 1, 2], [1.0, 0.05, 0.05, 0.05])
    measured = CostProfile(sizes=[1, 2, 4], seconds=[1.0, 1.1, 1.3], width_sizes=[1, 4], width_seconds=[1.0, 1.0])
    packed = CostModel(measured, max_tokens=8, device="cpu", live_scale=False, rows=2, packed=True)
    packed.seconds_per_token = torch.tensor(0.5)
    batch = _rows(easy, hard)
    keep, counts = packed.prune(batch)
    assert counts.tolist() == [3, 0]
    # 5 of 8 slots real: x = 2.5 tokens a row, T(2.5) = 1.1 + 0.5 * (T(3) - T(2)) = 1.15, the width curve flat
    assert packed.block_seconds(batch.subset(keep)) == pytest.approx(1.15)
    assert packed.block_seconds(batch) == pytest.approx(measured.time(4))  # a full block: the chain curve itself
    padded = CostModel(measured, max_tokens=8, device="cpu", live_scale=False, rows=2, packed=False)
    padded.seconds_per_token = torch.tensor(0.5)
    assert padded.prune(batch)[0].all()
    no_width = CostModel(CostProfile(sizes=[1, 2, 4], seconds=[1.0, 1.1, 1.3]), max_tokens=8, device="cpu",
                         live_scale=False, rows=2, packed=True)
    no_width.seconds_per_token = torch.tensor(0.5)
    assert no_width.width_table is None and no_width.prune(batch)[0].all()
    with pytest.raises(ValueError, match="width"):
        CostProfile(sizes=[1], seconds=[1.0], width_sizes=[1, 2], width_seconds=None)


def _laspec_drafter(target):
    from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel

    torch.manual_seed(3)
    return LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()


@pytest.mark.parametrize("strategy", ["sage", "laspec"])
def test_rows_of_one_batch_verify_their_own_sizes_and_stay_exact(strategy, monkeypatch):
    """Batch 3, rows of different lengths, a fixed curve with a width curve (packed verification): the rule gives
    rows different counts in some round, and every row equals plain greedy."""
    arch = "llama"
    target = build_model(arch)
    drafter = build_drafter(arch, target, "small") if strategy == "sage" else _laspec_drafter(target)
    inputs = make_inputs(arch, batch_size=3, prompt_lengths=[4, 15, 9], with_image=False)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    counts_seen = []
    original = cost.choose_nodes
    monkeypatch.setattr(cost_model, "choose_nodes", lambda *a: counts_seen.append(original(*a)[1]) or original(*a))
    curve = CostProfile(sizes=[1, 2, 8], seconds=[1.0, 1.15, 1.9], width_sizes=[1, 8], width_seconds=[1.0, 1.1])
    out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                          spec_strategy=strategy, spec_config={"verify_cost": True},
                          spec_calibration=cost.SpecCalibration(curve))
    assert torch.equal(out, expected)
    assert counts_seen and any(len(set(counts.tolist())) > 1 for counts in counts_seen)




def test_threads_storing_one_curve_never_leave_a_partial_file(tmp_path, monkeypatch, often_switching):
    """Threads that store the same key at once (calls sharing a target refine its curve as they end) each write a
    file of their own and move it into place: every read of the stored file parses, and the last one stored is
    whole (one temporary file per process, shared by its threads, let a writer truncate what another had just
    moved into place)."""
    import threading

    monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_CACHE", str(tmp_path))
    profiles = [CostProfile(sizes=list(range(1, 200)), seconds=[0.01 * (i + k) for k in range(1, 200)], key="shared",
                            source="measured") for i in range(4)]
    path = cost_store._profile_path("shared")
    bad, done = [], threading.Event()

    def write(profile):
        for _ in range(150):
            cost_store._store(profile)

    def read():
        while not done.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError:
                bad.append(len(text))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(profile,)) for profile in profiles]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    reader.join()
    assert not bad, f"{len(bad)} partial reads"
    assert json.loads(path.read_text())["seconds"] in [p.seconds for p in profiles]
    assert not list(tmp_path.glob("*.tmp"))
