"""After a speculative `generate` returns, normally or by an exception, the target, the drafter and every module
in them hold exactly the attributes, parameters and buffers they held before: nothing beyond what a plain
`generate` itself changes (transformers' own per-call attributes, e.g. Qwen2-VL's `rope_deltas`)."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.ops import cpu_linear
from tiny_models import build_model, make_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


def _snapshot(model) -> dict:
    """Per module: every non-container attribute (by identity) and every parameter / buffer (identity, storage,
    a copy of the values)."""
    state = {}
    for name, module in model.named_modules():
        attributes = {key: id(value) for key, value in module.__dict__.items()
                      if key not in ("_parameters", "_buffers", "_modules")}
        tensors = {}
        for kind in ("_parameters", "_buffers"):
            for key, tensor in module.__dict__[kind].items():
                if tensor is not None:
                    tensors[(kind, key)] = (id(tensor), tensor.data_ptr(), tensor.requires_grad, tensor.detach().clone())
        state[name] = (attributes, tensors)
    return state


def _changes(before: dict, after: dict) -> set:
    """`(module, attribute)` pairs added, removed or rebound, and tensors replaced or modified."""
    changed = set(before) ^ set(after)
    for name in set(before) & set(after):
        (attrs_a, tensors_a), (attrs_b, tensors_b) = before[name], after[name]
        changed |= {(name, key) for key in set(attrs_a) | set(attrs_b) if attrs_a.get(key) != attrs_b.get(key)}
        for key in set(tensors_a) | set(tensors_b):
            a, b = tensors_a.get(key), tensors_b.get(key)
            if a is None or b is None or a[:3] != b[:3] or not torch.equal(a[3], b[3]):
                changed.add((name, key))
    return changed


def _stock_changes(model, inputs) -> set:
    """What plain `generate` itself changes on `model` from one call to the next."""
    model.generate(**inputs, max_new_tokens=6, do_sample=False)
    before = _snapshot(model)
    model.generate(**inputs, max_new_tokens=6, do_sample=False)
    model(**inputs, output_hidden_states=True)  # transformers installs its output-capturing hooks once
    return _changes(before, _snapshot(model))


class _FailAfter(StoppingCriteria):
    def __init__(self, calls: int):
        self.calls = calls

    def __call__(self, input_ids, scores, **kwargs):
        self.calls -= 1
        if self.calls < 0:
            raise RuntimeError("stopped by the test")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _drafters(arch, target):
    torch.manual_seed(4)
    laspec = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    laspec.set_draft_vocabulary(torch.arange(0, target.config.get_text_config().vocab_size, 2))
    return [("chain", build_model(arch, seed=3, num_layers=1)), ("sage", build_model(arch, seed=3, num_layers=1)),
            ("laspec", laspec)]


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_generate_leaves_nothing_on_the_models(arch, kernels):
    if kernels and not cpu_linear.available():
        pytest.skip("the CPU kernel cannot be built here")
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=1)
    for strategy, drafter in _drafters(arch, target):
        stock = _stock_changes(target, inputs)
        if strategy != "laspec":
            stock |= _stock_changes(drafter, inputs)
        expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
        models = {"target": target, "drafter": drafter}
        before = {role: _snapshot(model) for role, model in models.items()}
        with cpu_linear.use_cpu_kernels(kernels):
            out = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                                  spec_strategy=strategy)
            assert torch.equal(out, expected)
            for role, model in models.items():
                assert _changes(before[role], _snapshot(model)) <= stock, (strategy, role)
            with pytest.raises(RuntimeError, match="stopped by the test"):
                target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                                spec_strategy=strategy, stopping_criteria=StoppingCriteriaList([_FailAfter(2)]))
            for role, model in models.items():
                assert _changes(before[role], _snapshot(model)) <= stock, (strategy, role, "after an exception")
        assert not cpu_linear._ROUTED  # every routed layer handed back
        if strategy == "laspec":
            assert not drafter.has_target  # attached for the calls only
