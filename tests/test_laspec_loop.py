"""The `laspec` strategy in the decoding loop: exactness, context bookkeeping, vision, refusals."""

import pytest
import torch

import hf_adaptive_spec
from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.drafters import block as block_module
from hf_adaptive_spec.drafters.laspec import gather_target_hidden
from tiny_models import build_drafter, build_model, make_inputs


def _drafter(target, seed=0, **overrides):
    torch.manual_seed(seed)
    config = LaSpecDrafterConfig.for_target(target, **{"block_size": 4, **overrides})
    return LaSpecDrafterModel(config).eval()


@pytest.fixture
def recorded(monkeypatch):
    """Every BlockDrafter the loop creates, in order (to inspect its state after generate)."""
    made = []

    class Recording(block_module.BlockDrafter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("hf_adaptive_spec.drafters.factory.BlockDrafter", Recording)
    return made


def _oracle(monkeypatch, continuation, corrupt_every=0):
    """Make the block drafter propose the plain greedy continuation (optionally wrong at every n-th depth)."""

    def block_scores(self, depth):
        batch = self.root.shape[0]
        vocab = self.model.config.vocab_size
        logits = torch.full((batch, depth, vocab), -10.0)
        for row in range(batch):
            start = int(self.generated[row])  # tokens generated so far (the root is the last)
            for k in range(depth):
                index = start + k
                token = int(continuation[row, index]) if index < continuation.shape[1] else 8
                if corrupt_every and (index % corrupt_every == corrupt_every - 1):
                    token = 8 + (token + 1) % 100
                logits[row, k, token] = 10.0
        return logits, None  # over the whole vocabulary

    original_prefill, original_commit = block_module.BlockDrafter.prefill, block_module.BlockDrafter.commit

    def prefill(self, hidden_states, slot_valid, first_token):
        original_prefill(self, hidden_states, slot_valid, first_token)
        self.generated = torch.ones(first_token.shape[0], dtype=torch.long)

    def commit(self, tree, hidden_states, path_index, accept_length, bonus):
        original_commit(self, tree, hidden_states, path_index, accept_length, bonus)
        self.generated = self.generated + accept_length + 1

    monkeypatch.setattr(block_module.BlockDrafter, "block_scores", block_scores)
    monkeypatch.setattr(block_module.BlockDrafter, "prefill", prefill)
    monkeypatch.setattr(block_module.BlockDrafter, "commit", commit)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_laspec_greedy_equals_plain(arch, batch_size):
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=batch_size)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    drafter = _drafter(target)
    for config in (None, {"verify_cost": False, "top_k": 3, "n_max": 10}):
        out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                              spec_strategy="laspec", spec_config=config, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert out.spec_stats.rounds >= 1


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_laspec_with_previous_state_fusion_equals_plain(arch):
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    drafter = _drafter(target, fuse_previous_state=True)
    out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", spec_config={"verify_cost": False}, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl"])
@pytest.mark.parametrize("strategy", ["laspec", "sage", "chain"])
def test_text_only_drafter_equals_plain(arch, strategy):
    """A drafter built without the visual branch (num_visual_tokens=0), on a text and on a VLM target."""
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    drafter = _drafter(target, num_visual_tokens=0)
    out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                          spec_strategy=strategy, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    with pytest.raises(ValueError, match="text-only drafter"):
        target.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=drafter,
                        spec_strategy="laspec", spec_config={"num_visual_tokens": 4})


