"""The hf-adaptive-spec command line: parsing and argument errors (no model is loaded)."""

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
