"""LaSpec block-parallel drafter: shapes, the zero gate, block causality, HF save/load, acceptance-aware loss."""

import os

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors import safe_open
from tiny_models import TEXT_TOKEN_RANGE, VOCAB_SIZE, build_model
from transformers import AutoConfig, AutoModel

from hf_adaptive_spec.adapters.compat import cache_argument
from hf_adaptive_spec.drafters.laspec import (
    LaSpecDrafterConfig,
    LaSpecDrafterModel,
    default_target_layer_ids,
    gather_target_hidden,
    make_block_inputs,
    register_auto_classes,
)
from hf_adaptive_spec.training.losses import accept_probs_from, acceptance_aware_loss, acceptance_weights

BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return build_model("llama", seed=0, num_layers=2)


def _drafter(target, seed=0, **overrides):
    torch.manual_seed(seed)
    config = LaSpecDrafterConfig.for_target(target, num_hidden_layers=2, block_size=BLOCK, **overrides)
    return LaSpecDrafterModel(config).attach_target(target).eval()


def _inputs(target, drafter, batch=2, length=12, seed=0):
    """Context = target states of positions 0..length-2; block = [token at length-1, MASK...]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(*TEXT_TOKEN_RANGE, (batch, length), generator=gen)
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    context = gather_target_hidden(hidden, drafter.config.target_layer_ids)[:, :-1]  # (B, C, n * H)
    block, positions = make_block_inputs(ids[:, -1], torch.full((batch,), length - 1), BLOCK)
    visual = torch.randn(batch, drafter.config.num_visual_tokens, drafter.config.vision_hidden_size, generator=gen)
    return dict(input_ids=block, target_hidden=context, position_ids=positions), visual


@pytest.mark.parametrize(
    "overrides",
    [{}, {"mask_token_id": 7}, {"hidden_size": 48, "num_attention_heads": 3, "intermediate_size": 96}],
    ids=["learned-mask", "mask-token-id", "projected-width"],
)
def test_block_forward_shapes(target, overrides):
    drafter = _drafter(target, **overrides)
    inputs, visual = _inputs(target, drafter)
    with torch.no_grad():
        out = drafter(**inputs, visual_embeds=visual, output_hidden_states=True)
    assert out.logits.shape == (2, BLOCK, VOCAB_SIZE)
    assert len(out.hidden_states) == drafter.config.num_hidden_layers + 1
    assert out.hidden_states[-1].shape == (2, BLOCK, drafter.config.hidden_size)
    assert torch.isfinite(out.logits).all()


def test_config_for_target(target):
    config = LaSpecDrafterConfig.for_target(target)
    assert config.vocab_size == VOCAB_SIZE and config.target_hidden_size == 32 and config.vision_hidden_size == 32
    assert config.target_layer_ids == [0, 1] == default_target_layer_ids(2)
    assert default_target_layer_ids(32) == [2, 16, 29]
    with pytest.raises(StrictDataclassClassValidationError, match="mask_token_id"):
        LaSpecDrafterConfig(vocab_size=16, mask_token_id=16)


def test_untrained_gate_leaves_output_exactly_unchanged(target):
    drafter = _drafter(target)
    inputs, visual = _inputs(target, drafter)
    assert all(layer.visual_gate.item() == 0.0 for layer in drafter.layers)
    plain = drafter(**inputs).logits
    with_image = drafter(**inputs, visual_embeds=visual)
    assert torch.equal(plain, with_image.logits)
    # the gate itself still learns; the cross-attention weights get no gradient until it opens
    with_image.logits.square().mean().backward()
    assert drafter.layers[0].visual_gate.grad.abs().item() > 0
    assert torch.count_nonzero(drafter.layers[0].visual_attn.q_proj.weight.grad) == 0


def test_open_gate_changes_output(target):
    drafter = _drafter(target)
    inputs, visual = _inputs(target, drafter)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.visual_gate.fill_(0.5)
        plain = drafter(**inputs).logits
        with_image = drafter(**inputs, visual_embeds=visual).logits
        # a row whose visual tokens are all padding sees no image (and no NaN)
        no_tokens = torch.zeros(visual.shape[:2], dtype=torch.bool)
        no_tokens[1] = True
        masked = drafter(**inputs, visual_embeds=visual, visual_mask=no_tokens).logits
    assert (plain - with_image).abs().max() > 1e-3
    assert torch.equal(masked[0], plain[0]) and torch.allclose(masked[1], with_image[1], atol=1e-6)


def test_block_is_causal_and_context_stops_before_the_block(target):
    """Depth-k predictions do not depend on the block length, nor on context slots at or after the block."""
    drafter = _drafter(target)
    inputs, _ = _inputs(target, drafter, length=12)
    with torch.no_grad():
        full = drafter(**inputs).logits
        short = drafter(**{**inputs, "input_ids": inputs["input_ids"][:, :2],
                           "position_ids": inputs["position_ids"][:, :2]}).logits
        # MASK columns are MASKs whatever id they hold
        other_ids = inputs["input_ids"].clone()
        other_ids[:, 1:] = 9
        relabelled = drafter(**{**inputs, "input_ids": other_ids}).logits
        # future context slots (positions 11, 12) are invisible to a block starting at 11
        future = torch.randn(2, 2, inputs["target_hidden"].shape[-1])
        longer = drafter(**{**inputs, "target_hidden": torch.cat([inputs["target_hidden"], future], 1),
                            "context_position_ids": torch.arange(13).expand(2, -1)}).logits
    torch.testing.assert_close(short, full[:, :2], atol=1e-5, rtol=1e-5)
    assert torch.equal(relabelled, full)
    torch.testing.assert_close(longer, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
def test_save_load_round_trip_through_auto_classes(target, tmp_path, fuse):
    register_auto_classes()
    register_auto_classes()  # idempotent
    drafter = _drafter(target, fuse_previous_state=fuse)
    with torch.no_grad():
        drafter.layers[1].visual_gate.fill_(0.3)  # a trained gate must survive the round trip
    inputs, visual = _inputs(target, drafter)
    with torch.no_grad():
        expected = drafter(**inputs, visual_embeds=visual).logits
    drafter.save_pretrained(tmp_path)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as saved:
        names = list(saved.keys())
        shapes = [saved.get_slice(name).get_shape() for name in names]
    assert not any("embed_tokens" in name or "lm_head" in name for name in names)
    assert not any(VOCAB_SIZE in shape for shape in shapes)  # no vocabulary-sized tensor is stored

    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, LaSpecDrafterConfig) and config.target_layer_ids == [0, 1]
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, LaSpecDrafterModel) and not loaded.has_target
    assert loaded.config.fuse_previous_state is fuse and (loaded.previous_proj is not None) is fuse
    loaded.attach_target(target).eval()
    with torch.no_grad():
        got = loaded(**inputs, visual_embeds=visual).logits
    assert torch.equal(got, expected)


def test_forward_without_target_raises(target):
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target))
    inputs, _ = _inputs(target, _drafter(target))
    with pytest.raises(RuntimeError, match="attach_target"):
        drafter(**inputs)


def test_acceptance_weights_hand_case():
    accept = torch.tensor([[0.5, 0.8, 0.9], [1.0, 0.0, 0.5]], requires_grad=True)
    weights = acceptance_weights(accept)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 0.5, 0.4], [1.0, 1.0, 0.0]]))
    assert not weights.requires_grad


def test_acceptance_aware_loss_equals_hand_formula():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen, requires_grad=True)
    labels = torch.tensor([[1, 4, 0], [2, 2, -100]])
    accept = torch.tensor([[0.5, 0.8, 0.9], [0.7, 0.6, 0.3]])
    loss = acceptance_aware_loss(logits, labels, accept)
    log_probs = torch.log_softmax(logits.detach(), -1)
    weights = [[1.0, 0.5, 0.4], [1.0, 0.7, 0.0]]  # row 1, position 3 ignored (-100)
    numerator = sum(weights[b][k] * -log_probs[b, k, labels[b, k]] for b in range(2) for k in range(3)
                    if labels[b, k] != -100)
    expected = numerator / (1.0 + 0.5 + 0.4 + 1.0 + 0.7)
    torch.testing.assert_close(loss.detach(), expected)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    masked = acceptance_aware_loss(logits, labels, accept, mask=mask)
    expected_masked = (numerator - 0.4 * -log_probs[0, 2, 0]) / (1.0 + 0.5 + 1.0 + 0.7)
    torch.testing.assert_close(masked.detach(), expected_masked)
    loss.backward()
    assert logits.grad is not None


def test_accept_probs_from_greedy_and_sampling():
    draft_logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]]))
    greedy = accept_probs_from(draft_logits, torch.tensor([[1, 2]]), greedy=True)
    torch.testing.assert_close(greedy, torch.tensor([[0.3, 0.8]]))
    target_probs = torch.tensor([[[0.2, 0.7, 0.1], [0.0, 0.0, 1.0]]])
    torch.testing.assert_close(accept_probs_from(draft_logits, target_probs, greedy=True), greedy)
    sampling = accept_probs_from(draft_logits, target_probs, greedy=False)
    torch.testing.assert_close(sampling, torch.tensor([[0.2 + 0.3 + 0.1, 0.8]]))


def test_a_few_steps_on_the_targets_greedy_tokens_lower_the_loss(target):
    """Train on the target's own greedy continuations; blocks anchored at several positions share a context."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(*TEXT_TOKEN_RANGE, (8, 4), generator=gen)
    with torch.no_grad():
        sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16,
                                    do_sample=False)  # (8, 20): tokens after the prompt are greedy
        hidden = target(sequences, output_hidden_states=True).hidden_states
    drafter = _drafter(target).train()
    context = gather_target_hidden(hidden, drafter.config.target_layer_ids)  # (8, 20, 64)
    anchors = torch.tensor([4, 8, 12])  # block starts at the anchor's token, predicts the next BLOCK tokens
    rows = torch.arange(8).repeat_interleave(len(anchors))  # (24,)
    starts = anchors.repeat(8)  # (24,)
    block, positions = make_block_inputs(sequences[rows, starts], starts, BLOCK)
    labels = sequences[rows[:, None], positions + 1]  # (24, BLOCK)
    batch = dict(input_ids=block, target_hidden=context[rows], position_ids=positions)

    def loss_fn():
        logits = drafter(**batch).logits
        return acceptance_aware_loss(logits, labels, accept_probs_from(logits, labels, greedy=True))

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    initial = loss_fn().item()
    for _ in range(25):
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        optimizer.step()
    assert loss_fn().item() < 0.7 * initial
    assert all(p.grad is None for p in target.parameters())  # the target's embedding / head stay frozen