def test_fused_state_follows_each_rows_accepted_path():
    """prefill keeps each row's last prompt state, commit the state of each row's last ACCEPTED node."""
    target = build_model("llama")
    drafter = _drafter(target, fuse_previous_state=True).attach_target(target)
    state = block_module.BlockDrafter(drafter, target)
    width, hidden = len(target.model.layers) + 1, target.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    prompt_states = tuple(torch.randn(2, 5, hidden, generator=gen) for _ in range(width))
    slot_valid = torch.tensor([[True] * 5, [False, False, True, True, True]])
    encoded = drafter.encode_context(gather_target_hidden(prompt_states, drafter.config.target_layer_ids))
    # the prefill's layers fused as they come (one projected part each) == the fusion's projection
    summed = None
    for part, layer in enumerate(drafter.config.target_layer_ids):
        projected = drafter.context_part(part, prompt_states[layer + 1])
        summed = projected if summed is None else summed + projected
    torch.testing.assert_close(drafter.encode_context_sum(summed), encoded, atol=1e-5, rtol=1e-5)
    state.prefill(encoded, slot_valid, torch.tensor([9, 10]))
    torch.testing.assert_close(state.previous_state, encoded[:, -1])
    tree_states = tuple(torch.randn(2, 6, hidden, generator=gen) for _ in range(width))
    path_index = torch.tensor([[0, 2, 3, 5], [0, 1, 4, 0]])
    accept_length = torch.tensor([1, 2])
    state.commit(None, tree_states, path_index, accept_length, torch.tensor([11, 12]))
    assert state.root_position.tolist() == [7, 6] and state.root.tolist() == [11, 12]
    assert state.context_valid.shape[1] == 5  # encoded when the context is next read
    state._flush()
    encoded = drafter.encode_context(gather_target_hidden(tree_states, drafter.config.target_layer_ids))
    torch.testing.assert_close(state.previous_state, torch.stack([encoded[0, 2], encoded[1, 4]]))
    assert state.context_valid.tolist() == [[True] * 5 + [True, True, False],
                                            [False, False, True, True, True, True, True, True]]
    assert state.context_positions[:, 5:].tolist() == [[5, 6, 7], [3, 4, 5]]


def test_rounds_encoded_together_equal_rounds_encoded_one_by_one():
    """The states of rounds that drafted nothing are encoded into the context together, when it is next read: the
    context (keys, values, masks, positions) and the fused previous state equal encoding each round at once."""
    target = build_model("llama")
    drafter = _drafter(target, fuse_previous_state=True).attach_target(target)
    width, hidden = len(target.model.layers) + 1, target.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    prompt_states = tuple(torch.randn(2, 5, hidden, generator=gen) for _ in range(width))
    slot_valid = torch.tensor([[True] * 5, [False, True, True, True, True]])
    encoded = drafter.encode_context(gather_target_hidden(prompt_states, drafter.config.target_layer_ids))
    eager, lazy = block_module.BlockDrafter(drafter, target), block_module.BlockDrafter(drafter, target)
    for state in (eager, lazy):
        state.prefill(encoded, slot_valid, torch.tensor([9, 10]))
    rounds = [(torch.tensor([[0], [0]]), torch.tensor([0, 0])),  # paused rounds: the root alone
              (torch.tensor([[0], [0]]), torch.tensor([0, 0])),
              (torch.tensor([[0, 2, 3], [0, 1, 0]]), torch.tensor([2, 1]))]
    for path_index, accept_length in rounds:
        tree_states = tuple(torch.randn(2, 4, hidden, generator=gen) for _ in range(width))
        for state in (eager, lazy):
            state.commit(None, tree_states, path_index, accept_length, torch.tensor([3, 4]))
        eager._flush()
    assert len(lazy._pending) == 3
    lazy.trim()  # any reader of the context encodes what is pending first
    assert not lazy._pending
    for a, b in zip(eager.context.keys + eager.context.values, lazy.context.keys + lazy.context.values):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for name in ("context_valid", "context_positions", "root_position", "root"):
        assert torch.equal(getattr(eager, name), getattr(lazy, name)), name
    torch.testing.assert_close(eager.previous_state, lazy.previous_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_laspec_with_a_draft_vocabulary_equals_plain(arch):
    """Drafting over a subset of the vocabulary that misses some of the greedy tokens changes nothing."""
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    new_tokens = expected[:, inputs["input_ids"].shape[1]:].unique()
    vocab = torch.tensor(sorted(set(range(0, 128, 3)) - set(new_tokens[::2].tolist())))
    assert not bool(torch.isin(new_tokens, vocab).all())  # some greedy tokens cannot be drafted
    drafter = _drafter(target).set_draft_vocabulary(vocab)
    out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", spec_config={"verify_cost": False}, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    drafted = out.spec_stats.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("strategy", ["laspec", "sage", "chain"])
@pytest.mark.parametrize("draft_vocabulary", [False, True])
def test_top_k_once_per_depth_builds_the_per_node_tree(strategy, draft_vocabulary, monkeypatch):
    """Without logits processors the block drafter takes each depth's top-k once (over its draft vocabulary);
    every round's tree equals the one built node by node from the full-vocabulary logits."""
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=2)
    drafter = _drafter(target, seed=3)
    if draft_vocabulary:
        drafter.set_draft_vocabulary(torch.arange(0, 128, 2))
    original = block_module.BlockDrafter.draft
    compared = []

    def both(self, strategy_object, process, max_depth, sample=False, generator=None, committed=None, **_):
        assert process is None  # no logits processors in this generate call
        self.host_trees = False  # both by tensors (a lone row's host-built trees: tests/test_host_tree.py)
        per_node = original(self, strategy_object, lambda logits, *_: logits, max_depth, sample, generator, committed)
        shared = original(self, strategy_object, None, max_depth, sample, generator, committed)
        for name in ("tokens", "parents", "valid"):
            assert torch.equal(getattr(shared, name), getattr(per_node, name)), name
        torch.testing.assert_close(shared.probs, per_node.probs)
        compared.append(shared.tokens.shape[1])
        return shared

    monkeypatch.setattr(block_module.BlockDrafter, "draft", both)
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    config = {"laspec": {"verify_cost": False, "top_k": 3, "n_max": 10}, "sage": None, "chain": None}[strategy]
    out = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                          spec_strategy=strategy, spec_config=config)
    assert torch.equal(out, expected)
    assert len(compared) >= 3 and max(compared) > 2  # real trees, over several rounds


