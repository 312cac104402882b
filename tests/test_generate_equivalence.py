"""Speculative greedy output == plain greedy `generate()` output, token for token.

Drafters: a copy of the target (everything accepted), an adversarial one
(nothing accepted) and an ordinary small one; text models and VLMs with
images; batch 1 and batch 2 with different prompt lengths.
"""

import copy

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_adaptive_spec import ChainConfig, SageConfig, StaticTreeConfig
from tiny_models import ARCHS, TEXT_ARCHS, VLM_ARCHS, build_drafter, build_model, make_inputs

STRATEGIES = ("chain", "static_tree", "sage")
MAX_NEW = 20

_MODELS = {}


def _target(arch):
    if arch not in _MODELS:
        _MODELS[arch] = build_model(arch)
    return _MODELS[arch]


def _inverted_drafter(target):
    """A copy whose logits are negated: its top candidates are the target's least likely tokens."""
    drafter = copy.deepcopy(target)
    head = drafter.get_output_embeddings()
    head.weight.data.neg_()
    return drafter


def _plain(model, inputs, **kwargs):
    return model.generate(**inputs, do_sample=False, max_new_tokens=kwargs.pop("max_new_tokens", MAX_NEW), **kwargs)


def _spec(model, inputs, drafter, strategy, **kwargs):
    return model.generate(
        **inputs, do_sample=False, max_new_tokens=kwargs.pop("max_new_tokens", MAX_NEW), assistant_model=drafter,
        spec_strategy=strategy, return_dict_in_generate=True, **kwargs,
    )


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("arch", ARCHS)
def test_small_drafter_matches_plain_greedy(arch, strategy, batch_size):
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=batch_size)
    drafter = build_drafter(arch, target, "small")
    expected = _plain(target, inputs)
    out = _spec(target, inputs, drafter, strategy)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.rounds >= 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl", "llava_onevision"])
def test_copy_drafter_accepts_everything(arch, strategy):
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=2)
    config = {
        "chain": ChainConfig(num_draft_tokens=4, adaptive=False),
        "static_tree": StaticTreeConfig(paths=[(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)]),
        "sage": SageConfig(d_min=4, d_max=4, w_min=1, w_max=2, n_max=8, theta_scale=0.0, adaptive_history=False,
                          verify_cost=False),
    }[strategy]
    drafter = build_drafter(arch, target, "copy")
    expected = _plain(target, inputs, max_new_tokens=31)
    out = _spec(target, inputs, drafter, strategy, spec_config=config, max_new_tokens=31)
    assert torch.equal(out.sequences, expected)
    stats = out.spec_stats
    # depth 4 fully accepted each round: 1 + 6 rounds x 5 tokens = 31 new tokens per row
    assert stats.accepted_tokens == 4 * stats.row_rounds
    assert stats.mean_accepted_length == pytest.approx(5.0)
    assert stats.rounds == 6


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("arch", ["llama", "qwen3_vl"])
def test_inverted_drafter_accepts_nothing(arch, strategy):
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=2)
    expected = _plain(target, inputs)
    out = _spec(target, inputs, _inverted_drafter(target), strategy)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.accepted_tokens == 0
    assert out.spec_stats.mean_accepted_length == pytest.approx(1.0)
    assert out.spec_stats.rounds == MAX_NEW - 1


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_text_only_drafter_for_a_vlm(arch):
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=2)
    expected = _plain(target, inputs)
    out = _spec(target, inputs, build_drafter(arch, target, "text"), "sage")
    assert torch.equal(out.sequences, expected)


