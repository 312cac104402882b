"""Scenes from easy-vqa, the scenes VLM (assembly, training, Auto round trip) and speculative decoding on it."""

import hashlib
import io
import zipfile

import pytest
import torch

from conftest import fetch_real_smollm2
from hf_adaptive_spec.scenes import dataset as scenes_module
from hf_adaptive_spec.scenes.dataset import (COLORS, DESCRIBE_REQUEST, POSITIONS, image_labels,
                                     labels_from_questions, make_scenes, scene_messages)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_labels_from_questions_reads_open_yes_no_and_negated_questions():
    questions = [
        ["what color is the circle?", "red", 0],  # colour and shape of image 0
        ["is there not a blue shape?", "yes", 1],  # negated: blue excluded
        ["does the image contain a triangle?", "yes", 1],
        *[[f"is there a {c} shape?", "no", 1] for c in COLORS if c not in ("blue", "teal")],
        ["is no teal shape present?", "no", 1],  # negated "no": teal holds
        ["what shape is present?", "rectangle", 2],  # colour never determined: left out
    ]
    assert labels_from_questions(questions) == {0: ("red", "circle"), 1: ("teal", "triangle")}
    with pytest.raises(ValueError, match="confirm and exclude"):
        labels_from_questions([["what color is the circle?", "red", 0], ["is there a red shape?", "no", 0]])


@pytest.fixture(scope="module")
def easy_vqa_archive():
    try:
        return scenes_module._archive()
    except Exception as error:  # the package index is the only network: skip when it cannot be reached
        pytest.skip(f"easy-vqa could not be fetched: {error}")


def _pixels(image) -> str:
    return hashlib.sha256(image.convert("RGB").tobytes()).hexdigest()


def test_scenes_are_deterministic_and_held_out_scenes_share_no_source_image(easy_vqa_archive):
    first = make_scenes("test", 6, seed=3)
    again = make_scenes("test", 6, seed=3)
    assert [_pixels(s.image) for s in first] == [_pixels(s.image) for s in again]
    assert [s.description for s in first] == [s.description for s in again]
    assert [s.questions for s in first] == [s.questions for s in again]
    tail = make_scenes("test", 2, seed=3, start=4)  # scene i does not depend on start / count
    assert [s.image_ids for s in tail] == [s.image_ids for s in first[4:]]
    assert [s.image_ids for s in make_scenes("test", 6, seed=4)] != [s.image_ids for s in first]

    scene = first[0]
    assert scene.image.size == (128, 128) and len(set(scene.image_ids)) == 4
    labels = image_labels("test")
    for s in first:
        assert s.objects == tuple(labels[i] for i in s.image_ids)
        for (name, _, _), (color, shape) in zip(POSITIONS, s.objects):
            assert f"{name.capitalize()}: a {color} {shape}." in s.description
            assert (f"What color is the shape at the {name}?", f"The shape at the {name} is {color}.") in s.questions

    # every tile of a held-out scene is one of easy-vqa's TEST images, and equals none of its train images
    with zipfile.ZipFile(easy_vqa_archive) as wheel:
        from PIL import Image

        def tile(split, image_id):
            return Image.open(io.BytesIO(wheel.read(f"easy_vqa/data/{split}/images/{image_id}.png")))

        train_pixels = {_pixels(tile("train", i)) for i in image_labels("train")}
        for s in first:
            for (_, column, row), image_id in zip(POSITIONS, s.image_ids):
                crop = s.image.crop((64 * column, 64 * row, 64 * column + 64, 64 * row + 64))
                assert _pixels(crop) == _pixels(tile("test", image_id))
                assert _pixels(crop) not in train_pixels
    train = make_scenes("train", 4)
    assert all(set(s.image_ids) <= set(image_labels("train")) for s in train)
    with pytest.raises(ValueError, match="split"):
        make_scenes("validation", 1)


# ----------------------------------------------------------------------------
# A tiny VLM with SmolLM2's real tokenizer (so the image token is id 16, as in the real one)
# ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_language_model(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    _, real = fetch_real_smollm2(tmp_path_factory)
    folder = tmp_path_factory.mktemp("tiny_smollm2")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(real).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_vlm(tiny_language_model, easy_vqa_archive):
    from hf_adaptive_spec.scenes.vlm import build_scenes_vlm

    return build_scenes_vlm(tiny_language_model, seed=1)