@pytest.mark.parametrize("arch,lookup_tokens", [("llama", 4), ("qwen2_vl", 4), ("llama", 8)])
def test_lookup_branch_is_accepted_exactly_as_far_as_the_context_repeats(arch, lookup_tokens, monkeypatch):
    """With a drafter that is always wrong, every accepted token comes from the lookup branch: each round's
    accepted length equals a brute-force replay of the lookup on the final sequence, and output stays exact.
    With 8 lookup tokens the target is made a bigram model (attention and MLP outputs zeroed: the next token
    depends on the current one only), so its greedy output cycles and chains longer than a block are accepted."""
    target = build_model(arch)
    if lookup_tokens > 4:
        with torch.no_grad():
            for layer in target.get_decoder().layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    inputs = make_inputs(arch, batch_size=1)
    prompt_length = inputs["input_ids"].shape[1]
    new = 60
    expected = target.generate(**inputs, max_new_tokens=new, do_sample=False)
    _oracle(monkeypatch, expected[:, prompt_length:], corrupt_every=1)  # every drafted token wrong
    out = target.generate(**inputs, max_new_tokens=new, do_sample=False, assistant_model=_drafter(target),
                          spec_strategy="laspec", return_dict_in_generate=True,
                          spec_config={"verify_cost": False, "top_k": 1, "context_lookup": 3,
                                       "lookup_tokens": lookup_tokens})
    assert torch.equal(out.sequences, expected)
    replayed = replay_accepted(expected[0].tolist(), prompt_length + 1,  # the prefill's token is the first root
                               lambda row: _brute_force_lookup(row, 3, lookup_tokens)[0])
    assert out.spec_stats.accepted_lengths == replayed
    assert sum(replayed) > 0  # the sequence repeats somewhere, or the test would prove nothing
    if lookup_tokens > 4:
        assert max(replayed) > 4  # a chain longer than the block was accepted, or the setting is untested


