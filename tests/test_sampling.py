"""Lossless sampling: speculative samples follow the target's own distribution exactly.

The end-to-end test draws 20,000 samples of the first three generated tokens
through `generate(do_sample=True, ...)` on a tiny model with an 8-token
vocabulary, where the target's joint distribution (temperature and top-p
applied) can be enumerated exactly, and runs a chi-square test at a 0.1%
false-alarm rate. The same test pointed at deliberately wrong acceptance
rules fails, so it can catch the bugs it exists for.
"""

import copy
import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from hf_adaptive_spec import ChainConfig, LaSpecDrafterConfig, LaSpecDrafterModel, SageConfig, StaticTreeConfig
from hf_adaptive_spec.decoding import acceptance
from hf_adaptive_spec.trees import DraftTree
from tiny_models import build_drafter, build_model, make_inputs

VOCAB = 8
TEMPERATURE = 0.8
TOP_P = 0.95
NUM_TOKENS = 3  # tokens whose joint distribution is tested
SAMPLES = 20_000
ALPHA = 1e-3  # false-alarm rate of one test


def _tiny_llama(seed, scale):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=scale,
                         pad_token_id=None, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def models():
    return _tiny_llama(0, 0.25), _tiny_llama(5, 0.4)


PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


def _processors():
    return LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopPLogitsWarper(TOP_P)])


@torch.no_grad()
def _exact_joint(target):
    """P(x1, x2, x3) under the target with the same warpers, by enumeration."""
    processors = _processors()
    joint = torch.zeros([VOCAB] * NUM_TOKENS, dtype=torch.float64)
    for prefix in itertools.product(range(VOCAB), repeat=NUM_TOKENS - 1):
        probability = 1.0
        ids = PROMPT
        for position in range(NUM_TOKENS):
            logits = target(ids).logits[:, -1].float()
            probs = torch.softmax(processors(ids, logits), dim=-1)[0].double()
            if position == NUM_TOKENS - 1:
                joint[prefix] += probability * probs
                break
            probability = probability * probs[prefix[position]]
            if probability == 0:
                break
            ids = torch.cat([ids, torch.tensor([[prefix[position]]])], dim=1)
    return joint


def _chi_square_p_value(counts, expected_probs):
    """p-value of Pearson's chi-square test, cells with expected count < 5 pooled."""
    expected = expected_probs.flatten() * counts.sum()
    observed = counts.flatten().double()
    small = expected < 5
    cells_observed = torch.cat([observed[~small], observed[small].sum()[None]])
    cells_expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = cells_expected > 0
    if bool((observed[expected == 0] > 0).any()):
        return 0.0  # a sample the target can never produce
    statistic = ((cells_observed[keep] - cells_expected[keep]) ** 2 / cells_expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0))


