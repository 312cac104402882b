"""The lean forward: bitwise transformers' forward where it applies, and not taken anywhere else."""

import copy

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from hf_adaptive_spec import ops
from hf_adaptive_spec.adapters import lean
from hf_adaptive_spec.adapters.attention import tree_attention
from hf_adaptive_spec.adapters.lean import LeanForward, lean_forward, use_lean_forward
from hf_adaptive_spec.adapters.target_states import thread_confined
from hf_adaptive_spec.ops import cpu_linear
from tiny_models import VOCAB_SIZE, build_drafter, build_model, make_inputs


def _tree(generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random parents (node 0 the root) and a valid mask with one padding node when size > 3."""
    parents = torch.tensor([[-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)]])
    valid = torch.ones(1, size, dtype=torch.bool)
    if size > 3:
        valid[0, -1] = False
    return parents, valid


def _prefilled(model, length: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB_SIZE, (1, length), generator=generator)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
    return cache, generator


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llava", "llava_onevision", "qwen2_vl", "qwen2_5_vl",
                                  "qwen3_vl"])
@pytest.mark.parametrize("kernels", [False, True])
def test_lean_forward_is_bitwise_the_models_forward(arch, kernels):
    """Tree forwards (random trees over a prefilled cache): logits, every hidden state and every cache
    slot equal transformers' forward bit for bit, with and without the CPU kernels and the tree sdpa."""
    model = build_model(arch, num_layers=3, hidden_size=64)
    runner = lean_forward(model)
    assert isinstance(runner, LeanForward)
    for seed, size, keep in [(0, 1, 0), (1, 5, 0), (2, 9, 0), (3, 6, 1)]:
        cache, generator = _prefilled(model, 11 + seed, seed)
        twin, spare = copy.deepcopy(cache), copy.deepcopy(cache)
        parents, valid = _tree(generator, size)
        mask, depths = ops.tree_attention_mask(parents, valid, torch.ones(1, cache.get_seq_length(), dtype=torch.bool),
                                               model.dtype)
        tokens = torch.randint(0, VOCAB_SIZE, (1, size), generator=generator)
        positions = cache.get_seq_length() + depths
        with torch.no_grad(), cpu_linear.use_cpu_kernels(kernels), cpu_linear.fast_linears(model), \
                tree_attention(model):
            expected = model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache,
                             use_cache=True, output_hidden_states=True, logits_to_keep=keep)
            got = runner(tokens, mask, positions, twin, logits_to_keep=keep, output_hidden_states=True)
        assert torch.equal(got.logits, expected.logits)
        assert len(got.hidden_states) == len(expected.hidden_states) == 4
        assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, expected.hidden_states))
        for mine, theirs in zip(twin.layers, cache.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        with torch.no_grad():
            plain = runner(tokens, mask, positions, spare)
        assert plain.hidden_states is None


def test_eager_attention_too():
    model = build_model("llama", num_layers=2, hidden_size=64, attn_implementation="eager")
    cache, generator = _prefilled(model, 9, 0)
    twin = copy.deepcopy(cache)
    parents, valid = _tree(generator, 6)
    mask, depths = ops.tree_attention_mask(parents, valid, torch.ones(1, 9, dtype=torch.bool), model.dtype)
    tokens = torch.randint(0, VOCAB_SIZE, (1, 6), generator=generator)
    with torch.no_grad():
        expected = model(input_ids=tokens, attention_mask=mask, position_ids=9 + depths, cache=cache, use_cache=True)
        got = lean_forward(model)(tokens, mask, 9 + depths, twin)
    assert torch.equal(got.logits, expected.logits)


def test_lean_forward_declines_what_it_was_not_checked_on(monkeypatch):
    model = build_model("llama", num_layers=2, hidden_size=64)
    assert lean_forward(model) is not None
    with use_lean_forward(False):
        assert lean_forward(model) is None
    with pytest.raises(ValueError, match="True or False"):
        use_lean_forward(1)
    assert "not a supported class" in lean._unsupported(build_model("qwen3_vl_moe"))  # experts: not this forward
    model.train()
    assert "training" in lean._unsupported(model)
    model.eval()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert "hooks" in lean._unsupported(model)
    handle.remove()
    # this library's recorders of another thread's call (a shared target) never act here: not foreign
    handle = model.model.layers[1].register_forward_hook(thread_confined(lambda *args: None))
    assert lean._unsupported(model) is None
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    assert "global" in lean._unsupported(model)
    handle.remove()
    layer = model.model.layers[0]
    layer.forward = lambda *args, **kwargs: None  # e.g. an offload hook
    assert "replaced forward" in lean._unsupported(model)
    del layer.forward
    kernel = nn.Module()  # what `kernels.kernelize` leaves in an attention's function wrappers
    kernel.forward = lambda *args, **kwargs: None
    saved = layer.self_attn.__dict__.get("_kernel_funcs")
    layer.self_attn.__dict__["_kernel_funcs"] = {**(saved or {}), "apply_rotary_pos_emb": kernel}
    assert "Hub kernel replaced apply_rotary_pos_emb" in lean._unsupported(model)
    layer.self_attn.__dict__["_kernel_funcs"] = saved or {}
    assert lean._unsupported(model) is None  # the wrappers as transformers builds them (kernels installed or not)

    class Adapter(nn.Linear):
        pass

    original = layer.mlp.up_proj
    layer.mlp.up_proj = Adapter(original.in_features, original.out_features, bias=False)
    assert "nn.Linear" in lean._unsupported(model)
    layer.mlp.up_proj = original
    assert lean._unsupported(model) is None
    layer.self_attn.q_norm = nn.Identity()  # a query norm this class's forward would not know about
    assert "normalizes" in lean._unsupported(model)
    del layer.self_attn.q_norm
    norm_class = type(layer.input_layernorm)
    monkeypatch.setattr(norm_class, "forward", lambda self, x: x)  # e.g. a kernel swapped in for the class
    assert "RMSNorm" in lean._unsupported(model)
    monkeypatch.undo()
    monkeypatch.setattr(type(layer), "forward", lambda self, *a, **k: None)  # another decoder-layer forward
    assert "another forward" in lean._unsupported(model)
    monkeypatch.undo()
    monkeypatch.setattr(type(layer.self_attn), "forward", lambda self, *a, **k: None)
    assert "attention's forward" in lean._unsupported(model)
    monkeypatch.undo()
    assert lean._unsupported(model) is None
    runner = lean_forward(model)
    assert runner.applies(torch.zeros(1, 1, dtype=torch.long))
    monkeypatch.setattr(lean, "_ATTENTION", ("eager",))  # an implementation it does not run: transformers' forward
    assert not runner.applies(torch.zeros(1, 1, dtype=torch.long))
    monkeypatch.undo()
    sliding = build_model("qwen2", num_layers=2, hidden_size=64)
    sliding.config.layer_types = ["full_attention", "sliding_attention"]
    assert "full attention" in lean._unsupported(sliding)


def _lean_calls(monkeypatch) -> list:
    """The models whose forwards ran through `LeanForward` from now on (appended per call)."""
    calls = []
    original = LeanForward.__call__
    monkeypatch.setattr(LeanForward, "__call__", lambda self, *a, **k: calls.append(self.model) or original(self, *a, **k))
    return calls


@pytest.mark.parametrize("strategy,arch", [("laspec", "llama"), ("chain", "llama"), ("sage", "llama"),
                                           ("laspec", "qwen3"), ("chain", "qwen3")])
def test_generate_with_the_lean_forward_equals_plain(strategy, arch, monkeypatch):
    from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel

    target = build_model(arch, hidden_size=64)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    if strategy == "laspec":
        torch.manual_seed(0)
        drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    else:
        drafter = build_drafter(arch, target, "small")
    calls = _lean_calls(monkeypatch)
    for on in (True, False):
        calls.clear()
        with use_lean_forward(on):
            out = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                                  spec_strategy=strategy, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert any(model is target for model in calls) == on
        if strategy != "laspec":  # an independent drafter's forwards run lean too
            assert any(model is drafter for model in calls) == on


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_multimodal_rotary_position_rows_are_passed_as_the_text_model_does(arch):
    """3 rows (temporal / height / width, as the loop passes them with rope deltas) and 4 rows (text
    positions first): bitwise the model's forward."""
    model = build_model(arch, num_layers=2, hidden_size=64)
    runner = lean_forward(model)
    for rows in (3, 4):
        cache, generator = _prefilled(model, 10, rows)
        twin = copy.deepcopy(cache)
        parents, valid = _tree(generator, 5)
        mask, depths = ops.tree_attention_mask(parents, valid, torch.ones(1, 10, dtype=torch.bool), model.dtype)
        tokens = torch.randint(0, VOCAB_SIZE, (1, 5), generator=generator)
        base = 10 + depths
        positions = torch.stack([base, base + 3, base + 7])  # distinct rows: a wrong row order would show
        if rows == 4:
            positions = torch.cat([base[None], positions])
        with torch.no_grad(), tree_attention(model):
            expected = model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache,
                             use_cache=True, output_hidden_states=True)
            got = runner(tokens, mask, positions, twin, output_hidden_states=True)
        assert torch.equal(got.logits, expected.logits)
        assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, expected.hidden_states))


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "qwen3_vl"])
def test_generate_on_a_vlm_with_an_image_runs_lean_rounds_and_equals_plain(arch, monkeypatch):
    from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel

    target = build_model(arch, hidden_size=64)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    torch.manual_seed(0)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=3, num_visual_tokens=4)).eval()
    with torch.no_grad():
        for layer in drafter.layers:
            layer.visual_gate.fill_(0.5)  # a live visual branch: rounds also run the query-capture attention
    calls = _lean_calls(monkeypatch)
    out = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.time_visual > 0
    assert calls and all(model is target for model in calls)  # the prefill (pixels) is transformers' own


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2_vl"])
@pytest.mark.parametrize("kernels", [False, True])
def test_a_packed_block_computes_only_its_real_tokens_to_the_same_values(arch, kernels):
    """`token_valid`: trees of different sizes per row run their real tokens packed; logits, every hidden state
    and every cache slot of a real token equal the padded forward's (to float rounding: the projections see
    another number of rows), padding positions are zeros, and fewer rows go through the projections."""
    model = build_model(arch, num_layers=3, hidden_size=64)
    runner = lean_forward(model)
    generator = torch.Generator().manual_seed(7)
    batch, size, length = 3, 6, 10
    prompt = torch.randint(0, VOCAB_SIZE, (batch, length), generator=generator)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
    twin = copy.deepcopy(cache)
    parents = torch.tensor([[-1, 0, 1, 1, 3, 2]] * batch)
    valid = torch.tensor([[True] * 6, [True, True, False, False, False, False], [True, True, True, True, False, False]])
    mask, depths = ops.tree_attention_mask(parents, valid, torch.ones(batch, length, dtype=torch.bool), model.dtype)
    tokens = torch.randint(0, VOCAB_SIZE, (batch, size), generator=generator)
    positions = length + depths
    rows_seen = []
    head = model.lm_head.forward
    model.lm_head.forward = lambda hidden: rows_seen.append(hidden.shape[:-1].numel()) or head(hidden)
    with torch.no_grad(), cpu_linear.use_cpu_kernels(kernels), cpu_linear.fast_linears(model), tree_attention(model):
        padded = runner(tokens, mask, positions, cache, output_hidden_states=True)
        packed = runner(tokens, mask, positions, twin, output_hidden_states=True, token_valid=valid)
    assert rows_seen == [batch * size, int(valid.sum())]
    real = valid[..., None]
    # (with kernels, the padded block's 18 rows may go to torch and the packed 12 to the kernel: AVX2 runs the
    # kernel up to 12 rows, two roundings of the same sums)
    close = dict(rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(packed.logits * real, padded.logits * real, **close)
    assert not packed.logits[~valid].any()
    for mine, theirs in zip(packed.hidden_states, padded.hidden_states):
        torch.testing.assert_close(mine * real, theirs * real, **close)
    for mine, theirs in zip(twin.layers, cache.layers):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            torch.testing.assert_close(a[:, :, :length], b[:, :, :length], rtol=0, atol=0)
            tail = valid[:, None, :, None]
            torch.testing.assert_close(a[:, :, length:] * tail, b[:, :, length:] * tail, **close)
    with pytest.raises(ValueError, match="logits_to_keep=0"):
        runner(tokens, mask, positions, twin, logits_to_keep=1, token_valid=valid)


def test_the_loop_packs_a_padded_block_through_the_lean_forward(monkeypatch):
    """The runner hands the lean forward the real tokens of a block with padding, and nothing for a full one."""
    from hf_adaptive_spec.adapters.runner import ModelRunner

    model = build_model("llama", num_layers=2, hidden_size=64)
    prompt = torch.randint(0, VOCAB_SIZE, (2, 5), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
    runner = ModelRunner(model, cache, torch.ones(2, 5, dtype=torch.bool), torch.arange(5).expand(2, 5))
    seen = []
    original = LeanForward.__call__
    monkeypatch.setattr(LeanForward, "__call__", lambda self, *args, **kwargs: seen.append(kwargs["token_valid"])
                        or original(self, *args, **kwargs))
    parents = torch.tensor([[-1, 0, 1]] * 2)
    for valid in (torch.ones(2, 3, dtype=torch.bool), torch.tensor([[True, True, True], [True, False, False]])):
        with torch.no_grad():
            runner.forward(torch.zeros(2, 3, dtype=torch.long), parents, valid)
        runner.commit(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool))
    assert seen[0] is None and torch.equal(seen[1], torch.tensor([[True, True, True], [True, False, False]]))
