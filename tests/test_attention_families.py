"""Sliding-window, chunked, prefix-LM and windowed-VLM attention families: speculative == plain greedy, a tree
forward == each path from scratch, with prompts longer than the window; refusals name the property."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Qwen3NextConfig

import hf_adaptive_spec
from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.adapters import windows as windows_module
from hf_adaptive_spec.adapters.compat import check_model
from hf_adaptive_spec.drafters.independent import IndependentDrafter
import tiny_families as tf_
from test_tree_forward import PARENTS, _path

MAX_NEW = 14
STRATEGIES = ("chain", "static_tree", "sage")


pytestmark = pytest.mark.usefixtures("one_thread")


_MODELS = {}


def _model(family):
    if family not in _MODELS:
        _MODELS[family] = tf_.build(family)
    return _MODELS[family]


@pytest.mark.parametrize("kind", ["copy", "small", "text"])
@pytest.mark.parametrize("family", list(tf_.FAMILIES))
def test_speculative_equals_plain_greedy(family, kind):
    target = _model(family)
    drafter = tf_.drafter(family, target, kind)
    for batch_size in (1, 2):
        inputs = tf_.make_inputs(family, batch_size)
        assert inputs["attention_mask"].sum(-1).min() > tf_.WINDOW
        expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        for strategy in STRATEGIES:
            out = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter,
                                  spec_strategy=strategy, return_dict_in_generate=True)
            assert torch.equal(out.sequences, expected), (family, kind, batch_size, strategy)
            if kind == "copy" and strategy == "chain":  # the drafter agrees: paths cross the window edge
                assert out.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("family", list(tf_.FAMILIES))
def test_laspec_equals_plain_greedy(family):
    target = _model(family)
    torch.manual_seed(0)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    for batch_size in (1, 2):
        inputs = tf_.make_inputs(family, batch_size)
        expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        out = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter,
                              spec_strategy="laspec", spec_config={"verify_cost": False, "top_k": 3, "n_max": 10})
        assert torch.equal(out, expected), (family, batch_size)


def _scratch_logits(model, inputs, row, extra):
    """Last-position logits of row `row`'s bare prompt (image included) + `extra`, from scratch."""
    keep = inputs["attention_mask"][row].bool()
    ids = torch.cat([inputs["input_ids"][row, keep], torch.tensor(extra)])[None]
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "pixel_values" in inputs:
        kwargs["pixel_values"] = inputs["pixel_values"][row: row + 1]
        # generated tokens: text (Gemma 3, type 0), the causal suffix after PaliGemma's prefix (type 1)
        suffix = torch.full((len(extra),), int(model.config.model_type == "paligemma"), dtype=torch.long)
        token_types = torch.cat([inputs["token_type_ids"][row, keep], suffix])
        kwargs["token_type_ids"] = token_types[None]
    return model(**kwargs).logits[0, -1]


def _tree_logits(model, inputs, rounds, generator):
    """Tree forwards over a prefilled runner; each round commits the given accepted paths per row."""
    drafter = IndependentDrafter(model)
    raw = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    drafter.prefill(inputs["input_ids"], inputs["attention_mask"], raw)
    runner = drafter.runner
    history = [[] for _ in range(inputs["input_ids"].shape[0])]
    for accepted in rounds:
        tokens = torch.randint(8, 128, (len(history), len(PARENTS)), generator=generator)
        runner.forward(tokens, torch.tensor([PARENTS] * len(history)), torch.ones_like(tokens, dtype=torch.bool))
        width = max(len(a) for a in accepted)
        keep = torch.tensor([a + [a[-1]] * (width - len(a)) for a in accepted])
        keep_valid = torch.tensor([[i < len(a) for i in range(width)] for a in accepted])
        runner.commit(keep, keep_valid)
        for b, path in enumerate(accepted):
            history[b] += [int(tokens[b, i]) for i in path]
    tokens = torch.randint(8, 128, (len(history), len(PARENTS)), generator=generator)
    logits = runner.forward(tokens, torch.tensor([PARENTS] * len(history)), torch.ones_like(tokens, dtype=torch.bool))
    return logits.logits, tokens, history


@pytest.mark.parametrize("family", list(tf_.FAMILIES))
def test_tree_forward_equals_per_path_forward_across_the_window(family):
    """After rounds that leave rows different holes, every node of a tree == its path run from scratch."""
    model = _model(family)
    inputs = tf_.make_inputs(family, 2)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logits, tokens, history = _tree_logits(model, inputs, ([[0, 1, 3, 6], [0, 2]], [[0, 2, 5], [0, 1]]),
                                               generator)
        for b in range(2):
            for node in range(len(PARENTS)):
                expected = _scratch_logits(model, inputs, b, history[b] + _path(node, tokens[b]))
                torch.testing.assert_close(logits[b, node], expected, atol=2e-5, rtol=1e-4)


