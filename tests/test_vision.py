"""Visual token selection: int8 key store, cross-layer vote, and query capture inside tiny HF VLMs."""

import math

import pytest
import torch
from tiny_models import IMAGE_ID, build_model, make_inputs
from transformers import DynamicCache

from hf_adaptive_spec import ops
from hf_adaptive_spec.adapters.attention import tree_attention
from hf_adaptive_spec.adapters.compat import cache_argument
from hf_adaptive_spec.drafters.vision import CAPTURE_ATTENTION, QueryCapture, VisualKeyStore, select_visual_tokens


def _cache(keys_per_layer):
    cache = DynamicCache()
    for layer, keys in enumerate(keys_per_layer):
        cache.update(keys, torch.zeros_like(keys), layer)
    return cache


def test_store_keeps_visual_keys_within_the_int8_bound():
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(2, 2, 10, 8, generator=gen) * 3 for _ in range(3)]  # (B, H_kv, S, D)
    visual_mask = torch.zeros(2, 10, dtype=torch.bool)
    visual_mask[0, 2:6] = True  # 4 visual tokens
    visual_mask[1, [1, 3, 4, 8, 9]] = True  # 5
    store = VisualKeyStore.from_cache(_cache(keys), [0, 2], visual_mask)
    assert store.layer_ids == (0, 2) and store.counts == (4, 5) and store.has_padding
    assert store.positions.tolist() == [[2, 3, 4, 5, -1], [1, 3, 4, 8, 9]]
    assert store.valid.tolist() == [[True] * 4 + [False], [True] * 5]
    for layer in (0, 2):
        assert store.quantized[layer].dtype == torch.int8 and store.quantized[layer].shape == (2, 2, 5, 8)
        original = keys[layer].gather(2, store.positions.clamp_min(0)[:, None, :, None].expand(2, 2, 5, 8))
        error = (store.dequantize(layer) - original).abs()  # (B, H_kv, T, D)
        bound = store.scales[layer] / 2 + 1e-6
        assert (error <= bound)[store.valid[:, None].expand(2, 2, 5)].all()
        assert (store.quantized[layer][0, :, 4] == 0).all()  # padding slot holds nothing


