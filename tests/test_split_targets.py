"""Targets too big for one device: placed by accelerate's hooks with offloaded weights (`from_pretrained` with a
`device_map` that sends a layer to disk, `cpu_offload`, `disk_offload`), and sharded by transformers' tensor
parallelism over two processes (torchrun, gloo on the CPU). Speculative generate must equal plain greedy and
leave the model's weights and hooks as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import accelerate
import pytest
import torch
from accelerate.hooks import AlignDevicesHook
from transformers import AutoModelForCausalLM

from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.decoding.final_cache import CACHE_FIELD
from hf_adaptive_spec.adapters.placement import execution_device, tensor_parallel
from hf_adaptive_spec.adapters.runner import ModelRunner
from tiny_models import build_drafter, build_model, make_inputs

MAX_NEW = 16
STRATEGIES = ("chain", "static_tree", "sage", "laspec")
PLACEMENTS = ("device_map", "cpu_offload", "disk_offload")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 3-layer tiny Llama and the folder it is saved in."""
    target = build_model("llama", num_layers=3)
    folder = tmp_path_factory.mktemp("split")
    target.save_pretrained(folder / "target")
    return target, folder


def _load(folder, placement: str):
    kwargs = dict(dtype=torch.float32, attn_implementation="sdpa")
    if placement == "device_map":  # layer 1 on disk, the rest in memory: accelerate's hooks on every module
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                      "model.layers.1": "disk", "model.layers.2": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
        return AutoModelForCausalLM.from_pretrained(folder / "target", device_map=device_map,
                                                    offload_folder=folder / "offload", **kwargs).eval()
    model = AutoModelForCausalLM.from_pretrained(folder / "target", **kwargs).eval()
    if placement == "cpu_offload":  # every weight on the meta device between forwards, brought in by hooks
        return accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    return accelerate.disk_offload(model, folder / f"disk_{id(model)}", execution_device=torch.device("cpu"))


def _laspec(target):
    torch.manual_seed(0)
    return LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()


def _state(model) -> dict:
    """Every module's accelerate hook, instance `forward` and other hooks (but the output recorders transformers
    adds on first use), every parameter's kind, place and value, the attention implementation."""
    state = {"attention": model.config._attn_implementation}
    for name, module in model.named_modules():
        hooks = [hook for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
                 if getattr(hook, "__module__", None) != "transformers.utils.output_capturing"]  # (made on first use)
        state[f"module {name}"] = (id(getattr(module, "_hf_hook", None)), module.__dict__.get("forward"), hooks)
    for name, parameter in model.named_parameters():
        value = None if parameter.device.type == "meta" else parameter.detach().clone()
        state[f"parameter {name}"] = (type(parameter), parameter.device, parameter.dtype, value)
    return state


def _same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, old in before.items():
        new = after[key]
        if key.startswith("parameter"):
            assert old[:3] == new[:3], key
            assert (old[3] is None) == (new[3] is None) and (old[3] is None or torch.equal(old[3], new[3])), key
        else:
            assert old == new, key


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_offloaded_target_is_exact(saved, placement):
    """Each strategy equals plain greedy (batch 1 and 2) on a target whose weights are offloaded, drafts as it
    does on the same target in memory (same device defaults, a LaSpec drafter reading the offloaded LM head), and
    leaves the target's hooks, weights and attention as they were."""
    target, folder = saved
    model = _load(folder, placement)
    offloaded = [module for module in model.modules()
                 if isinstance(getattr(module, "_hf_hook", None), AlignDevicesHook) and module._hf_hook.offload]
    assert offloaded and any(p.device.type == "meta" for p in model.parameters())
    assert execution_device(model, torch.device("meta")).type == "cpu"
    drafter, laspec = build_drafter("llama", target, "small"), _laspec(target)
    for batch in (1, 2):
        inputs = make_inputs("llama", batch_size=batch)
        expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        before = _state(model)
        assert torch.equal(model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False), expected)
        for strategy in STRATEGIES:
            kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, spec_strategy=strategy,
                          assistant_model=laspec if strategy == "laspec" else drafter, return_dict_in_generate=True)
            out = model.generate(**inputs, **kwargs)
            assert torch.equal(out.sequences, expected), (placement, strategy, batch)
            reference = target.generate(**inputs, **kwargs)
            assert out.spec_stats.drafted_tokens == reference.spec_stats.drafted_tokens, (placement, strategy)
            assert out.spec_stats.accepted_lengths == reference.spec_stats.accepted_lengths, (placement, strategy)
            cache, reference_cache = getattr(out, CACHE_FIELD), getattr(reference, CACHE_FIELD)
            for layer, reference_layer in zip(cache.layers, reference_cache.layers, strict=True):
                torch.testing.assert_close(layer.keys, reference_layer.keys)
                torch.testing.assert_close(layer.values, reference_layer.values)
        _same_state(before, _state(model))