def test_drafter_for_a_vlm_target_reads_selected_visual_tokens():
    """Capture -> select -> the selected image embeddings feed the drafter's cross-attention."""
    from tiny_models import IMAGE_ID, make_inputs
    from transformers import DynamicCache

    from hf_adaptive_spec.drafters.vision import QueryCapture, VisualKeyStore, select_visual_tokens

    vlm = build_model("qwen2_vl")
    inputs = make_inputs("qwen2_vl", batch_size=2)
    cache = DynamicCache(config=vlm.config)
    with torch.no_grad(), QueryCapture(vlm, layer_ids=[0, 1]) as capture:
        hidden = vlm(**inputs, use_cache=True, output_hidden_states=True, **{cache_argument(vlm): cache}).hidden_states
    store = VisualKeyStore.from_cache(cache, [0, 1], inputs["input_ids"] == IMAGE_ID)
    indices, _ = select_visual_tokens(capture.query_at(-1), store, m_per_layer=3, keep=3)  # (2, 3)
    visual = hidden[0].gather(1, indices[..., None].expand(-1, -1, hidden[0].shape[-1]))  # image embeddings

    drafter = _drafter(vlm, num_visual_tokens=3)
    context = gather_target_hidden(hidden, drafter.config.target_layer_ids)[:, :-1]
    length = inputs["attention_mask"].sum(-1)
    block, positions = make_block_inputs(inputs["input_ids"][:, -1], length - 1, BLOCK)
    context_positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp_min(0)[:, :-1]
    batch = dict(input_ids=block, target_hidden=context, context_mask=inputs["attention_mask"][:, :-1].bool(),
                 position_ids=positions, context_position_ids=context_positions)
    with torch.no_grad():
        plain = drafter(**batch).logits
        gated_shut = drafter(**batch, visual_embeds=visual).logits
        for layer in drafter.layers:
            layer.visual_gate.fill_(1.0)
        gated_open = drafter(**batch, visual_embeds=visual).logits
    assert plain.shape == (2, BLOCK, VOCAB_SIZE)
    assert torch.equal(plain, gated_shut) and not torch.allclose(plain, gated_open)


