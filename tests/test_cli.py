"""The hf-adaptive-spec command line: parsing, argument errors and what the demo times (tiny models only)."""

import re

import pytest

from hf_adaptive_spec import cli


def test_demo_defaults_are_the_real_pair():
    args = cli.build_parser().parse_args(["demo"])
    assert (args.target, args.drafter, args.strategy) == (cli.DEFAULT_TARGET, cli.DEFAULT_DRAFTER, "sage")
    assert args.drafter_int8 and args.max_new_tokens == 128


def test_generate_needs_models_and_prompt():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--prompt", "hi"])
    args = cli.build_parser().parse_args(
        ["generate", "--target", "a", "--drafter", "b", "--prompt", "hi", "--strategy", "chain", "--no-drafter-int8"]
    )
    assert args.strategy == "chain" and not args.drafter_int8


def test_unknown_strategy_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--strategy", "nope"])


def test_fetch_without_a_name_lists_models():
    with pytest.raises(SystemExit, match="qwen2.5-coder-1.5b-instruct"):
        cli.main(["fetch"])


def test_unknown_model_path_is_a_clear_error():
    with pytest.raises(SystemExit, match="neither a local model folder nor a registry name"):
        cli._resolve_path("/no/such/folder")


class _Digits:
    """A stand-in tokenizer for the streamer: token ids as text."""

    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)


@pytest.mark.measured_cost
def test_demo_times_speculation_after_the_one_off_cost_curve(tmp_path, monkeypatch, capsys, fake_clock):
    # a fresh machine has no cost curve yet: measuring it (~20 s for the demo's 1.5B target on 2 cores) must
    # happen in the warm-up, not in the timed speculative run that the demo compares with plain generate
    from hf_adaptive_spec import cost
    from hf_adaptive_spec.cost import store as cost_store
    from tiny_models import build_drafter, build_model, make_inputs

    monkeypatch.setenv("HF_ADAPTIVE_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_store, "_MEMORY", {})
    timed, measured = [], []  # the timed speculative run started; when the curve was measured
    measure = cost.measure_verifier_cost

    def slow_measure(*args, **kwargs):
        measured.append("timed" if timed else "warm-up")
        fake_clock.seconds += 0.2  # a real model's measurement takes seconds
        return measure(*args, **kwargs)

    target = build_model("llama")
    generate = type(target).generate

    def spy(self, *args, **kwargs):
        if kwargs.get("streamer") is not None:  # the timed speculative run
            timed.append(True)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(cost_store, "measure_verifier_cost", slow_measure)
    monkeypatch.setattr(type(target), "generate", spy)
    drafter = build_drafter("llama", target, "copy")
    inputs = make_inputs("llama", batch_size=1)
    assert cli._generate_and_compare(target, drafter, inputs, _Digits(), "sage", None, 8, compare=True) == 0
    assert timed == [True] and measured == ["warm-up"]
    printed = capsys.readouterr().out
    assert "measured the verifier's cost curve once" in printed and "same output: yes" in printed


@pytest.mark.parametrize("strategy", ["sage", "plain"])
def test_demo_reports_its_speedup_over_plain_generate_and_over_the_plain_mode(strategy, capsys):
    from tiny_models import build_drafter, build_model, make_inputs

    target = build_model("llama")
    drafter = build_drafter("llama", target, "copy")
    assert cli._generate_and_compare(target, drafter, make_inputs("llama"), _Digits(), strategy, None, 8,
                                     compare=True) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^plain generate: [0-9.]+s -> speedup [0-9.]+x \(same output: yes\)$", printed, re.MULTILINE)
    plain_mode = re.search(r'^plain mode \(spec_strategy="plain", no drafter\): [0-9.]+s -> speedup [0-9.]+x '
                           r"\(same output: yes\)$", printed, re.MULTILINE)
    assert (plain_mode is not None) == (strategy != "plain")  # the plain mode is no baseline of itself


def test_demo_fails_when_a_baseline_gives_other_tokens(monkeypatch, capsys):
    import torch
    from tiny_models import build_drafter, build_model, make_inputs

    target = build_model("llama")
    other = {"plain generate": (1.0, torch.zeros(1, 1, dtype=torch.long))}
    monkeypatch.setattr(cli, "_baselines", lambda *args: other)
    assert cli._generate_and_compare(target, build_drafter("llama", target, "copy"), make_inputs("llama"), _Digits(),
                                     "sage", None, 8, compare=True) == 1
    printed = capsys.readouterr().out
    assert "plain generate: 1.00s" in printed and "(same output: NO)" in printed
