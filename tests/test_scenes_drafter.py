"""The image-aware scenes drafter: assembly and the Auto classes, training (loss falls, resume), and decoding with it
(every strategy and every visual selection equal to plain greedy; M = 0 runs no selection work)."""

import random

import pytest
import torch

from hf_adaptive_spec.scenes.dataset import make_scenes
from test_scenes_vlm import _inputs, easy_vqa_archive, tiny_language_model, tiny_vlm  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_drafter(tiny_vlm):
    from hf_adaptive_spec.scenes.drafter import build_scenes_drafter

    model, _ = tiny_vlm
    return build_scenes_drafter(model, seed=2)


def test_drafter_parts_assemble_into_a_checkpoint_the_auto_classes_load(tiny_vlm, tiny_drafter, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hf_adaptive_spec.scenes.drafter import (TEXT_CONFIG, assemble_scenes_drafter, fetch_scenes_drafter,
                                                 save_drafter_parts)

    model, processor = tiny_vlm
    drafter, embedding_map = tiny_drafter
    assert drafter.config.text_config.hidden_size == TEXT_CONFIG["hidden_size"]
    assert drafter.config.image_token_index == model.config.image_token_index
    assert drafter.get_output_embeddings().weight.data_ptr() == drafter.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(drafter.get_input_embeddings().weight,
                               model.get_input_embeddings().weight @ embedding_map)
    target_folder = tmp_path / "target"
    model.save_pretrained(target_folder)
    processor.save_pretrained(target_folder)
    parts = save_drafter_parts(drafter, embedding_map, tmp_path / "parts", {"steps": 0})
    assert sum(f.stat().st_size for f in parts.iterdir()) < 10e6  # no embedding, no vision tower
    inputs = _inputs(processor, [make_scenes("test", 1)[0].image])
    with torch.no_grad():
        expected = drafter(**inputs).logits
    for folder in (assemble_scenes_drafter(target_folder, parts, tmp_path / "full"),
                   fetch_scenes_drafter(cache_dir=tmp_path / "cache", parts=parts, progress=False,
                                        target=target_folder)):
        loaded = AutoModelForImageTextToText.from_pretrained(folder).eval()
        assert (folder / "README.md").is_file() and AutoProcessor.from_pretrained(folder) is not None
        with torch.no_grad():
            torch.testing.assert_close(loaded(**inputs).logits, expected)
        loaded.save_pretrained(tmp_path / "again")
        again = AutoModelForImageTextToText.from_pretrained(tmp_path / "again").eval()
        with torch.no_grad():
            torch.testing.assert_close(again(**inputs).logits, expected)
    with pytest.raises(FileNotFoundError, match="train-scenes-drafter"):
        fetch_scenes_drafter(cache_dir=tmp_path / "cache", parts=tmp_path / "nothing")


def test_a_tiny_training_run_lowers_the_loss_and_resumes_to_the_same_weights(tiny_vlm, tmp_path):
    from hf_adaptive_spec.scenes.drafter import build_scenes_drafter
    from hf_adaptive_spec.training.scenes_drafter import (DrafterTrainConfig, evaluate_drafter, make_drafter_data,
                                                          train_scenes_drafter)

    model, processor = tiny_vlm
    config = DrafterTrainConfig(scenes=6, max_new_tokens=8, generate_batch=3, steps=40, batch=4, lr=3e-3,
                                eval_every=0, checkpoint_every=20, visual_keep=(0, 2, 8))
    records = make_drafter_data(model, processor, make_scenes("train", 6), config, progress=False)
    assert all(len(r["ids"]) > r["prompt_length"] for r in records)
    assert all(len(r["selected"][8]) == 8 and len(set(r["selected"][8])) == 8 for r in records)
    embedding = model.get_input_embeddings().weight.detach()
    pad = processor.tokenizer.pad_token_id

    def run(out_dir, steps, resume=False):
        drafter, embedding_map = build_scenes_drafter(model, seed=3)
        cfg = DrafterTrainConfig(**{**config.__dict__, "steps": steps})
        result = train_scenes_drafter(drafter, embedding_map, embedding, records, [], pad, cfg, out_dir=out_dir,
                                      resume=resume, progress=False, log=lambda *_: None)
        return drafter, result

    fresh, _ = build_scenes_drafter(model, seed=3)
    before = evaluate_drafter(fresh, _, embedding, records, pad)["loss"]
    drafter, result = run(tmp_path / "a", 40)
    after = evaluate_drafter(drafter, result["embedding_map"], embedding, records, pad)["loss"]
    assert after < before - 1.0, (before, after)
    # per-position selections: each answer position's M tokens, picked by the query before it
    from hf_adaptive_spec.training.scenes_drafter import add_round_selections

    add_round_selections(model, records, config, progress=False)
    for record in records:
        answer = len(record["ids"]) - record["prompt_length"]
        assert record["per_position"][8].shape == (answer, 8) and set(record["per_position"]) == {2, 8}
        assert int(record["per_position"][8].max()) < 64
    round_config = DrafterTrainConfig(**{**config.__dict__, "round_selection": 1.0, "visual_dropout": 1.0,
                                         "visual_keep": (2,)})
    from hf_adaptive_spec.training.scenes_drafter import _batch

    batch = _batch(records[:2], pad, model.config.image_token_index, random.Random(0), round_config)
    image = batch["input_ids"] == model.config.image_token_index
    for row, record in enumerate(records[:2]):
        start = batch["input_ids"].shape[1] - len(record["ids"])
        first_answer = start + record["prompt_length"]
        seen = batch["visible"][row][:, image[row]]  # (queries, 64)
        assert seen[first_answer - 1].nonzero().squeeze(1).tolist() == sorted(record["selected"][2])
        assert seen[first_answer].nonzero().squeeze(1).tolist() == sorted(record["per_position"][2][0].tolist())
        assert bool(batch["visible"][row][:, ~image[row]].all())
    assert evaluate_drafter(drafter, result["embedding_map"], embedding, records, pad, keep=2, per_round=True)["tokens"]
    # stop at 20 (a checkpoint), resume to 40: the same weights as one run
    run(tmp_path / "b", 20)
    resumed, again = run(tmp_path / "b", 40, resume=True)
    assert [h["step"] for h in again["history"]] == list(range(1, 41))
    for (name, a), (_, b) in zip(drafter.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_every_strategy_and_visual_selection_with_the_drafter_equals_plain_greedy(tiny_vlm, tiny_drafter,
                                                                                 batch_size):
    import hf_adaptive_spec  # noqa: F401 (the generate hook)

    model, processor = tiny_vlm
    drafter, _ = tiny_drafter
    inputs = _inputs(processor, [s.image for s in make_scenes("test", batch_size, seed=7)])
    expected = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    if batch_size == 1:  # stock assisted generation (batch 1 only)
        assert torch.equal(model.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter),
                           expected)
    for strategy in ("chain", "static_tree", "sage"):
        for visual in ({}, {"visual_tokens": 0}, {"visual_tokens": 2}, {"visual_tokens": 8},
                       {"visual_tokens": 2, "visual_selection": "round"}, {"visual_tokens": 64}):
            out = model.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                                 spec_strategy=strategy, spec_config=visual)
            assert torch.equal(out, expected), (strategy, visual)