def test_draft_vocabulary_scores_only_its_tokens_and_survives_save_load(target, tmp_path):
    register_auto_classes()
    drafter = _drafter(target)
    inputs, _ = _inputs(target, drafter)
    with torch.no_grad():
        out = drafter(**inputs)
        full = drafter.draft_logits(out.last_hidden_state)
        assert torch.equal(full, out.logits)  # no draft vocabulary: the whole LM head
        subset = torch.tensor([40, 3, 77, 12, 100])
        drafter.set_draft_vocabulary(subset)
        assert drafter.config.draft_vocab_size == 5
        draft = drafter.draft_logits(out.last_hidden_state)
    outside = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    outside[subset] = False
    assert torch.isneginf(draft[..., outside]).all()
    torch.testing.assert_close(draft[..., subset], out.logits[..., subset])
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).attach_target(target).eval()
    assert torch.equal(loaded.draft_vocab, subset) and loaded.config.draft_vocab_size == 5
    with torch.no_grad():
        torch.testing.assert_close(loaded.draft_logits(out.last_hidden_state), draft)
    with pytest.raises(ValueError, match="distinct"):
        drafter.set_draft_vocabulary([3, 3])
    with pytest.raises(ValueError, match="lie in"):
        drafter.set_draft_vocabulary([VOCAB_SIZE])
    drafter.set_draft_vocabulary(None)
    assert drafter.draft_vocab is None and drafter.config.draft_vocab_size is None
    with torch.no_grad():
        assert torch.equal(drafter.draft_logits(out.last_hidden_state), out.logits)