def _inputs(processor, images, request=DESCRIBE_REQUEST):
    prompt = processor.apply_chat_template(scene_messages(request), add_generation_prompt=True, tokenize=False)
    side = processor.tokenizer.padding_side
    processor.tokenizer.padding_side = "left"
    try:
        return processor(text=[prompt] * len(images), images=images, return_tensors="pt", padding=True)
    finally:
        processor.tokenizer.padding_side = side


def test_scenes_vlm_keeps_the_vocabulary_and_round_trips_through_the_auto_classes(tiny_vlm, tiny_language_model,
                                                                                  tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from hf_adaptive_spec.scenes.vlm import (IMAGE_TOKEN_ID, assemble_scenes_vlm, fetch_scenes_vlm,
                                             save_trained_parts)

    model, processor = tiny_vlm
    assert model.config.text_config.vocab_size == 49152 == len(processor.tokenizer)
    inputs = _inputs(processor, [make_scenes("test", 1)[0].image])
    assert int((inputs["input_ids"] == IMAGE_TOKEN_ID).sum()) == 64  # 8x8 patches, CLS dropped
    parts = save_trained_parts(model, tmp_path / "parts")
    size = sum(f.stat().st_size for f in parts.iterdir())
    assert size < 30e6
    with torch.no_grad():
        expected = model(**inputs).logits
    for folder in (assemble_scenes_vlm(tiny_language_model, parts, tmp_path / "full"),
                   fetch_scenes_vlm(cache_dir=tmp_path / "cache", trained_parts=parts,
                                    language_model=tiny_language_model, progress=False)):
        loaded = AutoModelForImageTextToText.from_pretrained(folder).eval()
        loaded_processor = AutoProcessor.from_pretrained(folder)
        again = _inputs(loaded_processor, [make_scenes("test", 1)[0].image])
        assert torch.equal(again["input_ids"], inputs["input_ids"])
        with torch.no_grad():
            torch.testing.assert_close(loaded(**again).logits, expected)
    # a cached assembly is reused, and rebuilt when the trained parts change
    cached = tmp_path / "cache" / "scenes-vlm-135m"
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    assert fetch_scenes_vlm(cache_dir=tmp_path / "cache", trained_parts=parts, language_model=tiny_language_model,
                            progress=False) == cached
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(FileNotFoundError, match="train-vlm"):
        fetch_scenes_vlm(cache_dir=tmp_path / "cache", trained_parts=tmp_path / "nothing")


def test_tiny_train_vlm_lowers_the_loss_and_resumes(tiny_language_model, easy_vqa_archive, tmp_path):
    from hf_adaptive_spec.scenes.vlm import (LORA_TARGETS, build_scenes_vlm, load_trained_parts,
                                             merge_language_lora, save_trained_parts)
    import random

    from hf_adaptive_spec.training.vlm import VLMTrainConfig, _lm_batch, _lm_loss, train_scenes_vlm

    model, processor = build_scenes_vlm(tiny_language_model, seed=2)
    held_out = make_scenes("test", 4)
    inputs, labels, keep = _lm_batch(processor, held_out, random.Random(0), describe_fraction=1.0)

    def lm_loss(m=model):
        with torch.no_grad():
            return float(_lm_loss(m, inputs, labels, keep))

    language_before = {k: v.clone() for k, v in model.model.language_model.state_dict().items()}
    before = lm_loss()
    config = VLMTrainConfig(tower_steps=4, tower_batch=8, tower_lr=3e-3, align_steps=3, align_batch=8, lm_steps=8,
                            lm_batch=4, lm_lr=1e-2, lm_tower_lr=1e-3, lora_rank=4, lora_lr=1e-2, bf16=False,
                            eval_scenes=0, checkpoint_every=6)
    result = train_scenes_vlm(model, processor, config, out_dir=tmp_path, progress=False, log=lambda *_: None)
    assert [h["stage"] for h in result["history"]] == ["tower"] * 4 + ["align"] * 3 + ["lm"] * 8
    trained_loss = lm_loss()
    assert trained_loss < before
    # the language model's own weights are untouched; its low-rank updates moved
    updated = 0
    for key, value in model.model.language_model.state_dict().items():
        if ".parametrizations.weight.original" in key:
            assert torch.equal(value, language_before[key.replace(".parametrizations.weight.original", ".weight")])
        elif ".parametrizations.weight.0.B" in key:
            updated += bool(value.abs().sum() > 0)
        elif ".parametrizations." not in key:
            assert torch.equal(value, language_before[key]), key
    assert updated == len(LORA_TARGETS) * model.config.text_config.num_hidden_layers
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-15", "checkpoint-6"]

    # saved parts, assembled on a fresh model (factors folded into the weights), give the trained model's loss
    parts = save_trained_parts(model, tmp_path / "parts")
    merge_language_lora(model)
    assert all(".parametrizations." not in k for k in model.state_dict())
    assert lm_loss() == pytest.approx(trained_loss, abs=1e-4)
    fresh, _ = build_scenes_vlm(tiny_language_model, seed=5)
    load_trained_parts(fresh, parts)
    assert lm_loss(fresh) == pytest.approx(trained_loss, abs=1e-4)

    # resume: a longer run continues after the latest checkpoint instead of starting over
    resumed, _ = build_scenes_vlm(tiny_language_model, seed=2)
    longer = VLMTrainConfig(**{**result["config"], "lm_steps": 10})
    notes = []
    again = train_scenes_vlm(resumed, processor, longer, out_dir=tmp_path, resume=True, progress=False,
                             log=notes.append)
    assert notes and "step 15" in notes[0]
    assert [h["step"] for h in again["history"]] == list(range(1, 18))
    # the resumed steps follow the longer run's schedule from the base rate (not from the checkpoint's
    # scheduled rate)
    from hf_adaptive_spec.training.schedule import warmup_cosine

    for entry in again["history"][15:]:
        local = entry["step"] - 1 - config.tower_steps - config.align_steps
        assert entry["lr"] == pytest.approx(config.lm_lr * warmup_cosine(local, 10))
        assert entry["lr"] > 0


def test_align_targets_write_each_quadrants_words_in_its_rows_of_patches(tiny_vlm):
    from hf_adaptive_spec.training.vlm import align_token_ids

    _, processor = tiny_vlm
    tokenizer = processor.tokenizer
    scene = make_scenes("test", 1)[0]
    ids = align_token_ids([scene], tokenizer, grid=8).reshape(8, 8)  # (rows, columns) of patches

    def word(text):
        return tokenizer(" " + text, add_special_tokens=False)["input_ids"][0]

    (top_left_color, top_left_shape), (_, top_right_shape), (bottom_left_color, _), _ = scene.objects
    assert ids[0, :4].tolist() == [word("Top"), word("left"), word(top_left_color), word(top_left_shape)]
    assert ids[3, 4:].tolist()[1:] == [word("right"), ids[3, 6].item(), word(top_right_shape)]
    assert ids[5, :4].tolist() == [word("Bottom"), word("left"), word(bottom_left_color), ids[5, 3].item()]
    assert torch.equal(ids[4], ids[7])  # every row of a quadrant carries the same words


def test_language_lora_factors_ship_small_and_fold_into_an_ordinary_checkpoint(tiny_language_model, tmp_path,
                                                                             easy_vqa_archive):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from hf_adaptive_spec.scenes.vlm import (LORA_TARGETS, TRAINED_FILE, add_language_lora, assemble_scenes_vlm,
                                             build_scenes_vlm, load_trained_parts, merge_language_lora,
                                             save_trained_parts)

    model, processor = build_scenes_vlm(tiny_language_model, seed=1)
    params = add_language_lora(model, rank=4, alpha=8.0, seed=0)
    layers = model.config.text_config.num_hidden_layers
    assert len(params) == 2 * len(LORA_TARGETS) * layers
    with torch.no_grad():
        for i, parameter in enumerate(params):
            if i % 2:  # B: zero at the start (the model is SmolLM2's), made non-zero here
                assert not parameter.any()
                parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
    inputs = _inputs(processor, [make_scenes("test", 1)[0].image])
    with torch.no_grad():
        expected = model(**inputs).logits
    parts = save_trained_parts(model, tmp_path / "parts")
    saved = load_file(str(parts / TRAINED_FILE))
    assert sum(k.endswith(".lora_A") for k in saved) == len(LORA_TARGETS) * layers
    assert not any(".parametrizations." in k or k.startswith("model.language_model.embed") for k in saved)

    # folded in: the parametrized model, a fresh one loading the parts, and the Auto-loaded assembly agree
    merge_language_lora(model)
    assert not any(".parametrizations." in k for k in model.state_dict())
    fresh, _ = build_scenes_vlm(tiny_language_model, seed=7)
    load_trained_parts(fresh, parts)
    loaded = AutoModelForImageTextToText.from_pretrained(
        assemble_scenes_vlm(tiny_language_model, parts, tmp_path / "full")).eval()
    with torch.no_grad():
        for other in (model, fresh, loaded):
            torch.testing.assert_close(other(**inputs).logits, expected, rtol=1e-4, atol=1e-4)

    # continuing from saved parts: the factors come back as a parametrization with the same product
    again, _ = build_scenes_vlm(tiny_language_model, seed=7)
    factors = load_trained_parts(again, parts, merge=False)
    add_language_lora(again, rank=4, alpha=8.0, factors=factors)
    with torch.no_grad():
        torch.testing.assert_close(again(**inputs).logits, expected, rtol=1e-4, atol=1e-4)
    for other_rank in (8, 0):  # another rank, or none (that would silently drop the factors), is refused
        with pytest.raises(ValueError, match=f"rank 4, not {other_rank}"):
            add_language_lora(build_scenes_vlm(tiny_language_model)[0], rank=other_rank, alpha=8.0, factors=factors)

    # factors naming no layer of the language model are refused, not ignored
    saved["model.language_model.layers.0.self_attn.q_norm.lora_A"] = saved[next(k for k in saved if "lora_A" in k)].clone()
    save_file(saved, str(parts / TRAINED_FILE))
    with pytest.raises(ValueError, match="names no low-rank pair"):
        load_trained_parts(build_scenes_vlm(tiny_language_model)[0], parts)


def test_quadrant_heads_read_each_quadrants_mean_and_every_patch_of_it():
    from hf_adaptive_spec.training.vlm import QuadrantHeads

    heads = QuadrantHeads(hidden_size=2, grid=8)
    with torch.no_grad():
        heads.color.weight.zero_()
        heads.color.bias.zero_()
        heads.color.weight[0, 0] = 1.0  # colour logit 0 = feature 0
    patches = torch.zeros(1, 64, 2)
    for row in range(8):
        for column in range(8):  # feature 0: the quadrant (TL, TR, BL, BR = 0..3) + the patch's index in it / 100
            patches[0, row * 8 + column, 0] = (row // 4) * 2 + column // 4 + ((row % 4) * 4 + column % 4) / 100
    per_patch = heads(patches, per_patch=True)[0][0, :, :, 0]  # (4 quadrants, 16 patches)
    expected = torch.arange(4.0)[:, None] + torch.arange(16.0)[None, :] / 100
    torch.testing.assert_close(per_patch, expected)
    torch.testing.assert_close(heads(patches)[0][0, :, 0], expected.mean(1))


@pytest.mark.parametrize("batch_size", [1, 2])
def test_speculative_decoding_on_the_scenes_vlm_equals_plain_greedy(tiny_vlm, tiny_language_model, batch_size):
    import hf_adaptive_spec
    from transformers import AutoModelForCausalLM

    from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel

    model, processor = tiny_vlm
    inputs = _inputs(processor, [s.image for s in make_scenes("test", batch_size, seed=5)])
    expected = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    image_blind = AutoModelForCausalLM.from_pretrained(tiny_language_model).eval()  # the LM without the tower
    image_aware = hf_adaptive_spec.quantize_drafter(model)  # the VLM itself, int8: sees the image
    torch.manual_seed(3)
    laspec = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(model, block_size=4, num_visual_tokens=8)).eval()
    with torch.no_grad():
        for layer in laspec.layers:
            layer.visual_gate.fill_(0.5)  # a live visual branch
    runs = [("chain", image_blind), ("chain", image_aware), ("sage", image_blind), ("sage", image_aware),
            ("static_tree", image_aware), ("laspec", laspec)]
    for strategy, drafter in runs:
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                             spec_strategy=strategy)
        assert torch.equal(out, expected), (strategy, type(drafter).__name__)


