"""The shipped LaSpec drafter of the real pair's target, Qwen2.5-Coder-1.5B-Instruct: offline by name, HF round
trip, size, and exactness on the real model."""

import json

import pytest
import torch
from conftest import fetch_real_qwen
from transformers import AutoModel

import hf_adaptive_spec
from hf_adaptive_spec.drafters.hub import drafter_path
from hf_adaptive_spec.drafters.laspec import LaSpecDrafterModel

NAME = "laspec-qwen2.5-coder-1.5b-instruct"
TARGET = "qwen2.5-coder-1.5b-instruct"


def test_shipped_folder_is_small_text_only_and_documented():
    folder = drafter_path(NAME)
    assert NAME in hf_adaptive_spec.list_drafters()
    assert (folder / "model.safetensors").stat().st_size <= 64 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert config["target_model_name"] == TARGET and config["num_visual_tokens"] == 0
    info = json.loads((folder / "training_log.json").read_text())
    assert info["target"] == TARGET and info["train_seconds"] > 0 and info["evals"]
    held_out = {f"HumanEval/{i}" for i in range(48)}
    assert held_out.isdisjoint(info["train_prompt_ids"])  # the benchmark's HumanEval prompts stay held out
    card = (folder / "README.md").read_text()
    assert "hf-adaptive-spec train-drafter" in card  # the exact command


def test_shipped_drafter_round_trips_through_save_and_from_pretrained(tmp_path):
    drafter = AutoModel.from_pretrained(drafter_path(NAME))
    assert isinstance(drafter, LaSpecDrafterModel) and not drafter.has_target
    stored = dict(drafter.state_dict())
    assert not any("embed_tokens" in key or "lm_head" in key or "visual" in key for key in stored)
    drafter.save_pretrained(tmp_path)
    again = LaSpecDrafterModel.from_pretrained(tmp_path)
    differing = {key for key, value in again.config.to_dict().items() if drafter.config.to_dict().get(key) != value}
    assert differing == {"_name_or_path"}  # where it was loaded from
    for key, value in again.state_dict().items():
        assert torch.equal(value, stored[key]), key


def test_real_pair_with_the_shipped_drafter_equals_plain_greedy(tmp_path_factory):
    """Two short held-out prompts (HumanEval 0, an MT-Bench-like chat turn): laspec, sage and chain on the new
    drafter give exactly the target's greedy tokens."""
    from hf_adaptive_spec.registry import models

    root, _ = fetch_real_qwen(tmp_path_factory)
    model, tok = models.load(TARGET, cache_dir=root, progress=False)
    drafter = hf_adaptive_spec.load_drafter(NAME, model)
    prompts = ["Complete this Python function:\n\ndef add(a, b):\n    \"\"\"Return a + b.\"\"\"",
               "Give two tips for writing a clear email."]
    for prompt in prompts:
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        plain = model.generate(**enc, max_new_tokens=24, do_sample=False)
        for strategy in ("laspec", "sage", "chain"):
            spec = model.generate(**enc, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                                  spec_strategy=strategy, return_dict_in_generate=True)
            assert torch.equal(spec.sequences, plain), (prompt, strategy)
        assert spec.spec_stats.mean_accepted_length > 1.2  # a trained drafter (a random one gives ~1.0)
