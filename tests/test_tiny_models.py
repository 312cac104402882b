"""Checks for the tiny model / input factory in tests/tiny_models.py."""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_models as tm  # noqa: E402

MAX_NEW = 12


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _model(arch: str, attn: str = "sdpa"):
    return tm.build_model(arch, attn_implementation=attn)


def _new_tokens(out: torch.Tensor, prompt_len: int) -> list[list[int]]:
    """Generated tokens per row, cut after the first EOS (drops the pad that follows it)."""
    rows = []
    for row in out[:, prompt_len:].tolist():
        if tm.EOS_ID in row:
            row = row[: row.index(tm.EOS_ID) + 1]
        rows.append(row)
    return rows


def _greedy(model, inputs, **kw) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, **kw)
    prompt_len = inputs["input_ids"].shape[1]
    assert torch.equal(out[:, :prompt_len], inputs["input_ids"])
    return _new_tokens(out, prompt_len)


# --- factory structure -----------------------------------------------------


def test_constants():
    assert set(tm.VLM_ARCHS) < set(tm.ARCHS) and len(tm.VLM_ARCHS) == 6
    assert set(tm.ARCHS) - set(tm.VLM_ARCHS) == {"llama", "qwen2", "qwen3"}
    assert len(set(tm.SPECIAL_IDS)) == len(tm.SPECIAL_IDS)
    assert max(tm.SPECIAL_IDS) < tm.TEXT_TOKEN_RANGE[0] < tm.TEXT_TOKEN_RANGE[1] == tm.VOCAB_SIZE


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_build_model(arch):
    model = _model(arch)
    expected = "ForConditionalGeneration" if arch in tm.VLM_ARCHS else "ForCausalLM"
    assert type(model).__name__.endswith(expected)
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    text_cfg = model.config.get_text_config()
    assert text_cfg.vocab_size == tm.VOCAB_SIZE
    assert text_cfg.num_hidden_layers == 2 and text_cfg.hidden_size == 32
    assert model.get_output_embeddings().weight.shape[0] == tm.VOCAB_SIZE
    for cfg in (model.config, text_cfg, model.generation_config):
        assert cfg.pad_token_id == tm.PAD_ID
        assert cfg.eos_token_id == tm.EOS_ID
    if arch in tm.VLM_ARCHS:
        assert model.config.image_token_id == tm.IMAGE_ID
    if arch in tm.QWEN_VL_ARCHS:
        assert model.config.vision_start_token_id == tm.VSTART_ID
        assert model.config.vision_end_token_id == tm.VEND_ID
    # same seed -> same weights; other seed -> other weights
    again = tm.build_model(arch, seed=0)
    other = tm.build_model(arch, seed=5)
    sd, sd_again, sd_other = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd_again[k]) for k in sd)
    assert not torch.equal(sd["lm_head.weight"], sd_other["lm_head.weight"])


def test_build_model_options():
    model = tm.build_model("qwen2_vl", num_layers=3, hidden_size=64, attn_implementation="eager")
    text_cfg = model.config.get_text_config()
    assert text_cfg.num_hidden_layers == 3 and text_cfg.hidden_size == 64
    assert text_cfg._attn_implementation == "eager"
    inputs = tm.make_inputs("qwen2_vl", batch_size=2)
    assert len(_greedy(model, inputs)) == 2


