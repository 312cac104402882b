"""Datastore lookup: proposals against a brute-force vote, files and drafter checkpoints, the branch in the loop
(accepted exactly as far as the store's continuation agrees, output exact), and its calibration codes."""

import random
from collections import Counter

import pytest
import torch
from test_laspec_loop import _drafter, _oracle, replay_accepted
from tiny_models import build_model, make_inputs
from transformers import AutoModel

import hf_adaptive_spec  # noqa: F401  (registers the Auto classes)
from hf_adaptive_spec.cost import LookupCalibrator
from hf_adaptive_spec.drafters.datastore import DATASTORE_FILE, TokenDatastore
from hf_adaptive_spec.trees.branches import MAX_LOOKUP_CODE, STORE_CODE_OFFSET, lookup_code, store_code


def _reference(sequences, row, min_ngram, max_ngram, num_tokens):
    """The longest suffix found, then token by token the most common next token (ties: the smaller id) among the
    occurrences that agree so far, by brute force over every occurrence."""
    for n in range(min(max_ngram, len(row)), min_ngram - 1, -1):
        suffix = row[len(row) - n:]
        follows = [seq[j + n:] for seq in sequences for j in range(len(seq) - n) if seq[j:j + n] == suffix]
        if not follows:
            continue
        chain = []
        for depth in range(num_tokens):
            votes = Counter(rest[depth] for rest in follows if len(rest) > depth)
            if not votes:
                break
            best = max(votes.values())
            token = min(t for t, c in votes.items() if c == best)
            chain.append(token)
            follows = [rest for rest in follows if len(rest) > depth and rest[depth] == token]
        return chain, n
    return [], 0


@pytest.mark.parametrize("seed", range(8))
def test_propose_matches_a_brute_force_vote(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 9])  # small vocabularies: many repeated n-grams, ties and sequence ends
    sequences = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(rng.randrange(1, 12))]
    min_ngram, max_ngram = rng.choice([(1, 4), (2, 3), (2, 8)])
    store = TokenDatastore.from_sequences(sequences, min_ngram=min_ngram, max_ngram=max_ngram,
                                          max_occurrences=10_000)
    for _ in range(40):
        row = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
        k = rng.randrange(1, 7)
        assert store.propose(row, k) == _reference(sequences, row, min_ngram, max_ngram, k)


def test_propose_batch_and_occurrences():
    store = TokenDatastore.from_sequences([[1, 2, 3, 4], [9, 2, 3, 5, 6], [2, 3, 4, 7]], min_ngram=2, max_ngram=3)
    assert store.occurrences([2, 3]).tolist() == [3, 8, 13]  # the positions after each occurrence
    ids = torch.tensor([[0, 0, 8, 2, 3], [7, 9, 2, 3, 0]])  # row 0 left-padded, row 1 ends before its filler
    tokens, valid, match, _ = store.propose_batch(ids, torch.tensor([5, 4]), torch.tensor([2, 0]), num_tokens=3)
    assert match.tolist() == [2, 3]
    assert tokens[0, :2].tolist() == [4, 7] and valid[0].tolist() == [True, True, False]  # 4 (2 of 3), then 7
    assert tokens[1, :2].tolist() == [5, 6] and valid[1].tolist() == [True, True, False]  # 9 2 3 -> 5 6
    with pytest.raises(ValueError, match="outside"):
        store.occurrences([1])


def test_a_capped_vote_reads_evenly_spaced_occurrences():
    sequences = [[1, 2, 5]] * 30 + [[1, 2, 6]] * 10
    store = TokenDatastore.from_sequences(sequences, min_ngram=2, max_ngram=2, max_occurrences=4)
    assert store.propose([1, 2], 1) == ([5], 2)  # occurrences 0, 13, 26, 39: three 5s, one 6


def test_bad_settings_and_tokens_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        TokenDatastore(torch.tensor([1, 2, -1]), min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="max_occurrences"):
        TokenDatastore(torch.tensor([1, 2, -1]), max_occurrences=0)
    with pytest.raises(ValueError, match=">= 0"):
        TokenDatastore.from_sequences([[1, -3]])
    with pytest.raises(ValueError, match="-1 between"):
        TokenDatastore(torch.tensor([1, -2, -1]))