def _speculative_counts(target, drafter, strategy, config, seed=0, rows=2_000):
    torch.manual_seed(seed)
    counts = torch.zeros([VOCAB] * NUM_TOKENS, dtype=torch.long)
    for _ in range(SAMPLES // rows):
        out = target.generate(
            input_ids=PROMPT.expand(rows, -1), attention_mask=torch.ones(rows, PROMPT.shape[1], dtype=torch.long),
            do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0, max_new_tokens=NUM_TOKENS + 1,
            assistant_model=drafter, spec_strategy=strategy, spec_config=config,
        )
        new = out[:, PROMPT.shape[1]: PROMPT.shape[1] + NUM_TOKENS]
        index = (new * torch.tensor([VOCAB ** (NUM_TOKENS - 1 - i) for i in range(NUM_TOKENS)])).sum(-1)
        counts += torch.bincount(index, minlength=VOCAB ** NUM_TOKENS).view_as(counts)
    return counts


CASES = {
    "chain": ChainConfig(num_draft_tokens=3, adaptive=False),
    "static_tree": StaticTreeConfig(paths=[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]),
    # a node budget smaller than the tree: sampled children may only be dropped for what came before them
    "sage": SageConfig(d_min=3, d_max=3, w_min=3, w_max=3, n_max=5, theta_scale=0.0, adaptive_history=False),
    # the block drafter: every node of depth d draws from the block's depth-d distribution
    "laspec": {"top_k": 2, "n_max": 6, "block_size": 3},
}


def _laspec_drafter(target):
    torch.manual_seed(3)
    config = LaSpecDrafterConfig.for_target(target, block_size=3, initializer_range=0.5)
    return LaSpecDrafterModel(config).eval().attach_target(target)


@pytest.mark.parametrize("strategy", list(CASES))
def test_speculative_sampling_follows_the_target(models, strategy):
    target, drafter = models
    if strategy == "laspec":
        drafter = _laspec_drafter(target)
    exact = _exact_joint(target)
    counts = _speculative_counts(target, drafter, strategy, CASES[strategy])
    assert _chi_square_p_value(counts, exact) > ALPHA


def test_speculative_sampling_with_a_draft_vocabulary_follows_the_target(models):
    """A drafter that scores only some tokens (q = 0 on the rest): the target's distribution is still exact."""
    target, _ = models
    drafter = _laspec_drafter(target)
    vocab_size = drafter.config.vocab_size
    drafter.set_draft_vocabulary(torch.arange(0, vocab_size, 2))  # every other token is never drafted
    exact = _exact_joint(target)
    counts = _speculative_counts(target, drafter, "laspec", CASES["laspec"])
    assert _chi_square_p_value(counts, exact) > ALPHA


def _with_replacement_update(p, q, token):
    residual = (p - q).clamp_min(0)
    return residual / residual.sum(-1, keepdim=True).clamp_min(1e-30), q  # q(x) is not removed


def _ignore_q(p, q, token):
    return p.gather(1, token[:, None]).squeeze(1)  # accept with p(x), as if q were uniform


@pytest.mark.parametrize(
    "patch_name, wrong", [("_reject_update", _with_replacement_update), ("_accept_probability", _ignore_q)]
)
def test_the_statistical_test_catches_wrong_rules(models, monkeypatch, patch_name, wrong):
    target, drafter = models
    exact = _exact_joint(target)
    monkeypatch.setattr(acceptance, patch_name, wrong)
    counts = _speculative_counts(target, drafter, "static_tree", CASES["static_tree"])
    assert _chi_square_p_value(counts, exact) < ALPHA


def _synthetic_tree(batch, tokens, parents, draft_probs):
    tokens = torch.tensor([tokens]).expand(batch, -1).clone()
    parents = torch.tensor([parents]).expand(batch, -1)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    from hf_adaptive_spec.ops import ancestor_matrix

    _, depths = ancestor_matrix(parents)
    return DraftTree(tokens=tokens, parents=parents, valid=valid, probs=torch.ones(tokens.shape),
                     cum_probs=torch.ones(tokens.shape), depths=depths, drafter_slot=torch.zeros_like(tokens),
                     num_levels=int(depths.max()), draft_probs=draft_probs.expand(batch, -1, -1))


def test_zero_probability_edge_cases():
    """Target mass on a token the drafter never proposes; a one-token target (top-p leaving one token)."""
    torch.manual_seed(0)
    batch = 40_000
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0] * 4, [0.0] * 4]])  # the drafter never proposes token 2
    p = torch.tensor([[[0.2, 0.1, 0.7, 0.0], [0.25] * 4, [0.25] * 4]])
    tree = _synthetic_tree(batch, [9, 0, 1], [-1, 0, 0], q)
    # the children must be a draw without replacement from q: both orders, equally often
    tree.tokens = torch.where(torch.arange(batch)[:, None] % 2 == 0, tree.tokens, torch.tensor([[9, 1, 0]]))
    path, length, bonus = acceptance.sample_accept(tree, p.expand(batch, -1, -1))
    first = torch.where(length > 0, tree.tokens.gather(1, path[:, 1:2]).squeeze(1), bonus)
    frequencies = torch.bincount(first, minlength=4).double() / batch
    torch.testing.assert_close(frequencies, p[0, 0].double(), atol=0.01, rtol=0)
    one_hot = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [0.25] * 4, [0.25] * 4]])
    path, length, bonus = acceptance.sample_accept(tree, one_hot.expand(batch, -1, -1))
    assert bool((length == 0).all()) and bool((bonus == 2).all())


def test_children_table_orders_siblings_as_drawn():
    parents = torch.tensor([[-1, 0, 0, 1, 0, 1, -1]])
    valid = torch.tensor([[True] * 6 + [False]])
    table = acceptance.children_table(parents, valid)
    assert table[0, 0].tolist() == [1, 2, 4]
    assert table[0, 1].tolist() == [3, 5, -1]
    assert table[0, 2].tolist() == [-1, -1, -1]


@pytest.mark.parametrize("strategy", ["chain", "static_tree", "sage"])
def test_seeded_runs_repeat(strategy):
    arch = "qwen2_vl"
    target = build_model(arch)
    drafter = build_drafter(arch, target, "small")
    inputs = make_inputs(arch, batch_size=2)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(target.generate(**inputs, do_sample=True, temperature=0.7, top_k=20, max_new_tokens=16,
                                    assistant_model=drafter, spec_strategy=strategy))
    assert torch.equal(outs[0], outs[1])


def test_near_zero_temperature_equals_greedy():
    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    inputs = make_inputs("llama", batch_size=2)
    greedy = target.generate(**inputs, do_sample=False, max_new_tokens=16)
    torch.manual_seed(0)
    sampled = target.generate(**inputs, do_sample=True, temperature=1e-5, max_new_tokens=16, assistant_model=drafter,
                              spec_strategy="sage")
    assert torch.equal(sampled, greedy)


def test_copy_drafter_is_always_accepted_when_sampling():
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=1)
    torch.manual_seed(0)
    out = target.generate(**inputs, do_sample=True, temperature=1.0, max_new_tokens=24,
                          assistant_model=copy.deepcopy(target), spec_strategy="chain",
                          spec_config=ChainConfig(num_draft_tokens=3, adaptive=False), return_dict_in_generate=True)
    assert out.spec_stats.acceptance_rate == pytest.approx(1.0)