def test_hidden_visual_slots_are_what_the_drafter_does_not_see(tiny_vlm, tiny_drafter):
    """After a prefill with M selected visual tokens, the drafter's next-token logits equal one forward over the
    prompt and that token whose attention mask hides the other visual slots, positions unchanged; M = 0 hides
    every visual slot (and differs from seeing the image)."""
    from hf_adaptive_spec.drafters.independent import IndependentDrafter

    model, processor = tiny_vlm
    drafter, _ = tiny_drafter
    inputs = _inputs(processor, [make_scenes("test", 1, seed=9)[0].image])
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    image = ids == model.config.image_token_index
    token = torch.tensor([[5]])
    extended = {**inputs, "input_ids": torch.cat([ids, token], 1)}
    positions = torch.arange(ids.shape[1] + 1)[None]
    with torch.no_grad():
        seeing = drafter(**{**extended, "attention_mask": torch.ones_like(extended["input_ids"])},
                         position_ids=positions).logits[:, -1]
    for count in (0, 3):
        independent = IndependentDrafter(drafter, model, num_visual_tokens=count)
        with torch.no_grad(), independent.prefill_scope(ids):
            model(**inputs)
        independent.prefill(ids, mask, inputs)
        seen = independent.runner.slot_valid
        assert int((seen & image).sum()) == count and bool(seen[~image].all())
        assert torch.equal(independent.runner.next_position, mask.sum(-1))
        with torch.no_grad():
            drafted = independent.runner.forward(token, torch.tensor([[-1]]), torch.tensor([[True]])).logits[:, -1]
            alone = drafter(**{**extended, "attention_mask": torch.cat([seen, torch.ones_like(token, dtype=torch.bool)],
                                                                        1).long()},
                            position_ids=positions).logits[:, -1]
        torch.testing.assert_close(drafted, alone, rtol=1e-4, atol=1e-4)
        if count == 0:
            assert not torch.allclose(drafted, seeing, atol=1e-4)


