"""Random combinations of `generate` settings: every strategy returns plain greedy's sequences, and its scores and
logits on every step where a row is still generating.

Each case draws its settings from a fixed seed (so a failure names a reproducible case): logits processors
(repetition penalty, no-repeat n-grams, bad words, sequence bias, suppressed tokens, renormalisation), stopping
(several EOS ids, min / max new tokens, a forced EOS), returned scores and logits, every strategy and the
drafter-less `plain` mode, on tiny models of several
families (full attention, sliding windows, GPT-2), batch 1 and 2 with ragged prompts. A sequence that differs
is accepted only where plain decoding itself is a numerical tie (top-2 gap of its scores under 1e-4 at the
first differing step), and the failure message names the case otherwise.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
import transformers as tf

import hf_adaptive_spec  # noqa: F401  (installs the generate hook)
from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.strategies import get_strategy_class
import tiny_families
import tiny_models

pytestmark = pytest.mark.usefixtures("one_thread")

STRATEGIES = ("chain", "static_tree", "sage", "laspec", "plain")
FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "gpt2")
CASES_PER_FAMILY = 64  # 320 cases per run
TIE = 1e-4


def _gpt2(num_layers: int, seed: int):
    torch.manual_seed(seed)
    config = tf.GPT2Config(vocab_size=tiny_models.VOCAB_SIZE, n_embd=32, n_layer=num_layers, n_head=2,
                           n_positions=256, bos_token_id=1, eos_token_id=tiny_models.EOS_ID,
                           pad_token_id=tiny_models.PAD_ID, initializer_range=0.3)
    model = tf.GPT2LMHeadModel(config).eval()
    model.generation_config = tf.GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=tiny_models.EOS_ID)
    return model


def _models(family: str):
    """`(target, {kind: drafter}, inputs(batch_size, seed))` of one family."""
    if family in ("llama", "qwen2"):
        target = tiny_models.build_model(family)
        drafters = {"copy": tiny_models.build_drafter(family, target, "copy"),
                    "small": tiny_models.build_drafter(family, target, "small")}
        return target, drafters, lambda batch, seed: tiny_models.make_inputs(family, batch, seed=seed)
    if family in ("mistral", "gemma2"):
        target = tiny_families.build(family)
        drafters = {"copy": tiny_families.drafter(family, target, "copy"),
                    "small": tiny_families.drafter(family, target, "small")}
        return target, drafters, lambda batch, seed: tiny_families.make_inputs(family, batch, seed=seed)
    target = _gpt2(2, 0)
    drafters = {"copy": copy.deepcopy(target), "small": _gpt2(1, 1)}

    def inputs(batch, seed):
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(*tiny_models.TEXT_TOKEN_RANGE, (batch, 10), generator=generator)
        mask = torch.ones_like(ids)
        if batch > 1:
            ids[1, :3], mask[1, :3] = tiny_models.PAD_ID, 0
        return {"input_ids": ids, "attention_mask": mask}
    return target, drafters, inputs


def _settings(rng: random.Random) -> dict:
    """One random combination of generate settings (greedy)."""
    low, high = tiny_models.TEXT_TOKEN_RANGE
    token = lambda: rng.randrange(low, high)  # noqa: E731
    settings = {"max_new_tokens": rng.randint(4, 14), "do_sample": False}
    if rng.random() < 0.5:
        settings["repetition_penalty"] = rng.choice([1.3, 1.8, 0.8])
    if rng.random() < 0.4:
        settings["no_repeat_ngram_size"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        settings["bad_words_ids"] = [[token()], [token(), token()]]
    if rng.random() < 0.3:
        settings["sequence_bias"] = {(token(),): -4.0, (token(), token()): 3.0, (token(),): 2.5}
    if rng.random() < 0.3:
        settings["suppress_tokens"] = [token() for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.5:  # several EOS ids that random models do emit: rows stop at different steps
        settings["eos_token_id"] = [tiny_models.EOS_ID] + [token() for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.4:
        settings["min_new_tokens"] = rng.randint(1, settings["max_new_tokens"])
    if rng.random() < 0.2:
        settings["forced_eos_token_id"] = tiny_models.EOS_ID
    if rng.random() < 0.3:
        settings["renormalize_logits"] = True
    if rng.random() < 0.5:
        settings["output_scores"] = True
    if rng.random() < 0.5:
        settings["output_logits"] = True
    return settings


def _untimed(strategy: str) -> dict:
    """No cost rule (it follows this machine's timings; what is verified must not)."""
    fields = {f.name for f in dataclasses.fields(get_strategy_class(strategy).config_class)}
    return {"verify_cost": False} if "verify_cost" in fields else {}


def _generated_steps(sequences: torch.Tensor, prompt_length: int, eos_ids) -> torch.Tensor:
    """`(B,)` steps each row really generated (up to and including its first EOS)."""
    new = sequences[:, prompt_length:]
    is_eos = torch.isin(new, torch.tensor(eos_ids))
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, new.shape[1])
    return first


def _first_difference_is_a_tie(plain, mine, prompt_length: int) -> bool:
    """Whether the first step where the sequences differ is one where plain's scores are a numerical tie."""
    differ = (plain.sequences != mine).any(0).nonzero()
    if differ.numel() == 0:
        return True
    step = int(differ[0]) - prompt_length
    scores = plain.scores[step]
    row = int((plain.sequences[:, prompt_length + step] != mine[:, prompt_length + step]).nonzero()[0])
    top = scores[row].topk(2).values
    return bool(top[0] - top[1] < TIE)


@pytest.mark.parametrize("family", FAMILIES)
def test_random_generate_settings_equal_plain(family):
    target, drafters, make = _models(family)
    torch.manual_seed(0)
    laspec = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()
    rng = random.Random(f"generate-settings-{family}")
    eos_default = [tiny_models.EOS_ID]
    for case in range(CASES_PER_FAMILY):
        settings = _settings(rng)
        strategy = rng.choice(STRATEGIES)
        batch = rng.choice([1, 2])
        inputs = make(batch, rng.randrange(1000))
        drafter = laspec if strategy == "laspec" else drafters[rng.choice(["copy", "small"])]
        name = f"{family} case {case}: {strategy}, batch {batch}, {settings}"
        plain_settings = {**settings, "output_scores": True, "output_logits": True}
        plain = target.generate(**inputs, **plain_settings, return_dict_in_generate=True)
        drafting = {} if strategy == "plain" else {"assistant_model": drafter}
        out = target.generate(**inputs, **settings, return_dict_in_generate=True, **drafting,
                              spec_strategy=strategy, spec_config=_untimed(strategy))
        prompt_length = inputs["input_ids"].shape[1]
        if not torch.equal(out.sequences, plain.sequences):
            same_shape = out.sequences.shape == plain.sequences.shape
            assert same_shape and _first_difference_is_a_tie(plain, out.sequences, prompt_length), name
            continue  # past a tie the two runs follow different texts
        steps = _generated_steps(plain.sequences, prompt_length, settings.get("eos_token_id", eos_default))
        for field in ("scores", "logits"):
            mine = getattr(out, field)
            if not settings.get(f"output_{field}"):
                assert mine is None, name
                continue
            theirs = getattr(plain, field)
            assert len(mine) == len(theirs), name
            for step, (a, b) in enumerate(zip(mine, theirs)):
                live = steps > step
                torch.testing.assert_close(a[live], b[live], atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