def test_save_load_round_trip(tmp_path):
    store = TokenDatastore.from_sequences([[1, 2, 3], [4, 5]], min_ngram=1, max_ngram=5, max_occurrences=7,
                                          info={"source": "unit test"})
    loaded = TokenDatastore.load(store.save(tmp_path / "store.safetensors"))
    assert torch.equal(loaded.tokens, store.tokens)
    assert (loaded.min_ngram, loaded.max_ngram, loaded.max_occurrences, loaded.info) == (1, 5, 7, {"source": "unit test"})
    assert loaded.propose([1, 2], 2) == store.propose([1, 2], 2) == ([3], 2)
    from safetensors.torch import save_file

    save_file({"tokens": torch.zeros(3, dtype=torch.int32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a TokenDatastore"):
        TokenDatastore.load(tmp_path / "other.safetensors")


def test_drafter_checkpoint_carries_its_datastore(tmp_path):
    target = build_model("llama")
    drafter = _drafter(target)
    assert drafter.datastore is None
    store = TokenDatastore.from_sequences([[10, 11, 12, 13], [10, 11, 14]])
    drafter.set_datastore(store).save_pretrained(tmp_path)
    assert (tmp_path / DATASTORE_FILE).exists()
    loaded = AutoModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.datastore.tokens, store.tokens)
    assert loaded.datastore.propose([10, 11], 2) == store.propose([10, 11], 2)
    loaded.set_datastore(None).save_pretrained(tmp_path)  # saved without: the old file must not come back
    assert not (tmp_path / DATASTORE_FILE).exists() and AutoModel.from_pretrained(tmp_path).datastore is None
    with pytest.raises(ValueError, match="vocabulary"):
        drafter.set_datastore(TokenDatastore.from_sequences([[drafter.config.vocab_size]]))
    with pytest.raises(ValueError, match="TokenDatastore or None"):
        drafter.set_datastore([1, 2, 3])


def test_lookup_codes_keep_sources_apart():
    assert lookup_code(3) == 3 and lookup_code(0) == 0 and lookup_code(99) == STORE_CODE_OFFSET - 1
    assert lookup_code(torch.tensor([0, 2, 40])).tolist() == [0, 2, STORE_CODE_OFFSET - 1]
    codes = {store_code(a, v) for v in range(1, 60) for a in range(1, v + 1)}
    # every share class with 3+ voters (2 size classes x 5), the two a 1-2 voter vote can reach (1/2, all)
    assert STORE_CODE_OFFSET < min(codes) and max(codes) == MAX_LOOKUP_CODE and len(codes) == 12
    assert store_code(1, 10) < store_code(9, 10) and store_code(9, 10) != store_code(90, 100)  # share, then size
    calibrator = LookupCalibrator()
    agreed = torch.tensor([False])
    calibrator.accepted.view(-1)[calibrator._index(torch.tensor([store_code(2, 2)]), agreed)] = 0.0
    assert float(calibrator(torch.tensor([2]), agreed)) == 0.5  # a context code is untouched
    assert float(calibrator(torch.tensor([store_code(2, 2)]), agreed)) == 0.0


def test_support_counts_the_votes():
    sequences = [[1, 2, 5, 7], [1, 2, 5, 8], [1, 2, 6], [3, 1, 2, 5, 7]]
    store = TokenDatastore.from_sequences(sequences, min_ngram=2, max_ngram=2)
    chain, n, support = store.propose_with_support([0, 1, 2], 3)
    assert (chain, n) == ([5, 7], 2) and support == [(3, 4), (2, 3)]  # 5 of {5,5,6,5}; then 7 of {7,8,7}
    ids = torch.tensor([[0, 1, 2]])
    tokens, valid, match, codes = store.propose_batch(ids, torch.tensor([3]), torch.tensor([0]), 3)
    assert codes[0].tolist() == [store_code(3, 4), store_code(2, 3), 0] and valid[0].tolist() == [True, True, False]


@pytest.mark.parametrize("arch,host_trees", [("llama", True), ("llama", False), ("qwen2_vl", True)])
def test_datastore_branch_is_accepted_exactly_as_far_as_the_store_agrees(arch, host_trees, monkeypatch):
    """With a drafter that is always wrong and context lookup off, every accepted token comes from the datastore
    branch: each round's accepted length equals a brute-force replay of the store on the final sequence."""
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=1)
    prompt_length = inputs["input_ids"].shape[1]
    new = 40
    expected = target.generate(**inputs, max_new_tokens=new, do_sample=False)
    answer = expected[0, prompt_length:].tolist()
    # the store holds the answer in pieces, with a wrong turn in one of them: chains end where it disagrees
    pieces = [answer[:12], answer[10:25] + [7, 7], answer[22:]]
    store = TokenDatastore.from_sequences(pieces, min_ngram=2, max_ngram=4)
    _oracle(monkeypatch, expected[:, prompt_length:], corrupt_every=1)  # every drafted token wrong
    drafter = _drafter(target).set_datastore(store)
    out = target.generate(**inputs, max_new_tokens=new, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", return_dict_in_generate=True,
                          spec_config={"verify_cost": False, "top_k": 1, "context_lookup": 0,
                                       "datastore_tokens": 6}, spec_runtime={"host_trees": host_trees})
    assert torch.equal(out.sequences, expected)
    replayed = replay_accepted(expected[0].tolist(), prompt_length + 1, lambda row: store.propose(row, 6)[0])
    assert out.spec_stats.accepted_lengths == replayed
    assert max(replayed) > 4  # chains longer than the block were accepted, or the branch is untested


@pytest.mark.parametrize("arch", ["llama", "qwen2_5_vl"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_laspec_with_a_datastore_equals_plain(arch, batch_size):
    target = build_model(arch)
    inputs = make_inputs(arch, batch_size=batch_size)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    rng = random.Random(0)
    vocab = target.config.get_text_config().vocab_size
    sequences = [expected[0, inputs["input_ids"].shape[1]:].tolist()]  # partly right, partly random
    sequences += [[rng.randrange(vocab) for _ in range(30)] for _ in range(20)]
    drafter = _drafter(target).set_datastore(TokenDatastore.from_sequences(sequences, min_ngram=1))
    for config in (None, {"verify_cost": False, "top_k": 2, "n_max": 8}, {"datastore": False}):
        out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                              spec_strategy="laspec", spec_config=config)
        assert torch.equal(out, expected)


def test_datastore_settings_are_checked():
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=1)
    with pytest.raises(ValueError, match="carries no datastore"):
        target.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=_drafter(target),
                        spec_strategy="laspec", spec_config={"datastore": True})
    with pytest.raises(ValueError, match="datastore_tokens"):
        target.generate(**inputs, max_new_tokens=4, do_sample=False, assistant_model=_drafter(target),
                        spec_strategy="laspec", spec_config={"datastore_tokens": 0})


def test_model_card_describes_the_datastore(tmp_path):
    from hf_adaptive_spec.drafters.hub import describe_datastore

    target = build_model("llama")
    drafter = _drafter(target)
    (tmp_path / "README.md").write_text("# card\n\n## Measured\n- tau 2\n")
    assert describe_datastore(tmp_path / "nowhere") is None
    info = {"data": ["sharegpt[:3]"], "generated": 3, "answered": 0, "max_new_tokens": 12, "tokens": 7}
    drafter.set_datastore(TokenDatastore.from_sequences([[1, 2, 3], [4, 5, 6, 7]], info=info))
    for _ in range(2):  # saved twice: one section, replaced
        drafter.save_pretrained(tmp_path)
        describe_datastore(tmp_path)
        card = (tmp_path / "README.md").read_text()
        assert card.count("## Datastore") == 1 and "from sharegpt[:3]: 3 answers by the target" in card
        assert card.startswith("# card\n\n## Measured\n- tau 2\n")
    drafter.set_datastore(None).save_pretrained(tmp_path)
    describe_datastore(tmp_path)
    assert (tmp_path / "README.md").read_text() == "# card\n\n## Measured\n- tau 2\n"