def test_no_selection_work_without_a_choice_to_make(tiny_vlm, tiny_drafter, monkeypatch):
    import hf_adaptive_spec  # noqa: F401
    from hf_adaptive_spec.drafters import visual_view

    model, processor = tiny_vlm
    drafter, _ = tiny_drafter
    calls = []
    real = visual_view.select_visual_tokens
    monkeypatch.setattr(visual_view, "select_visual_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    captures = []
    real_capture = visual_view.QueryCapture
    monkeypatch.setattr(visual_view, "QueryCapture", lambda *a, **k: captures.append(1) or real_capture(*a, **k))
    inputs = _inputs(processor, [make_scenes("test", 1, seed=4)[0].image])
    for visual, selections in (({"visual_tokens": 0}, 0), ({"visual_tokens": 64}, 0), ({}, 0),
                               ({"visual_tokens": 2}, 1)):
        calls.clear()
        captures.clear()
        model.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter, spec_strategy="chain",
                       spec_config=visual)
        assert (len(calls), len(captures)) == (selections, selections), visual
    model.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter, spec_strategy="chain",
                   spec_config={"visual_tokens": 2, "visual_selection": "round"})
    assert len(calls) > 2  # once after the prefill, then after every round


def test_visual_tokens_is_refused_where_it_cannot_apply(tiny_vlm, tiny_language_model):
    import hf_adaptive_spec
    from transformers import AutoModelForCausalLM

    from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel

    model, processor = tiny_vlm
    inputs = _inputs(processor, [make_scenes("test", 1)[0].image])
    text_drafter = AutoModelForCausalLM.from_pretrained(tiny_language_model).eval()
    with pytest.raises(ValueError, match="reads no images"):
        model.generate(**inputs, max_new_tokens=4, assistant_model=text_drafter, spec_strategy="sage",
                       spec_config={"visual_tokens": 4})
    laspec = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(model, block_size=4)).eval()
    with pytest.raises(ValueError, match="num_visual_tokens"):
        model.generate(**inputs, max_new_tokens=4, assistant_model=laspec, spec_strategy="sage",
                       spec_config={"visual_tokens": 4})
    with pytest.raises(ValueError, match="visual_selection"):
        model.generate(**inputs, max_new_tokens=4, assistant_model=text_drafter, spec_strategy="chain",
                       spec_config={"visual_tokens": 4, "visual_selection": "always"})
    assert hf_adaptive_spec is not None


def test_the_shipped_drafter_reads_the_image_and_decodes_exactly(tmp_path_factory, easy_vqa_archive):  # noqa: F811
    """The real scenes-vlm-drafter-16m (assembled here from the real scenes VLM and the shipped parts): every
    strategy, with the whole image and with 8 tokens chosen per round, equals plain greedy at batch 1 and 2; it
    drafts the scene's colours (tau well above 1), and blind (visual_tokens=0) it accepts fewer tokens."""
    import hf_adaptive_spec  # noqa: F401
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from conftest import fetch_real_smollm2
    from hf_adaptive_spec.scenes.drafter import fetch_scenes_drafter
    from hf_adaptive_spec.scenes.vlm import fetch_scenes_vlm

    _, language = fetch_real_smollm2(tmp_path_factory)
    cache = tmp_path_factory.mktemp("scenes_drafter")
    target_path = fetch_scenes_vlm(cache_dir=cache, language_model=language, progress=False)
    model = AutoModelForImageTextToText.from_pretrained(target_path).eval()
    processor = AutoProcessor.from_pretrained(target_path)
    drafter = AutoModelForImageTextToText.from_pretrained(
        fetch_scenes_drafter(cache_dir=cache, target=target_path, progress=False)).eval()
    scenes = make_scenes("test", 2, start=8)
    inputs = _inputs(processor, [s.image for s in scenes])
    plain = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    taus = {}
    for strategy, config in (("chain", {}), ("static_tree", {}), ("sage", {}),
                             ("sage", {"visual_tokens": 8, "visual_selection": "round"}), ("chain", {"visual_tokens": 0})):
        for rows in (slice(0, 1), slice(0, 2)):
            batch = _inputs(processor, [s.image for s in scenes[rows]])
            expected = plain[rows] if rows.stop == 2 else model.generate(**batch, max_new_tokens=32, do_sample=False)
            out = model.generate(**batch, max_new_tokens=32, do_sample=False, assistant_model=drafter,
                                 spec_strategy=strategy, spec_config=config, return_dict_in_generate=True)
            assert torch.equal(out.sequences, expected), (strategy, config, rows)
            taus[(strategy, str(config), rows.stop)] = out.spec_stats.mean_accepted_length
    assert taus[("chain", "{}", 2)] > 3.0, taus
    assert taus[("chain", "{'visual_tokens': 0}", 2)] < taus[("chain", "{}", 2)], taus