def test_without_the_window_the_tree_forward_is_wrong(monkeypatch):
    """The per-path reference tells a windowed mask from a plain tree mask (the test above has power)."""
    monkeypatch.setattr(windows_module.AttentionLayout, "restrict", lambda self, mask, queries, keys, layer_type: mask)
    model = _model("gemma3_text")
    inputs = tf_.make_inputs("gemma3_text", 1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logits, tokens, history = _tree_logits(model, inputs, ([[0, 1, 3]],), generator)
        expected = _scratch_logits(model, inputs, 0, history[0] + _path(6, tokens[0]))
        assert (logits[0, 6] - expected).abs().max() > 1e-3


def test_layouts_read_from_the_config():
    layout = windows_module.attention_layout(_model("gemma2"))
    assert layout.windows == (("sliding_attention", "sliding", tf_.WINDOW),) and layout.per_type
    layout = windows_module.attention_layout(_model("mistral"))  # one mask for every (sliding) layer
    assert layout.windows == (("sliding_attention", "sliding", tf_.WINDOW),) and not layout.per_type
    layout = windows_module.attention_layout(_model("llama4_text"))
    assert layout.windows == (("chunked_attention", "chunked", tf_.WINDOW),) and layout.has_full
    assert windows_module.attention_layout(_model("paligemma")) is None


def test_window_masks_by_text_position():
    layout = windows_module.AttentionLayout((("sliding_attention", "sliding", 3), ("chunked_attention", "chunked", 3)),
                                            True, True)
    mask = torch.zeros(1, 1, 2, 8)  # the tree mask (here: everything allowed) keeps blocking what it blocks
    keys = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    allowed = {name: (layout.restrict(mask, torch.tensor([[5, 7]]), keys, name)[0, 0] == 0).int().tolist()
               for name in ("sliding_attention", "chunked_attention")}
    assert allowed["sliding_attention"] == [[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]]
    assert allowed["chunked_attention"] == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1]]
    # every position below the smallest window: the tree mask is already right
    assert layout.restrict(mask, torch.tensor([[1, 2]]), keys, "sliding_attention") is mask


def test_cross_attention_vlm_refused_before_decoding():
    model = tf_.build_mllama()
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    ids = torch.randint(8, 128, (1, 6))
    with pytest.raises(NotImplementedError, match="cross-attention"):
        model.generate(input_ids=ids, max_new_tokens=4, assistant_model=model, spec_strategy="chain")
    handle.remove()
    assert not calls


def test_recurrent_layers_refused_by_layer_type():
    config = Qwen3NextConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                             layer_types=["linear_attention", "full_attention"])
    model = types.SimpleNamespace(config=config, _is_stateful=False)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="linear_attention"):
        check_model(model, "target")


def _returned_cache(out):
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


@pytest.mark.parametrize("family", ["mistral", "gemma2", "llama4_text", "gemma3_vlm"])
def test_returned_cache_has_plains_layers_after_a_long_prompt(family):
    """Prompts ten times the window: the speculative call returns plain's layer classes, lengths and cumulative
    lengths, with plain's values at every slot a row really holds (a row that ended early: zeros from its last
    token on, documented in `final_cache`)."""
    target = _model(family)
    drafter = tf_.drafter(family, target, "copy")
    for batch_size in (1, 2):
        inputs = tf_.make_inputs(family, batch_size, prompt_lengths=(40, 25))
        plain = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True)
        ends = (plain.sequences != tf_.PAD_ID).cumsum(-1).argmax(-1)  # each row's last real token
        for strategy in STRATEGIES:
            out = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter,
                                  spec_strategy=strategy, return_dict_in_generate=True)
            assert torch.equal(out.sequences, plain.sequences), (family, batch_size, strategy)
            width = plain.sequences.shape[1] - 1
            for mine, theirs in zip(_returned_cache(out).layers, _returned_cache(plain).layers):
                assert type(mine) is type(theirs), (family, strategy)
                assert mine.keys.shape == theirs.keys.shape and mine.values.shape == theirs.values.shape
                assert getattr(mine, "cumulative_length", None) == getattr(theirs, "cumulative_length", None)
                length = theirs.keys.shape[2]
                slots = torch.arange(width - length, width)
                real = (slots[None, :] < ends[:, None])[:, None, :, None]
                for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                    torch.testing.assert_close(a * real, b * real, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "llama4_text"])
def test_windowed_layers_hold_plains_window_during_rounds(family, monkeypatch):
    """After every commit a windowed layer holds at most plain's `window - 1` slots plus the slack, whatever the
    holes rows of different acceptance leave (batch 2, a drafter that is often wrong)."""
    from hf_adaptive_spec.adapters.runner import ModelRunner

    target = _model(family)
    drafter = tf_.drafter(family, target, "small")
    lengths = []
    commit = ModelRunner.commit

    def recording(self, keep_index, keep_valid):
        commit(self, keep_index, keep_valid)
        for group in self.windows:
            lengths.extend(self.cache.layers[i].keys.shape[2] for i in group.layers)
            assert group.length == self.cache.layers[group.layers[0]].keys.shape[2]

    monkeypatch.setattr(ModelRunner, "commit", recording)
    inputs = tf_.make_inputs(family, 2, prompt_lengths=(40, 25))
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    for strategy in STRATEGIES:
        out = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter,
                              spec_strategy=strategy)
        assert torch.equal(out, expected), (family, strategy)
    assert lengths and max(lengths) <= tf_.WINDOW - 1 + tf_.WINDOW // 16


def test_slots_of_a_windowed_layout_are_found_by_text_position():
    """`WindowedSlots.plain_index` finds each wanted position among valid slots, never an invalid duplicate."""
    valid = torch.tensor([[True, False, True, True, False, True]])
    positions = torch.tensor([[3, 4, 4, 5, 6, 6]])  # invalid slots share positions with valid ones
    group = windows_module.WindowedSlots("sliding_attention", "sliding", 8, [0], valid, positions)
    assert group.plain_index(torch.tensor([[2, 3, 4, 5, 6, 7]])).tolist() == [[-1, 0, 2, 3, 5, -1]]
    index, kept = group.compact_index(torch.tensor([7]), force=True)  # window 8 at position 7: all of 3..6
    assert index.tolist() == [[0, 2, 3, 5]] and kept.all()
    index, kept = windows_module.WindowedSlots("sliding_attention", "sliding", 3, [0], valid, positions) \
        .compact_index(torch.tensor([7]), force=True)  # window 3: positions 5 and 6 only
    assert index.tolist() == [[3, 5]]