def test_offloaded_drafter(saved):
    """A drafter offloaded by accelerate drafts as it does in memory."""
    target, folder = saved
    drafter = build_drafter("llama", target, "small")
    offloaded = accelerate.cpu_offload(build_drafter("llama", target, "small"), execution_device=torch.device("cpu"))
    inputs = make_inputs("llama", batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    for strategy in ("chain", "sage"):
        kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, spec_strategy=strategy, return_dict_in_generate=True)
        out = target.generate(**inputs, assistant_model=offloaded, **kwargs)
        reference = target.generate(**inputs, assistant_model=drafter, **kwargs)
        assert torch.equal(out.sequences, expected)
        assert out.spec_stats.accepted_lengths == reference.spec_stats.accepted_lengths


@pytest.mark.parametrize("placement", ("device_map", "cpu_offload"))
def test_laspec_reads_an_offloaded_head(saved, placement):
    """A LaSpec drafter attached to a target whose LM head is hooked (its weight on the meta device between
    forwards) computes the head's logits, over the full or a draft vocabulary, as from the head in memory."""
    target, folder = saved
    model = _load(folder, placement)
    hidden = torch.randn(2, 3, target.config.hidden_size)
    in_memory, hooked = _laspec(target).attach_target(target), _laspec(target).attach_target(model)
    assert torch.equal(hooked.logits_from_hidden(hidden), in_memory.logits_from_hidden(hidden))
    vocabulary = torch.arange(8, 72)
    in_memory.set_draft_vocabulary(vocabulary)
    hooked.set_draft_vocabulary(vocabulary)
    torch.testing.assert_close(hooked.draft_logits(hidden), in_memory.draft_logits(hidden))
    assert model.lm_head.weight.device.type == ("meta" if placement == "cpu_offload" else "cpu")


def test_cache_on_several_devices_is_compacted_per_device(monkeypatch):
    """A model split over devices keeps each layer's cache on its layer's device: committing a tree gathers each
    layer's kept slots on that layer's own device, with the indices moved there (here one layer on the CPU, one
    on the meta device; the GPU kernel asserts one device per call)."""
    from transformers import DynamicCache

    from hf_adaptive_spec import ops

    compact = ops.compact_kv_
    devices = []

    def one_device(tensors, keep_index, start):
        assert all(tensor.device == keep_index.device for tensor in tensors)
        devices.append(keep_index.device.type)
        return compact(tensors, keep_index, start)

    monkeypatch.setattr(ops, "compact_kv_", one_device)

    batch, heads, dim, prompt, tail = 2, 1, 4, 3, 4
    cache = DynamicCache()
    keys = torch.randn(batch, heads, prompt + tail, dim)
    cache.update(keys, -keys, 0)
    cache.update(torch.empty(batch, heads, prompt + tail, dim, device="meta"),
                 torch.empty(batch, heads, prompt + tail, dim, device="meta"), 1)
    runner = ModelRunner.__new__(ModelRunner)
    runner.cache = cache
    runner.slot_valid = torch.ones(batch, prompt, dtype=torch.bool)
    runner.next_position = runner.slot_valid.sum(-1)
    runner.windows, runner.full_layers = [], list(range(len(cache.layers)))  # full-attention layers only
    keep = torch.tensor([[0, 2], [1, 3]])
    runner.commit(keep, torch.ones_like(keep, dtype=torch.bool))
    expected = torch.cat([keys[:, :, :prompt], keys[:, :, prompt:].gather(2, keep[:, None, :, None].expand(
        batch, heads, 2, dim))], dim=2)
    assert torch.equal(cache.layers[0].keys, expected) and torch.equal(cache.layers[0].values, -expected)
    assert cache.layers[1].keys.device.type == "meta" and cache.layers[1].keys.shape == expected.shape
    assert sorted(devices) == ["cpu", "meta"]


def test_pipeline_parallel_target_is_refused(saved):
    target, _ = saved
    drafter = build_drafter("llama", target, "small")
    target._pp_stage = object()  # what transformers' pipeline parallelism sets on a model split into stages
    try:
        with pytest.raises(NotImplementedError, match="pipeline parallelism"):
            target.generate(**make_inputs("llama"), max_new_tokens=4, assistant_model=drafter, spec_strategy="chain")
    finally:
        del target._pp_stage
    assert not tensor_parallel(target, drafter)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_tensor_parallel_target_is_exact(tmp_path):
    """A target sharded by `DistributedConfig(tp_plan="auto")` over 2 ranks (torchrun, gloo): every strategy equals
    plain greedy on both batch sizes, a sharded drafter too, and sampling draws the same tokens on every rank."""
    target = build_model("llama", num_layers=2, hidden_size=64)  # 4 heads, 2 key/value heads: 2 ranks split them
    target.save_pretrained(tmp_path / "target")
    build_drafter("llama", target, "small").save_pretrained(tmp_path / "drafter")
    out = tmp_path / "result.json"
    worker = os.path.join(os.path.dirname(__file__), "tp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          worker, str(tmp_path / "target"), str(tmp_path / "drafter"), str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-6000:])
    result = json.loads(out.read_text())
    assert result["exact"] and all(ok is True for ok in result["exact"].values()), result["exact"]
    assert result["ranks_agree"] and all(result["ranks_agree"].values()), result["ranks_agree"]
    assert result["pruned"] == 0  # the cost rule, which follows each rank's timings, is off