def test_train_drafter_data_spec_scenes_encodes_train_scenes_for_the_target(tiny_vlm):
    from hf_adaptive_spec.scenes.vlm import IMAGE_TOKEN_ID
    from hf_adaptive_spec.training.cli import prompts_by_spec

    _, processor = tiny_vlm
    [(spec, prompts)] = prompts_by_spec(["scenes[2:5]"], processor=processor)
    assert spec == "scenes[2:5]" and [p.id for p in prompts] == [s.id for s in make_scenes("train", 3, start=2)]
    for prompt in prompts:
        assert prompt.inputs["pixel_values"].shape == (1, 3, 128, 128)
        assert int((prompt.inputs["input_ids"] == IMAGE_TOKEN_ID).sum()) == 64
    with pytest.raises(ValueError, match="END"):
        prompts_by_spec(["scenes[2:]"], processor=processor)
    with pytest.raises(ValueError, match="image processor"):
        prompts_by_spec(["scenes[:2]"], processor=processor.tokenizer)


def test_the_shipped_scenes_vlm_reads_held_out_scenes_and_decodes_exactly(tmp_path_factory, easy_vqa_archive):
    """The real scenes-vlm-135m (SmolLM2 + the shipped tower, assembled here): its descriptions of held-out
    scenes depend on the image (a blank image gives other words), and laspec (the shipped drafter), sage with
    the image-aware int8 VLM and sage with the image-blind int8 SmolLM2 equal plain greedy, batch 1 and 2."""
    import hf_adaptive_spec
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor
    from PIL import Image

    from hf_adaptive_spec.scenes.vlm import fetch_scenes_vlm

    _, language = fetch_real_smollm2(tmp_path_factory)
    path = fetch_scenes_vlm(cache_dir=tmp_path_factory.mktemp("scenes_vlm"), language_model=language,
                            progress=False)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    scenes = make_scenes("test", 2, start=8)
    inputs = _inputs(processor, [s.image for s in scenes])
    plain = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    # it reads the image: every colour and shape of both held-out scenes named right (32 held-out scenes: 97% of
    # colours, 92% of shapes)
    from hf_adaptive_spec.training.vlm import parse_description

    for scene, row in zip(scenes, plain):
        said = parse_description(processor.decode(row[inputs["input_ids"].shape[1]:], skip_special_tokens=True))
        assert [said.get(name, (None, None)) for name, _, _ in POSITIONS] == list(scene.objects), said
    blank = _inputs(processor, [Image.new("RGB", (128, 128), (255, 255, 255))] * 2)
    assert not torch.equal(model.generate(**blank, max_new_tokens=32, do_sample=False)[:, -32:], plain[:, -32:])
    drafters = [("laspec", hf_adaptive_spec.load_drafter("laspec-scenes-vlm-135m", model)),
                ("sage", hf_adaptive_spec.quantize_drafter(model)),
                ("sage", hf_adaptive_spec.quantize_drafter(AutoModelForCausalLM.from_pretrained(language).eval()))]
    for strategy, drafter in drafters:
        for rows in (slice(0, 1), slice(0, 2)):
            batch = _inputs(processor, [s.image for s in scenes[rows]])
            expected = plain[rows] if rows.stop == 2 else model.generate(**batch, max_new_tokens=32, do_sample=False)
            out = model.generate(**batch, max_new_tokens=32, do_sample=False, assistant_model=drafter,
                                 spec_strategy=strategy)
            assert torch.equal(out, expected), (strategy, type(drafter).__name__, rows)