def test_precomputed_context_keys_values_give_the_same_block(target):
    drafter = _drafter(target)
    inputs, visual = _inputs(target, drafter)
    with torch.no_grad():
        context = drafter.encode_context(inputs["target_hidden"])
        positions = torch.arange(context.shape[1]).expand(context.shape[0], -1)
        expected = drafter.forward_block(inputs["input_ids"], context, position_ids=inputs["position_ids"],
                                         visual_embeds=visual).logits
        head, tail = drafter.context_kv(context[:, :7], positions[:, :7]), drafter.context_kv(context[:, 7:],
                                                                                              positions[:, 7:])
        cached = head.extend(tail)  # built in two pieces, as the loop does
        got = drafter.forward_block(inputs["input_ids"], cached, context_position_ids=positions,
                                    position_ids=inputs["position_ids"], visual_embeds=visual).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="context_position_ids"):
        drafter.forward_block(inputs["input_ids"], cached, position_ids=inputs["position_ids"])


def test_previous_state_fusion(target):
    """A zero fusion projection is the unfused drafter exactly; the state used by default is the context slot just
    before the block; misuse is refused."""
    plain = _drafter(target)
    fused = _drafter(target, fuse_previous_state=True)
    fused.load_state_dict(plain.state_dict(), strict=False)
    inputs, _ = _inputs(target, plain)
    with torch.no_grad():
        fused.previous_proj.weight.zero_()
        assert torch.equal(fused(**inputs).logits, plain(**inputs).logits)
        fused.previous_proj.weight.normal_(0, 0.1)
        default = fused(**inputs).logits
        last = fused.encode_context(inputs["target_hidden"])[:, -1]  # position length - 2 = block start - 1
        explicit = fused(**inputs, previous_state=last).logits
        zero = fused(**inputs, previous_state=torch.zeros_like(last)).logits
        # a block starting at position 0 has no state before it: it fuses zeros
        first = fused(**{**inputs, "position_ids": inputs["position_ids"] - inputs["position_ids"][:, :1]}).logits
        first_zero = fused(**{**inputs, "position_ids": inputs["position_ids"] - inputs["position_ids"][:, :1]},
                           previous_state=torch.zeros_like(last)).logits
    assert torch.equal(default, explicit)
    assert (default - zero).abs().max() > 1e-3
    torch.testing.assert_close(first, first_zero)
    with pytest.raises(ValueError, match="fuse_previous_state"):
        plain(**inputs, previous_state=last)
    context = fused.encode_context(inputs["target_hidden"])
    positions = torch.arange(context.shape[1]).expand(2, -1)
    with pytest.raises(ValueError, match="previous_state"):
        fused.forward_block(inputs["input_ids"], fused.context_kv(context, positions), context_position_ids=positions,
                            position_ids=inputs["position_ids"])
    with pytest.raises(ValueError, match="previous_state must have shape"):
        fused(**inputs, previous_state=last[:, :5])


def test_text_only_drafter_has_no_visual_branch_and_round_trips(target, tmp_path):
    """num_visual_tokens=0 builds no visual branch (fewer weights), refuses visual inputs and survives save/load."""
    with_branch = _drafter(target)
    drafter = _drafter(target, num_visual_tokens=0)
    names = [name for name, _ in drafter.named_parameters()]
    assert not any("visual" in name for name in names)
    extra = sum(p.numel() for n, p in with_branch.named_parameters() if "visual" in n)
    assert sum(p.numel() for p in drafter.parameters()) == sum(p.numel() for p in with_branch.parameters()) - extra
    inputs, visual = _inputs(target, drafter)
    with torch.no_grad():
        expected = drafter(**inputs).logits
    with pytest.raises(ValueError, match="text-only drafter"):
        drafter(**inputs, visual_embeds=visual[:, :1])
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).attach_target(target).eval()
    assert loaded.config.num_visual_tokens == 0 and loaded.layers[0].visual_attn is None
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, expected)


def test_negative_visual_tokens_are_refused(target):
    with pytest.raises((ValueError, StrictDataclassClassValidationError), match="num_visual_tokens"):
        LaSpecDrafterConfig.for_target(target, num_visual_tokens=-1)