def replay_accepted(sequence, length, propose):
    """Accepted length per round when only one branch can be right: `propose(committed ids)` -> its chain, replayed
    on the final `sequence` from `length` committed tokens (the first root included)."""
    replayed = []
    while length < len(sequence):
        accepted = 0
        for offset, token in enumerate(propose(sequence[:length])[: len(sequence) - length - 1]):  # bonus: last slot
            if sequence[length + offset] != token:
                break
            accepted += 1
        replayed.append(accepted)
        length += accepted + 1
    return replayed


def _brute_force_lookup(row, max_ngram, num_tokens):
    for n in range(max_ngram, 0, -1):
        if n > len(row) - 1:
            continue
        for j in range(len(row) - n - 1, -1, -1):
            if row[j:j + n] == row[len(row) - n:]:
                return row[j + n:j + n + num_tokens], n
    return [], 0


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
def test_oracle_block_is_accepted_whole(arch, monkeypatch):
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    prompt_length = inputs["input_ids"].shape[1]
    expected = target.generate(**inputs, max_new_tokens=31, do_sample=False)
    _oracle(monkeypatch, expected[:, prompt_length:])
    out = target.generate(**inputs, max_new_tokens=31, do_sample=False, assistant_model=_drafter(target),
                          spec_strategy="laspec", spec_config={"verify_cost": False, "top_k": 1},
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.mean_accepted_length == pytest.approx(5.0)  # block of 4 + bonus, every round


def test_partly_wrong_block_still_exact(monkeypatch):
    target = build_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", batch_size=2)
    prompt_length = inputs["input_ids"].shape[1]
    expected = target.generate(**inputs, max_new_tokens=30, do_sample=False)
    _oracle(monkeypatch, expected[:, prompt_length:], corrupt_every=3)
    out = target.generate(**inputs, max_new_tokens=30, do_sample=False, assistant_model=_drafter(target),
                          spec_strategy="laspec", spec_config={"verify_cost": False, "top_k": 2},
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert 1.5 < out.spec_stats.mean_accepted_length < 5.0


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_drafter_context_equals_recomputation(arch, recorded):
    """The context the loop accumulated from verification forwards == the target's states recomputed at once."""
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    drafter = _drafter(target, fuse_previous_state=True)
    with torch.no_grad():  # bf16 values, like a bf16 checkpoint: the loop's bf16 weight copies are then exact
        for parameter in drafter.parameters():
            parameter.copy_(parameter.bfloat16().float())
    out = target.generate(**inputs, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", spec_config={"verify_cost": False, "top_k": 2}, spec_runtime={"retire_rows": False})
    state = recorded[-1]  # (rows kept in the batch to the end: the state holds both)
    full_mask = torch.cat([inputs["attention_mask"], torch.ones_like(out[:, inputs["input_ids"].shape[1]:])], 1)
    extra = out.shape[1] - inputs["input_ids"].shape[1]
    full = {**inputs, "input_ids": out, "attention_mask": full_mask}
    for key in ("mm_token_type_ids", "token_type_ids"):  # text tokens after the prompt
        if key in inputs:
            full[key] = torch.cat([inputs[key], inputs[key].new_zeros(inputs[key].shape[0], extra)], 1)
    with torch.no_grad():
        reference = target(**full, output_hidden_states=True)
        fused = gather_target_hidden(reference.hidden_states, drafter.config.target_layer_ids)
        encoded = drafter.encode_context(fused)
        expected = drafter.context_kv(encoded, full_mask.long().cumsum(-1) - 1)  # every layer's keys/values
    for row in range(2):
        kept = state.context_valid[row]
        positions = state.context_positions[row][kept]
        count = int(kept.sum())
        assert positions.tolist() == list(range(count))
        real = full_mask[row].bool()
        for layer in range(len(drafter.layers)):
            for got_all, want_all in ((state.context.keys[layer], expected.keys[layer]),
                                      (state.context.values[layer], expected.values[layer])):
                got = got_all[row][:, kept]  # (H_kv, count, D)
                want = want_all[row][:, real][:, :count]
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the fused state is the encoded state at the position before the pending root
        assert int(state.root_position[row]) == count
        torch.testing.assert_close(state.previous_state[row], encoded[row][real][count - 1], atol=1e-4, rtol=1e-4)
    # everything but the final bonus token (not yet run by the target) is in the context
    assert int(state.context_valid.sum(-1).min()) >= out.shape[1] - inputs["input_ids"].shape[1] - 1


@pytest.mark.parametrize("arch", ["qwen2_vl", "llava_onevision"])
def test_visual_selection_runs_each_round_and_keeps_output(arch, recorded):
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    drafter = _drafter(target, num_visual_tokens=3)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.visual_gate.fill_(0.5)  # a trained gate: the visual branch is live
    out = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    state = recorded[-1]
    assert state.uses_vision
    rows = 2 - out.spec_stats.retired_rows  # a row that finished first may have left the batch
    assert state.visual_embeds.shape[:2] == (rows, 3) and bool(state.visual_valid.all())
    assert out.spec_stats.time_visual > 0
    # an untrained (zero) gate is an exact no-op, and a closed one (|tanh(g)| <= CLOSED_GATE, as training left
    # the shipped scenes drafter's) changes no draft: the loop skips selection entirely, and so does M = 0
    from hf_adaptive_spec.drafters.block import CLOSED_GATE

    for gate, count in ((0.0, 3), (0.9 * CLOSED_GATE, 3), (0.5, 0)):
        recorded.clear()
        drafter = _drafter(target, num_visual_tokens=count)
        with torch.no_grad():
            for layer in drafter.layers:
                if layer.visual_gate is not None:  # M = 0: a text-only drafter, built without the branch
                    layer.visual_gate.fill_(gate)
        out = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                              spec_strategy="laspec", return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert not recorded[-1].uses_vision and recorded[-1].capture is None, (gate, count)
        assert out.spec_stats.time_visual == 0.0


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_a_context_without_the_image_leaves_its_positions_out_and_keeps_output(arch, recorded):
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    drafter = _drafter(target, num_visual_tokens=2, context_without_image=True)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.visual_gate.fill_(0.5)
    out = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", spec_runtime={"retire_rows": False})
    assert torch.equal(out, expected)
    state = recorded[-1]
    image = block_module.image_token_mask(target, inputs["input_ids"])
    prompt = state.context_valid[:, : image.shape[1]]
    assert not bool(prompt[image].any()) and bool(prompt[inputs["attention_mask"].bool() & ~image].all())
    assert state.uses_vision


def test_other_strategies_draft_with_a_block_drafter():
    target = build_model("qwen2")
    inputs = make_inputs("qwen2", batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    for strategy in ("chain", "static_tree", "sage"):
        out = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=_drafter(target),
                              spec_strategy=strategy)
        assert torch.equal(out, expected), strategy


def test_laspec_refuses_an_independent_drafter():
    target = build_model("llama")
    inputs = make_inputs("llama")
    with pytest.raises(ValueError, match="LaSpecDrafterModel"):
        target.generate(**inputs, max_new_tokens=4, assistant_model=build_drafter("llama", target, "small"),
                        spec_strategy="laspec")


def test_laspec_drafter_for_another_vocabulary_is_refused():
    target = build_model("llama")
    other = LaSpecDrafterModel(LaSpecDrafterConfig(hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                                   vocab_size=64))
    with pytest.raises(ValueError, match="tokenizer|vocabulary"):
        target.generate(**make_inputs("llama"), max_new_tokens=4, assistant_model=other, spec_strategy="laspec")


def test_laspec_config_validation():
    with pytest.raises(ValueError, match="top_k"):
        hf_adaptive_spec.LaSpecConfig(top_k=0).resolve(torch.device("cpu"))
    with pytest.raises(ValueError, match="lookup_tokens"):
        hf_adaptive_spec.LaSpecConfig(lookup_tokens=0).resolve(torch.device("cpu"))
    resolved = hf_adaptive_spec.LaSpecConfig().resolve(torch.device("cpu"))
    assert resolved.top_k == 2 and resolved.n_max == 16 and resolved.verify_cost and resolved.lookup_tokens == 8
