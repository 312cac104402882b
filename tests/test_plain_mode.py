"""`spec_strategy="plain"`: plain decoding through the library's rounds, no drafter.

Greedy: tokens, scores and logits equal to plain `generate` (to float rounding of the faster forward) on tiny
models of several families, batch 1 and 2, with processors and stopping. Sampling: the tokens follow the
target's distribution (the chi-square test of `test_sampling`). Nothing stays on the model afterwards.
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_adaptive_spec  # noqa: F401
import tiny_families
from test_sampling import ALPHA, PROMPT, _chi_square_p_value, _exact_joint, _speculative_counts, _tiny_llama
from tiny_models import build_model, make_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 16


class _StopAfter(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _model(family):
    if family in tiny_families.FAMILIES:
        return tiny_families.build(family), lambda batch: tiny_families.make_inputs(family, batch)
    return build_model(family), lambda batch: make_inputs(family, batch)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_vl", "llava", "gemma2", "mistral"])
def test_plain_mode_equals_plain_generate(family):
    model, inputs_of = _model(family)
    for batch in (1, 2):
        inputs = inputs_of(batch)
        free = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        stop = int(free[0, inputs["input_ids"].shape[1] + 6])
        settings = dict(max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3,
                        min_new_tokens=3, output_scores=True, output_logits=True, return_dict_in_generate=True,
                        stopping_criteria=StoppingCriteriaList([_StopAfter(stop)]))
        plain = model.generate(**inputs, **settings)
        out = model.generate(**inputs, **settings, spec_strategy="plain")
        assert torch.equal(out.sequences, plain.sequences), (family, batch)
        assert out.spec_stats.drafted_tokens == 0 and out.spec_stats.rounds == len(plain.scores) - 1
        assert len(out.scores) == len(plain.scores) and len(out.logits) == len(plain.logits)
        live = (plain.sequences[:, inputs["input_ids"].shape[1]:] != stop).cumsum(-1) == torch.arange(
            1, len(plain.scores) + 1)  # steps up to and including a row's stop token
        live = torch.cat([torch.ones_like(live[:, :1]), live[:, :-1]], dim=1)
        for step, (a, b, c, d) in enumerate(zip(out.scores, plain.scores, out.logits, plain.logits)):
            rows = live[:, step]
            torch.testing.assert_close(a[rows], b[rows], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(c[rows], d[rows], atol=1e-4, rtol=1e-4)


def test_plain_mode_refuses_a_drafter_and_needs_none():
    model, inputs_of = _model("llama")
    with pytest.raises(ValueError, match="drafts nothing"):
        model.generate(**inputs_of(1), max_new_tokens=4, spec_strategy="plain", assistant_model=model)
    # saved in the model's generation config, it applies without a drafter
    model.generation_config.spec_strategy = "plain"
    try:
        out = model.generate(**inputs_of(1), max_new_tokens=4, return_dict_in_generate=True)
    finally:
        model.generation_config.spec_strategy = None
    assert out.spec_stats.strategy == "plain"


def test_plain_mode_leaves_nothing_on_the_model():
    model, inputs_of = _model("llama")
    before = {name: type(module).forward for name, module in model.named_modules()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    attention = model.config._attn_implementation
    inputs = inputs_of(2)
    expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    model.generate(**inputs, max_new_tokens=8, do_sample=False, spec_strategy="plain")
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False), expected)
    assert {name: type(module).forward for name, module in model.named_modules()} == before
    assert not any("forward" in module.__dict__ for module in model.modules())
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks
    assert model.config._attn_implementation == attention


def test_plain_mode_sampling_follows_the_target():
    target = _tiny_llama(0, 0.25)
    counts = _speculative_counts(target, None, "plain", None)
    assert _chi_square_p_value(counts, _exact_joint(target)) > ALPHA
    assert PROMPT.shape[1] == 5


def test_the_command_line_runs_the_plain_mode_without_its_drafter(capsys):
    """`generate --strategy plain` (and `prepare`) leave the drafter out: the plain mode takes none."""
    from hf_adaptive_spec import cli
    from hf_adaptive_spec.decoding.prepare import prepare

    model, inputs_of = _model("llama")

    class Digits:
        def decode(self, ids, **kwargs):
            return " ".join(str(int(i)) for i in ids)

    assert cli._generate_and_compare(model, model, inputs_of(1), Digits(), "plain", None, 6, compare=True) == 0
    assert "same output: yes" in capsys.readouterr().out
    assert prepare(model, model, "plain")["profiles"] == []
