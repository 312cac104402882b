"""Tree sdpa: grouped-query attention folded onto key/value heads == transformers' sdpa with repeat_kv."""

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_adaptive_spec.adapters import attention
from hf_adaptive_spec.adapters.attention import TREE_SDPA, tree_attention, tree_sdpa_attention
from tiny_models import build_drafter, build_model, make_inputs


class _Module(torch.nn.Module):
    def __init__(self, n_rep):
        super().__init__()
        self.num_key_value_groups = n_rep
        self.is_causal = True
        self.training = False


def _case(batch, kv_heads, n_rep, q_len, kv_len, boolean, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * n_rep, q_len, 16, generator=gen)
    key = torch.randn(batch, kv_heads, kv_len, 16, generator=gen)
    value = torch.randn(batch, kv_heads, kv_len, 16, generator=gen)
    allowed = torch.rand(batch, 1, q_len, kv_len + 3, generator=gen) > 0.4  # longer than the keys: sliced
    allowed[..., 0] = True  # every query sees at least one key
    mask = allowed if boolean else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    return query, key, value, mask


@pytest.mark.parametrize("n_rep", [2, 3])
@pytest.mark.parametrize("q_len", [2, 5])
@pytest.mark.parametrize("boolean", [False, True])
def test_folded_attention_equals_sdpa_with_repeated_heads(n_rep, q_len, boolean):
    module = _Module(n_rep)
    query, key, value, mask = _case(2, 2, n_rep, q_len, 11, boolean)
    assert attention._foldable(module, query, key, value, mask, 0.0, {}) == n_rep
    got, _ = tree_sdpa_attention(module, query, key, value, mask, scaling=0.3)
    expected, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask[..., :11], scaling=0.3)
    assert got.shape == (2, q_len, 2 * n_rep, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_calls_it_cannot_fold_go_to_transformers_sdpa():
    module = _Module(2)
    query, key, value, mask = _case(1, 2, 2, 3, 7, False)
    fold = attention._foldable
    assert fold(module, query[:, :, :1], key, value, mask[:, :, :1], 0.0, {}) == 0  # one token
    assert fold(module, query, key, value, None, 0.0, {}) == 0  # no mask
    assert fold(module, query, key, value, mask.expand(1, 4, 3, 10), 0.0, {}) == 0  # a mask per head
    assert fold(_Module(1), query[:, :2], key, value, mask, 0.0, {}) == 0  # no grouped heads
    assert fold(module, query, key, value, mask, 0.1, {}) == 0  # dropout
    for special in ("softcap", "s_aux", "position_bias"):
        assert fold(module, query, key, value, mask, 0.0, {special: 1.0}) == 0
    assert fold(module, query, key, value, mask, 0.0, {"output_attentions": True}) == 0
    meta = [t.to("meta") for t in (query, key, value, mask)]
    assert fold(module, *meta, 0.0, {}) == 0  # not a CPU tensor: not measured there yet
    assert fold(module, query, key, value, mask, 0.0, {"position_ids": None, "use_cache": True}) == 2
    got, _ = tree_sdpa_attention(module, query[:, :, :1], key, value, mask[:, :, :1, :7])
    expected, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query[:, :, :1], key, value, mask[:, :, :1, :7])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch,strategy", [("llama", "static_tree"), ("qwen2_vl", "static_tree"), ("llama", "laspec")])
def test_generate_runs_its_rounds_on_tree_sdpa_and_restores_sdpa(arch, strategy, monkeypatch):
    folded = []
    original = attention._foldable

    def spy(*args):
        result = original(*args)
        folded.append(result)
        return result

    monkeypatch.setattr(attention, "_foldable", spy)
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=20, do_sample=False)
    assert not folded  # plain generate never sees it
    if strategy == "laspec":
        from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel

        torch.manual_seed(0)
        drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    else:
        drafter = build_drafter(arch, target, "small")
    out = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                          spec_strategy=strategy)
    assert torch.equal(out, expected)
    assert any(folded)  # tree rounds ran folded
    assert target.config.get_text_config()._attn_implementation == "sdpa"
    if strategy != "laspec":
        assert drafter.config.get_text_config()._attn_implementation == "sdpa"


def test_tree_attention_leaves_other_implementations_alone():
    target = build_model("llama", attn_implementation="eager")
    with tree_attention(target):
        assert target.config._attn_implementation == "eager"
    target = build_model("llama")
    with tree_attention(target):
        assert target.config._attn_implementation == TREE_SDPA
    assert target.config._attn_implementation == "sdpa"


def test_the_folded_mask_is_shared_only_by_the_same_unmodified_mask():
    from hf_adaptive_spec.adapters.attention import _folded_mask

    mask = torch.zeros(1, 1, 3, 7)
    mask[..., 5:] = float("-inf")
    folded = _folded_mask(mask, 1, 2, 3, 7)
    assert folded.shape == (1, 1, 6, 7)
    assert torch.equal(folded, mask.unsqueeze(2).expand(1, 1, 2, 3, 7).reshape(1, 1, 6, 7))
    assert _folded_mask(mask, 1, 2, 3, 7) is folded  # the next layer of the same forward
    assert _folded_mask(mask, 1, 3, 3, 7) is not folded  # other arguments
    mask[..., 0] = float("-inf")  # modified in place: folded again
    again = _folded_mask(mask, 1, 2, 3, 7)
    assert again is not folded and bool(torch.isinf(again[..., 0]).all())
    other = mask.clone()
    assert _folded_mask(other, 1, 2, 3, 7) is not again  # an equal but different tensor: folded again


def test_tree_attention_drops_the_folded_mask_on_exit():
    from hf_adaptive_spec.adapters import attention

    model = build_model("llama")
    with attention.tree_attention(model):
        attention._folded_mask(torch.zeros(1, 1, 2, 5), 1, 2, 2, 5)
        assert getattr(attention._FOLDED, "entry", None) is not None
    assert getattr(attention._FOLDED, "entry", None) is None