def test_vlm_drafter_sees_the_image():
    """The copy drafter of a VLM only accepts everything if its prefill got the image too."""
    arch = "qwen2_vl"
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=1)
    config = ChainConfig(num_draft_tokens=4, adaptive=False)
    out = _spec(target, inputs, build_drafter(arch, target, "copy"), "chain", spec_config=config)
    assert out.spec_stats.acceptance_rate == pytest.approx(1.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("batch_size", [1, 2])
def test_eos_inside_an_accepted_path(strategy, batch_size):
    arch = "llama"
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=batch_size)
    free = _plain(target, inputs, max_new_tokens=24)
    prompt_length = inputs["input_ids"].shape[1]
    eos = int(free[0, prompt_length + 6])  # a token row 0 emits mid-way (with a copy drafter: mid-path)
    expected = _plain(target, inputs, max_new_tokens=24, eos_token_id=eos)
    out = _spec(target, inputs, build_drafter(arch, target, "copy"), strategy, max_new_tokens=24, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    assert expected.shape[1] < free.shape[1] or batch_size > 1
    row0 = out.sequences[0, prompt_length:].tolist()
    assert row0.index(eos) == free[0, prompt_length:].tolist().index(eos)


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nothing_below_a_drafted_eos_is_drafted_or_verified(monkeypatch, strategy, do_sample):
    """A drafted EOS ends its path: an independent drafter never expands it, and nothing below one reaches the
    target (an accepted EOS ends the row, a rejected one the path); greedy output == plain greedy."""
    from hf_adaptive_spec.decoding.loop import Decoding
    from hf_adaptive_spec.drafters.independent import IndependentDrafter

    target = _target("llama")
    inputs = make_inputs("llama", batch_size=2)
    prompt_length = inputs["input_ids"].shape[1]
    free = _plain(target, inputs, max_new_tokens=24)
    eos = int(free[0, prompt_length + 3])  # depth 3 of the first round's tree: every strategy drafts below it
    assert eos not in free[0, prompt_length : prompt_length + 3].tolist()
    drafted, verified = [], []
    draft, verify = IndependentDrafter.draft, Decoding._verify

    def recording_draft(self, *args, **kwargs):
        tree = draft(self, *args, **kwargs)
        drafted.append(tree)
        return tree

    def recording_verify(self, tree):
        verified.append(tree)
        return verify(self, tree)

    monkeypatch.setattr(IndependentDrafter, "draft", recording_draft)
    monkeypatch.setattr(Decoding, "_verify", recording_verify)
    # sampling near T = 0: the copy drafter still drafts row 0's EOS mid-path (the check below is not vacuous)
    kwargs = {"do_sample": True, "temperature": 0.05, "top_k": 0} if do_sample else {"do_sample": False}
    if strategy == "chain":  # a fixed chain of 8: the EOS at depth <= 7 has nodes below it unless they are cut
        kwargs["spec_config"] = {"adaptive": False, "num_draft_tokens": 8, "max_draft_tokens": 8}
    out = target.generate(**inputs, max_new_tokens=24, eos_token_id=eos, assistant_model=build_drafter(
        "llama", target, "copy"), spec_strategy=strategy, return_dict_in_generate=True, **kwargs)
    if not do_sample:
        assert torch.equal(out.sequences, _plain(target, inputs, max_new_tokens=24, eos_token_id=eos))
    stop = torch.tensor([[eos]] * 2)
    drafted_eos = [t for t in drafted if bool(((t.tokens == eos) & t.valid)[:, 1:].any())]
    assert drafted_eos  # the copy drafter drafts row 0's EOS mid-path
    for tree in drafted:  # never expanded: no drafter node below an EOS
        assert tree.below_stop(stop) is None
    for tree in verified:
        assert tree.below_stop(stop) is None


def test_below_stop_marks_every_descendant_of_a_drafted_stop_token():
    from hf_adaptive_spec.trees import DraftTree

    # row 0: root 5 -> 7 -> 2 (stop) -> 8 -> 9, and 7 -> 4; row 1: root 2 (committed, not drafted) -> 3 -> 2 (leaf)
    tokens = torch.tensor([[5, 7, 2, 4, 8, 9], [2, 3, 2, 0, 0, 0]])
    parents = torch.tensor([[-1, 0, 1, 1, 2, 4], [-1, 0, 1, -1, -1, -1]])
    valid = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    depths = torch.tensor([[0, 1, 2, 2, 3, 4], [0, 1, 2, 0, 0, 0]])
    ones = torch.ones(2, 6)
    tree = DraftTree(tokens=tokens, parents=parents, valid=valid, probs=ones, cum_probs=ones, depths=depths,
                     drafter_slot=torch.full((2, 6), -1), num_levels=4)
    below = tree.below_stop(torch.tensor([[2, -1], [2, -1]]))
    assert below.tolist() == [[False, False, False, False, True, True], [False] * 6]
    assert tree.below_stop(torch.tensor([[6, -1], [6, -1]])) is None  # no such token
    assert tree.below_stop(torch.tensor([[9, -1], [2, -1]])) is None  # leaves, and row 1's root is committed
    kept = tree.subset(~below)
    assert kept.tokens[0, : int(kept.valid[0].sum())].tolist() == [5, 7, 2, 4]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_max_new_tokens_one(strategy):
    target = _target("qwen2")
    inputs = make_inputs("qwen2", batch_size=2)
    expected = _plain(target, inputs, max_new_tokens=1)
    out = _spec(target, inputs, build_drafter("qwen2", target, "small"), strategy, max_new_tokens=1)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.rounds == 0 and out.spec_stats.new_tokens == 2


class _Recorder:
    def __init__(self):
        self.chunks, self.ended = [], 0

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_streamer_gets_every_token_once(strategy):
    arch = "qwen2_vl"
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=1)
    plain_streamer, spec_streamer = _Recorder(), _Recorder()
    expected = _plain(target, inputs, streamer=plain_streamer)
    out = _spec(target, inputs, build_drafter(arch, target, "copy"), strategy, streamer=spec_streamer)
    assert torch.equal(out.sequences, expected)
    streamed = torch.cat([c.reshape(-1) for c in spec_streamer.chunks])
    assert torch.equal(streamed, out.sequences[0])  # the prompt first, then each new token once
    assert spec_streamer.ended == 1
    assert any(c.numel() > 1 for c in spec_streamer.chunks[1:])  # several tokens per round


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_logits_processors_apply_per_node(strategy):
    arch = "llama"
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=2)
    kwargs = dict(repetition_penalty=1.8, no_repeat_ngram_size=2, min_new_tokens=5, max_new_tokens=24)
    expected = _plain(target, inputs, **kwargs)
    plain_without = _plain(target, inputs, max_new_tokens=24)
    assert not torch.equal(expected, plain_without)  # the processors matter here
    out = _spec(target, inputs, build_drafter(arch, target, "copy"), strategy, **kwargs)
    assert torch.equal(out.sequences, expected)