@pytest.mark.parametrize("arch", tm.ARCHS)
@pytest.mark.parametrize("with_image", [True, False])
def test_make_inputs_layout(arch, with_image):
    lengths = [5, 9, 3]
    inputs = tm.make_inputs(arch, batch_size=3, prompt_lengths=lengths, with_image=with_image)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.dtype == torch.long and ids.shape == mask.shape
    use_image = with_image and arch in tm.VLM_ARCHS
    for i, n_text in enumerate(lengths):
        row = ids[i][mask[i].bool()]
        n_real = int(mask[i].sum())
        # left padding: pads first, then the real tokens
        assert mask[i, ids.shape[1] - n_real:].all() and not mask[i, : ids.shape[1] - n_real].any()
        assert (ids[i, : ids.shape[1] - n_real] == tm.PAD_ID).all()
        text = row[row >= tm.TEXT_TOKEN_RANGE[0]]
        assert len(text) == n_text
        assert (row < tm.VOCAB_SIZE).all()
        n_img = int((row == tm.IMAGE_ID).sum())
        assert n_img == (tm.num_image_tokens(arch, i) if use_image else 0)
        assert not ((row == tm.PAD_ID) | (row == tm.EOS_ID) | (row == tm.BOS_ID)).any()
        if use_image and arch in tm.QWEN_VL_ARCHS:
            start = int((row == tm.VSTART_ID).nonzero())
            assert row[start + 1 + n_img] == tm.VEND_ID
            assert (row[start + 1 : start + 1 + n_img] == tm.IMAGE_ID).all()
    if arch in tm.QWEN_VL_ARCHS:
        assert torch.equal(inputs["mm_token_type_ids"], (ids == tm.IMAGE_ID).long())
    if not use_image:
        assert "pixel_values" not in inputs
    elif arch in tm.QWEN_VL_ARCHS:
        grid = inputs["image_grid_thw"]
        assert grid.shape == (3, 3)
        assert inputs["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    elif arch == "llava_onevision":
        assert inputs["pixel_values"].dim() == 5 and inputs["image_sizes"].shape == (3, 2)
    else:
        assert inputs["pixel_values"].shape[0] == 3
    # deterministic, and seed-dependent
    again = tm.make_inputs(arch, batch_size=3, prompt_lengths=lengths, with_image=with_image)
    assert all(torch.equal(inputs[k], again[k]) for k in inputs)
    other = tm.make_inputs(arch, batch_size=3, prompt_lengths=lengths, with_image=with_image, seed=1)
    assert not torch.equal(inputs["input_ids"], other["input_ids"])


def test_default_prompt_lengths_differ():
    inputs = tm.make_inputs("llama", batch_size=2)
    lengths = inputs["attention_mask"].sum(-1).tolist()
    assert lengths[0] != lengths[1]
    assert inputs["attention_mask"][0, 0] == 0  # the shorter row is left padded


# --- generation behaviour ----------------------------------------------------


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_generate_batch_matches_single(arch):
    model = _model(arch)
    inputs = tm.make_inputs(arch, batch_size=2)
    batch_out = _greedy(model, inputs)
    assert _greedy(model, inputs) == batch_out, "greedy generate is not deterministic"
    for i, row_inputs in enumerate(tm.split_rows(arch, inputs)):
        single = _greedy(model, row_inputs)
        assert single == [batch_out[i]], f"row {i}: batch-2 output differs from batch-1 output"
        assert len(set(batch_out[i])) > 1, f"row {i}: degenerate output {batch_out[i]}"
        assert len(batch_out[i]) == MAX_NEW  # no early EOS with the default seeds
        assert not set(batch_out[i]) & set(tm.SPECIAL_IDS)


@pytest.mark.parametrize("arch", tm.VLM_ARCHS)
def test_vlm_text_only_batch_matches_single(arch):
    model = _model(arch)
    inputs = tm.make_inputs(arch, batch_size=2, with_image=False)
    batch_out = _greedy(model, inputs)
    for i, row_inputs in enumerate(tm.split_rows(arch, inputs)):
        assert _greedy(model, row_inputs) == [batch_out[i]]


@pytest.mark.parametrize("arch", tm.VLM_ARCHS)
def test_image_matters(arch):
    model = _model(arch)
    inputs = tm.make_inputs(arch, batch_size=2)
    other = dict(inputs)
    other["pixel_values"] = torch.randn(inputs["pixel_values"].shape, generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1]
        logits_other = model(**other).logits[:, -1]
    # every row's prefill logits depend on its image
    assert ((logits - logits_other).abs().amax(-1) > 1e-2).all()
    assert _greedy(model, inputs) != _greedy(model, other)


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_eager_matches_sdpa(arch):
    inputs = tm.make_inputs(arch, batch_size=2)
    assert _greedy(_model(arch, "eager"), inputs) == _greedy(_model(arch), inputs)


# --- drafters ----------------------------------------------------------------


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_build_drafter(arch):
    target = _model(arch)
    copy = tm.build_drafter(arch, target, "copy")
    assert copy is not target and type(copy) is type(target)
    target_sd = target.state_dict()
    assert all(torch.equal(v, target_sd[k]) for k, v in copy.state_dict().items())
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(copy.parameters(), target.parameters()))

    small = tm.build_drafter(arch, target, "small")
    assert type(small) is type(target) and not small.training
    cfg, tcfg = small.config.get_text_config(), target.config.get_text_config()
    assert cfg.num_hidden_layers == 1
    assert cfg.vocab_size == tcfg.vocab_size
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        assert getattr(cfg, name) == getattr(tcfg, name)
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(small.config, name, None) == getattr(target.config, name, None)
    assert not torch.equal(small.get_output_embeddings().weight, target.get_output_embeddings().weight)

    text = tm.build_drafter(arch, target, "text")
    assert type(text).__name__ == "LlamaForCausalLM"
    assert text.config.vocab_size == tcfg.vocab_size and text.config.num_hidden_layers == 1
    assert text.generation_config.eos_token_id == tm.EOS_ID

    with pytest.raises(ValueError):
        tm.build_drafter(arch, target, "nope")


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl", "llava_onevision"])
@pytest.mark.parametrize("kind", ["small", "copy"])
def test_stock_assisted_decoding_equals_greedy(arch, kind):
    model = _model(arch)
    inputs = tm.make_inputs(arch, batch_size=1)
    drafter = tm.build_drafter(arch, model, kind)
    assert _greedy(model, inputs, assistant_model=drafter) == _greedy(model, inputs)


@pytest.mark.parametrize("arch", ["llama", "llava"])
def test_stock_assisted_decoding_text_drafter(arch):
    # (Qwen-VL targets cannot use a text drafter in stock assisted decoding: generate forwards
    # mm_token_type_ids to the Llama drafter, which rejects it.)
    model = _model(arch)
    inputs = tm.make_inputs(arch, batch_size=1)
    drafter = tm.build_drafter(arch, model, "text")
    assert _greedy(model, inputs, assistant_model=drafter) == _greedy(model, inputs)


def test_onevision_token_count_matches_processor():
    # Our anyres count must equal LlavaOnevisionProcessor's (the model itself only checks that the
    # placeholder count equals its feature count, which our inputs also satisfy).
    import types

    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor as P

    fake = types.SimpleNamespace(
        image_processor=types.SimpleNamespace(image_grid_pinpoints=tm.ONEVISION_PINPOINTS),
        num_image_tokens=(tm.ONEVISION_TILE // tm.ONEVISION_PATCH) ** 2,
        vision_aspect_ratio="anyres_max_9",
    )
    fake._get_unpadded_features = types.MethodType(P._get_unpadded_features, fake)
    for size in [*tm.ONEVISION_IMAGE_SIZES, (6, 12), (16, 8), (5, 7)]:
        expected = P._get_number_of_features(fake, *size, tm.ONEVISION_TILE, tm.ONEVISION_TILE)
        assert tm._onevision_counts(size)[1] == expected
