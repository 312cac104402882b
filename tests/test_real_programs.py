"""Speculative generate in real programs: inside `torch.inference_mode()`, from several threads sharing a target
and a drafter, and beside a plain `generate` that must stay bitwise stock."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.ops import cpu_linear
from thread_helpers import run_threads
from tiny_models import build_drafter, build_model, make_inputs

MAX_NEW = 16


pytestmark = pytest.mark.usefixtures("one_thread")


def _without_gqa():
    """A tiny Llama with as many key/value heads as query heads."""
    target = build_model("llama")
    config = LlamaConfig(**{**target.config.to_dict(), "num_key_value_heads": target.config.num_attention_heads})
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config = target.generation_config
    return model


def _laspec(target):
    torch.manual_seed(0)
    return LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()


@pytest.mark.parametrize("gqa", [True, False])
def test_inference_mode_then_other_modes(gqa):
    """Every strategy works under inference_mode and leaves nothing (calibration, cached copies) that breaks a
    later call under no_grad or with autograd on, and the other way round."""
    target = build_model("llama") if gqa else _without_gqa()
    assert (target.config.num_key_value_heads < target.config.num_attention_heads) == gqa
    inputs = make_inputs("llama", batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    drafter = build_drafter("llama", target, "small")
    for strategy, assistant in (("sage", drafter), ("chain", drafter), ("static_tree", drafter),
                                ("laspec", _laspec(target))):
        for mode in ("inference", "grad", "no_grad", "inference"):
            context = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
            with context():
                out = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=assistant,
                                      spec_strategy=strategy, spec_config={"verify_cost": True}
                                      if strategy in ("sage", "chain") else None)
            assert torch.equal(out, expected), (strategy, mode)


def test_threads_share_a_target_and_drafters():
    target = build_model("llama")
    drafter, block = build_drafter("llama", target, "small"), _laspec(target)
    prompts = [make_inputs("llama", batch_size=1, seed=seed) for seed in range(3)]
    expected = [target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False) for inputs in prompts]
    wrong = []
    plans = (("sage", drafter), ("chain", drafter), ("laspec", block))

    def work(index):
        for round_ in range(3):
            strategy, assistant = plans[(index + round_) % len(plans)]
            for inputs, plain in zip(prompts, expected):
                out = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=assistant,
                                      spec_strategy=strategy)
                if not torch.equal(out, plain):  # what differs, for the report: the first position and both tails
                    length = min(out.shape[1], plain.shape[1])
                    differ = (out[0, :length] != plain[0, :length]).nonzero()
                    first = int(differ[0]) if len(differ) else length
                    wrong.append((index, strategy, first, out[0, first:].tolist(), plain[0, first:].tolist()))

    run_threads(work, 3)
    assert not wrong
    assert target.config._attn_implementation == "sdpa"
    assert not any("forward" in module.__dict__ for module in (*target.modules(), *drafter.modules()))


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_plain_generate_beside_speculation_is_bitwise_stock(arch):
    """While another thread speculates on the same target (kernels routed, attention switched), a plain greedy
    call gets exactly the logits it gets alone."""
    target = build_model(arch, hidden_size=64)
    drafter = build_drafter(arch, target, "small")
    plain_inputs, spec_inputs = make_inputs(arch, batch_size=1, seed=0), make_inputs(arch, batch_size=2, seed=1)
    reference = target.generate(**plain_inputs, max_new_tokens=24, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    started, stop = threading.Event(), threading.Event()
    speculated = []

    def speculate():
        while not stop.is_set():
            started.set()
            target.generate(**spec_inputs, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=drafter,
                            spec_strategy="sage")
            speculated.append(1)

    thread = threading.Thread(target=speculate)
    thread.start()
    try:
        started.wait()
        for _ in range(4):
            out = target.generate(**plain_inputs, max_new_tokens=24, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
            assert torch.equal(out.sequences, reference.sequences)
            assert all(torch.equal(a, b) for a, b in zip(out.logits, reference.logits))
    finally:
        stop.set()
        thread.join()
    assert speculated


def test_routed_layers_run_stock_outside_their_block():
    """The mechanism behind the test above, deterministically: a layer routed by one context's block runs
    `nn.Linear.forward` in any other context."""
    if not cpu_linear.enabled(wait=True):
        pytest.skip("the CPU kernel is not available here")
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(5, 64)

    def in_a_thread(function):
        # the stock reference runs in a new thread too: after torch.set_num_threads a new thread's BLAS may split
        # the product otherwise than the main thread's (measured on an AMD EPYC: not bitwise equal)
        out = []
        thread = threading.Thread(target=lambda: out.append(function(x)))
        thread.start()
        thread.join()
        return out[0]

    stock = in_a_thread(lambda x: torch.nn.functional.linear(x, layer.weight, layer.bias))
    model = torch.nn.Sequential(layer)
    with cpu_linear.fast_linears(model):
        layer(x)  # routed in this context
        outside = in_a_thread(layer)
    assert torch.equal(outside, stock)
    assert cpu_linear._extension() is None or "forward" not in layer.__dict__