class _StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_custom_stopping_criteria_cut_exactly(strategy):
    arch = "llama"
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=1)
    free = _plain(target, inputs, max_new_tokens=24)
    stop_token = int(free[0, inputs["input_ids"].shape[1] + 9])
    criteria = StoppingCriteriaList([_StopAfterToken(stop_token)])
    expected = _plain(target, inputs, max_new_tokens=24, stopping_criteria=criteria)
    assert expected.shape[1] < free.shape[1]
    out = _spec(target, inputs, build_drafter(arch, target, "copy"), strategy, max_new_tokens=24,
                stopping_criteria=criteria)
    assert torch.equal(out.sequences, expected)


def test_output_scores_and_logits_match_plain():
    arch = "qwen2"
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=1)
    kwargs = dict(output_scores=True, output_logits=True, return_dict_in_generate=True, repetition_penalty=1.3)
    plain = _plain(target, inputs, **kwargs)
    out = _spec(target, inputs, build_drafter(arch, target, "copy"), "sage",
                output_scores=True, output_logits=True, repetition_penalty=1.3)
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == len(plain.scores) == MAX_NEW
    for mine, theirs in zip(out.scores + out.logits, plain.scores + plain.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_spec_stats_fields():
    target = _target("llama")
    inputs = make_inputs("llama", batch_size=1)
    out = _spec(target, inputs, build_drafter("llama", target, "small"), "sage")
    stats = out.spec_stats
    assert stats.new_tokens == MAX_NEW
    assert stats.target_forwards == stats.rounds + 1
    assert 1.0 <= stats.mean_accepted_length
    assert stats.accepted_tokens <= stats.drafted_tokens
    for name in ("time_draft", "time_tree", "time_verify", "time_accept", "time_compact"):
        assert getattr(stats, name) > 0.0
    assert set(stats.to_dict()) >= {"rounds", "new_tokens", "mean_accepted_length", "drafted_tokens",
                                    "accepted_tokens", "time_draft", "time_verify"}


@pytest.mark.parametrize("arch", TEXT_ARCHS)
def test_eager_attention(arch):
    target = build_model(arch, attn_implementation="eager")
    inputs = make_inputs(arch, batch_size=2)
    expected = _plain(target, inputs)
    out = _spec(target, inputs, build_drafter(arch, target, "small"), "static_tree")
    assert torch.equal(out.sequences, expected)


def test_custom_logits_processor_sees_node_prefixes():
    """A user processor is called with each node's own prefix, one length per call."""
    seen_lengths = []

    class Recorder:
        def __call__(self, input_ids, scores):
            seen_lengths.append(input_ids.shape[1])
            return scores

    target = _target("llama")
    inputs = make_inputs("llama", batch_size=1)
    expected = _plain(target, inputs)
    out = _spec(target, inputs, build_drafter("llama", target, "copy"), "static_tree",
                logits_processor=LogitsProcessorList([Recorder()]))
    assert torch.equal(out.sequences, expected)
    prompt_length = inputs["input_ids"].shape[1]
    assert min(seen_lengths) == prompt_length and max(seen_lengths) > prompt_length + 1


def _caches(plain, out):
    from hf_adaptive_spec.adapters.compat import output_cache

    return output_cache(plain), output_cache(out)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_returned_cache_is_plain_generates(arch, strategy, batch_size):
    """Same length as plain generate's cache (`sequences` but the last token) and the same keys and values."""
    target = _target(arch)
    inputs = make_inputs(arch, batch_size=batch_size)
    plain = _plain(target, inputs, return_dict_in_generate=True)
    out = _spec(target, inputs, build_drafter(arch, target, "small"), strategy)
    assert torch.equal(out.sequences, plain.sequences) and out.spec_stats.rounds > 1
    theirs, mine = _caches(plain, out)
    assert mine is not None and mine.get_seq_length() == theirs.get_seq_length() == out.sequences.shape[1] - 1
    for a, b in zip(theirs.layers, mine.layers):
        torch.testing.assert_close(b.keys, a.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.values, a.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("batch_size", [1, 2])
def test_returned_cache_continues_like_plain_greedy(strategy, batch_size):
    from hf_adaptive_spec.adapters.compat import cache_argument

    target = _target("llama")
    inputs = make_inputs("llama", batch_size=batch_size)
    expected = _plain(target, inputs, max_new_tokens=MAX_NEW + 8)
    out = _spec(target, inputs, build_drafter("llama", target, "copy"), strategy)
    sequences = out.sequences
    mask = torch.cat([inputs["attention_mask"], torch.ones_like(sequences[:, inputs["input_ids"].shape[1]:])], 1)
    _, cache = _caches(out, out)
    more = target.generate(input_ids=sequences, attention_mask=mask, do_sample=False, max_new_tokens=8,
                           **{cache_argument(target): cache})
    assert torch.equal(more, expected)


def test_returned_cache_of_rows_that_end_early():
    """A row that stops before the longest keeps its committed slots; from its last token on it holds zeros (plain
    generate keeps stepping it on pad tokens)."""
    target = _target("llama")
    inputs = make_inputs("llama", batch_size=2)
    prompt_length = inputs["input_ids"].shape[1]
    eos = int(_plain(target, inputs)[0, prompt_length + 5])
    plain = _plain(target, inputs, eos_token_id=eos, return_dict_in_generate=True)
    out = _spec(target, inputs, build_drafter("llama", target, "small"), "sage", eos_token_id=eos)
    assert torch.equal(out.sequences, plain.sequences)
    theirs, mine = _caches(plain, out)
    assert mine.get_seq_length() == theirs.get_seq_length() == out.sequences.shape[1] - 1
    end = prompt_length + out.sequences[0, prompt_length:].tolist().index(eos)  # row 0's last token
    assert end < out.sequences.shape[1] - 1
    for a, b in zip(theirs.layers, mine.layers):
        torch.testing.assert_close(b.keys[0, :, :end], a.keys[0, :, :end], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.keys[1], a.keys[1], atol=1e-4, rtol=1e-4)
        assert not b.keys[0, :, end:].any() and not b.values[0, :, end:].any()


def test_returned_cache_without_rounds_and_under_sampling():
    target = _target("qwen2")
    inputs = make_inputs("qwen2", batch_size=2)
    drafter = build_drafter("qwen2", target, "small")
    out = _spec(target, inputs, drafter, "sage", max_new_tokens=1)
    plain = _plain(target, inputs, max_new_tokens=1, return_dict_in_generate=True)
    theirs, mine = _caches(plain, out)
    assert out.spec_stats.rounds == 0
    assert mine.get_seq_length() == theirs.get_seq_length() == inputs["input_ids"].shape[1]
    torch.manual_seed(0)
    sampled = target.generate(**inputs, do_sample=True, max_new_tokens=MAX_NEW, assistant_model=drafter,
                              spec_strategy="sage", return_dict_in_generate=True)
    _, cache = _caches(sampled, sampled)
    assert cache.get_seq_length() == sampled.sequences.shape[1] - 1


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_returned_cache_of_a_sliding_window_model_continues_like_plain_generates(family):
    """Its sliding layers keep every slot (plain generate's keep the window); continuing gives the same tokens."""
    import tiny_families
    from hf_adaptive_spec.adapters.compat import cache_argument

    target = tiny_families.build(family)
    inputs = tiny_families.make_inputs(family, batch_size=1)
    plain = _plain(target, inputs, max_new_tokens=16, return_dict_in_generate=True)
    out = _spec(target, inputs, tiny_families.drafter(family, target, "small"), "sage", max_new_tokens=16)
    assert torch.equal(out.sequences, plain.sequences)
    theirs, mine = _caches(plain, out)
    assert mine.get_seq_length() == theirs.get_seq_length() == out.sequences.shape[1] - 1
    mask = torch.ones_like(out.sequences)
    continued = [target.generate(input_ids=out.sequences, attention_mask=mask, do_sample=False, max_new_tokens=8,
                                 **{cache_argument(target): cache}) for cache in (theirs, mine)]
    assert torch.equal(continued[0], continued[1])


def test_rows_that_end_early_draft_nothing_after(monkeypatch):
    """Once a row has emitted its end-of-sequence token it drafts nothing (depth limit 0) while the other row
    goes on (rows kept in the batch: `spec_runtime={"retire_rows": False}`, or processors that read a row's index); the output
    still equals plain greedy."""
    from hf_adaptive_spec.drafters.independent import IndependentDrafter

    target = _target("llama")
    inputs = make_inputs("llama", batch_size=2)
    prompt_length = inputs["input_ids"].shape[1]
    eos = int(_plain(target, inputs)[0, prompt_length + 5])
    plain = _plain(target, inputs, eos_token_id=eos)
    assert eos not in plain[1, prompt_length:-1].tolist()  # row 1 runs to the token limit
    limits = []
    draft = IndependentDrafter.draft

    def recording(self, strategy, process, max_depth, *args, **kwargs):
        limits.append(max_depth.tolist())
        return draft(self, strategy, process, max_depth, *args, **kwargs)

    monkeypatch.setattr(IndependentDrafter, "draft", recording)
    out = _spec(target, inputs, build_drafter("llama", target, "small"), "sage", eos_token_id=eos,
                spec_runtime={"retire_rows": False})
    assert torch.equal(out.sequences, plain)
    finished_at = next(i for i, (row0, _) in enumerate(limits) if row0 == 0)
    assert all(row0 == 0 for row0, _ in limits[finished_at:])
    assert any(row1 > 0 for _, row1 in limits[finished_at:])
