"""The target states a drafter reads are recorded alone (never every layer at every prompt position), and
refusals follow what a model holds: GPT-2 and GPTBigCode (which accept `encoder_hidden_states` but hold no
cross-attention layers) are exact with every strategy; models with cross-attention layers are refused."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import hf_adaptive_spec
from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.adapters.compat import check_model, cross_attention
from hf_adaptive_spec.adapters.target_states import StateCapture
import tiny_families as tf_
from tiny_models import build_model, make_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

STRATEGIES = ("chain", "static_tree", "sage", "laspec")


def _gpt(kind: str, num_layers: int = 3, seed: int = 0, **extra):
    torch.manual_seed(seed)
    common = dict(vocab_size=128, n_embd=32, n_layer=num_layers, n_head=2, n_positions=128, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, **extra)
    if kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**common))
    else:
        model = tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(**common))
    model.generation_config = tf.GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return model.eval()


def _ragged(batch_size: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 128, (batch_size, 11), generator=generator)
    mask = torch.ones_like(ids)
    if batch_size > 1:
        ids[1, :4], mask[1, :4] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("kind", ["gpt2", "gpt_bigcode"])
def test_decoders_whose_cross_attention_is_off_are_exact(kind):
    target = _gpt(kind)
    drafters = {"copy": copy.deepcopy(target), "small": _gpt(kind, num_layers=1, seed=1)}
    assert cross_attention(target) is None
    for batch_size in (1, 2):
        inputs = _ragged(batch_size)
        expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
        for strategy in STRATEGIES:
            for name, drafter in drafters.items():
                if strategy == "laspec":
                    torch.manual_seed(0)
                    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
                out = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                                      spec_strategy=strategy)
                assert torch.equal(out, expected), (kind, batch_size, strategy, name)


def test_models_with_cross_attention_layers_are_refused_up_front():
    gpt2 = _gpt("gpt2", add_cross_attention=True)
    assert "add_cross_attention" in cross_attention(gpt2)
    with pytest.raises(NotImplementedError, match="cross-attention"):
        check_model(gpt2, "target")
    mllama = tf_.build_mllama()
    assert "cross_attention_layers" in cross_attention(mllama)
    # a cross-attention module the config does not announce is found in the decoder's modules
    config = mllama.config.get_text_config()
    config.cross_attention_layers = []
    assert "CrossAttention" in cross_attention(mllama)


@pytest.mark.parametrize("arch", ["llama", "llava", "gpt2", "gemma3_vlm"])
def test_a_capture_records_the_entries_output_hidden_states_gives(arch):
    """Each recorded entry (the first layer's input, a middle layer, the last after the final norm) equals
    `outputs.hidden_states` at that index; the others are not recorded."""
    if arch == "gpt2":
        model, inputs = _gpt("gpt2"), _ragged(2)
    elif arch == "gemma3_vlm":
        model, inputs = tf_.build("gemma3_vlm"), tf_.make_inputs("gemma3_vlm", 2)
    else:
        model, inputs = build_model(arch, num_layers=3), make_inputs(arch, 2)
    layers = model.config.get_text_config().num_hidden_layers
    indices = tuple(sorted({0, layers // 2, layers}))
    capture = StateCapture.for_model(model, indices)
    assert capture is not None
    with torch.no_grad():
        reference = model(**inputs, output_hidden_states=True).hidden_states
        with capture:
            model(**inputs)
    assert sorted(capture.states) == list(indices)
    for index in indices:
        torch.testing.assert_close(capture.states[index], reference[index], rtol=0, atol=0)


def test_a_laspec_prefill_keeps_only_the_layers_its_drafter_reads():
    """The target's prefill is not asked for every hidden state (with a long prompt that is every layer at every
    position at once); the drafter reads its fused layers, and the output is plain greedy's."""
    target = build_model("llama", num_layers=6)
    torch.manual_seed(0)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    seen = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(bool(kwargs.get("output_hidden_states"))), with_kwargs=True)
    inputs = make_inputs("llama", 2)
    try:
        expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
        seen.clear()
        out = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                              spec_strategy="laspec", spec_config={"verify_cost": False})
    finally:
        handle.remove()
    assert torch.equal(out, expected)
    assert seen and not any(seen)