def _crafted_case(batch=1, heads=4, kv_heads=2, dim=16, seq=12, favourites=((3, 3.0), (7, 2.5)), seed=0):
    """Keys small and random except at the favourite positions, which align with every head's query."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(dim, generator=gen)
    direction = direction / direction.norm()
    query = 4.0 * direction.expand(batch, heads, dim).clone()  # (B, H, D)
    layers = []
    for _ in range(2):
        keys = 0.1 * torch.randn(batch, kv_heads, seq, dim, generator=gen)
        for position, strength in favourites:
            keys[:, :, position] = strength * direction
        layers.append(keys)
    return query, layers


def test_selection_returns_the_positions_the_query_attends_to_most():
    query, layers = _crafted_case()
    visual_mask = torch.zeros(1, 12, dtype=torch.bool)
    visual_mask[0, 2:10] = True
    store = VisualKeyStore.from_cache(_cache(layers), [0, 1], visual_mask)
    queries = {0: query, 1: query}
    indices, cost = select_visual_tokens(queries, store, m_per_layer=2, keep=2)
    assert indices.tolist() == [[3, 7]] and 0 <= cost < 1.0
    # the same ranking as exact float attention, averaged over heads (GQA: 2 query heads per key head)
    keys = layers[0][:, :, 2:10].repeat_interleave(2, dim=1)  # (B, H, T, D)
    exact = torch.softmax(torch.einsum("bhd,bhtd->bht", query, keys) / math.sqrt(16), -1).mean(1)  # (B, T)
    assert (exact.topk(2).indices + 2).tolist() == indices.tolist()
    top1, none = select_visual_tokens(queries, store, m_per_layer=1, keep=1, timed=False)
    assert top1.tolist() == [[3]] and none is None


def test_selection_with_rows_of_different_lengths_equals_each_row_alone():
    query, layers = _crafted_case(batch=2, favourites=((4, 3.0), (5, 2.8), (8, 2.5)))
    visual_mask = torch.zeros(2, 12, dtype=torch.bool)
    visual_mask[0, 3:7] = True  # holds favourites 4, 5
    visual_mask[1, 2:11] = True  # holds 4, 5, 8
    queries = {0: query, 1: query * 0.5}
    store = VisualKeyStore.from_cache(_cache(layers), [0, 1], visual_mask)
    indices, _ = select_visual_tokens(queries, store, m_per_layer=3, keep=3)
    for row in range(2):
        row_cache = _cache([k[row : row + 1] for k in layers])
        alone = VisualKeyStore.from_cache(row_cache, [0, 1], visual_mask[row : row + 1])
        expected, _ = select_visual_tokens({k: q[row : row + 1] for k, q in queries.items()}, alone, 3, 3)
        assert indices[row].tolist() == expected[0].tolist()
    assert set(indices[1].tolist()) == {4, 5, 8}
    assert indices[0, :2].tolist() == [4, 5]
    # more kept than row 0 holds: real tokens first, then -1
    wide, _ = select_visual_tokens(queries, store, m_per_layer=9, keep=8)
    assert wide.shape == (2, 8) and sorted(wide[0, :4].tolist()) == [3, 4, 5, 6] and wide[0, 4:].tolist() == [-1] * 4
    assert len(set(wide[1].tolist())) == 8 and set(wide[1].tolist()) <= set(range(2, 11))


def test_selection_rejects_layers_missing_from_the_store():
    query, layers = _crafted_case()
    store = VisualKeyStore.from_cache(_cache(layers), [0], torch.ones(1, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not hold"):
        select_visual_tokens({1: query}, store, 2)


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_capture_keeps_logits_and_records_queries(arch):
    model = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    with torch.no_grad():
        stock = model(**inputs).logits
        with tree_attention(model):  # what the capture delegates to (grouped-query heads folded)
            expected = model(**inputs).logits
        with QueryCapture(model, layer_ids=[0, 1]) as capture:
            assert model.config.get_text_config()._attn_implementation == CAPTURE_ATTENTION
            assert model.config.vision_config._attn_implementation == "sdpa"
            got = model(**inputs).logits
    assert torch.equal(got, expected)
    # folding the heads changes sdpa's blocking: bit-equal to stock sdpa on some CPUs, a few ulps off on others
    torch.testing.assert_close(got, stock, rtol=0, atol=1e-5)
    assert model.config.get_text_config()._attn_implementation == "sdpa"  # restored
    text = model.config.get_text_config()
    length = inputs["input_ids"].shape[1]
    assert capture.queries[0].shape == (2, text.num_attention_heads, length, 16)
    last = capture.query_at(-1)
    per_row = capture.query_at(torch.tensor([length - 1, 3]))
    assert torch.equal(per_row[1][0], last[1][0]) and torch.equal(per_row[1][1], capture.queries[1][1, :, 3])


def test_capture_matches_sdpa_for_a_multi_token_step_with_a_4d_mask():
    """Prefill with a cache, then a 3-token chain verified in one forward under an additive 4D mask."""
    model = build_model("llava")
    inputs = make_inputs("llava", batch_size=2)
    mask = inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    step_ids = torch.tensor([[20, 21, 22], [30, 31, 32]])
    parents = torch.tensor([[-1, 0, 1]] * 2)
    step_mask, depths = ops.tree_attention_mask(parents, torch.ones(2, 3, dtype=torch.bool), mask.bool(), torch.float32)
    step_positions = mask.sum(-1, keepdim=True) + depths  # (B, 3)

    def run():
        cache = {cache_argument(model): DynamicCache(config=model.config)}
        with torch.no_grad():
            model(**inputs, position_ids=positions, use_cache=True, **cache)
            return model(input_ids=step_ids, attention_mask=step_mask, position_ids=step_positions,
                         use_cache=True, **cache).logits

    stock = run()
    with tree_attention(model):  # what the capture delegates to
        expected = run()
    with QueryCapture(model, layer_ids=[1]) as capture:
        got = run()
    assert torch.equal(got, expected)
    torch.testing.assert_close(got, stock, rtol=0, atol=1e-5)
    assert capture.queries[1].shape == (2, 2, 3, 16)


def test_selection_in_a_tiny_vlm_returns_image_positions():
    arch = "qwen2_vl"
    model = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)  # rows hold 4 and 6 image tokens
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), QueryCapture(model, layer_ids=[0, 1]) as capture:
        model(**inputs, use_cache=True, **{cache_argument(model): cache})
    visual_mask = inputs["input_ids"] == IMAGE_ID
    store = VisualKeyStore.from_cache(cache, [0, 1], visual_mask)
    assert store.counts == (4, 6)
    indices, cost = select_visual_tokens(capture.query_at(-1), store, m_per_layer=3, keep=3)
    assert indices.shape == (2, 3) and cost >= 0
    for row in range(2):
        assert visual_mask[row, indices[row]].all()
        assert len(set(indices[row].tolist())) == 3
    wide, _ = select_visual_tokens(capture.query_at(-1), store, m_per_layer=8, keep=8)
    assert wide.shape == (2, 6) and (wide[0, 4:] == -1).all() and (wide[0, :4] >= 0).all()
    assert sorted(wide[1].tolist()) == torch.nonzero(visual_mask[1]).squeeze(1).tolist()
