"""The generate() hook: stock behaviour without spec_strategy, install/uninstall, and clear refusals."""

import copy
import inspect
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.utils import GenerationMixin

import hf_adaptive_spec
from hf_adaptive_spec import ChainConfig, SageConfig, StaticTreeConfig
from hf_adaptive_spec.decoding import integration
from hf_adaptive_spec.adapters.compat import cache_argument, cache_from_kwargs, output_cache
from hf_adaptive_spec.strategies import STRATEGIES, default_tree_paths
from tiny_models import build_drafter, build_model, make_inputs


@pytest.fixture(scope="module")
def pair():
    target = build_model("llama")
    return target, build_drafter("llama", target, "small"), make_inputs("llama", batch_size=1)


def test_without_spec_strategy_generate_is_stock(pair):
    target, drafter, inputs = pair
    hooked_plain = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    hooked_assisted = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    hf_adaptive_spec.uninstall()
    try:
        assert not hf_adaptive_spec.is_installed()
        assert not hasattr(GenerationConfig(), "spec_strategy")
        stock_plain = target.generate(**inputs, max_new_tokens=12, do_sample=False)
        stock_assisted = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter)
        with pytest.raises(ValueError, match="spec_strategy"):  # the kwarg is unknown to stock generate
            target.generate(**inputs, max_new_tokens=4, assistant_model=drafter, spec_strategy="sage")
    finally:
        hf_adaptive_spec.install()
    assert torch.equal(hooked_plain, stock_plain)
    assert torch.equal(hooked_assisted, stock_assisted)


def test_install_twice_is_harmless(pair):
    target, drafter, inputs = pair
    generate_before = GenerationMixin.generate
    hf_adaptive_spec.install()
    hf_adaptive_spec.install()
    assert GenerationMixin.generate is generate_before
    out = target.generate(**inputs, max_new_tokens=6, do_sample=False, assistant_model=drafter, spec_strategy="chain")
    assert out.shape[1] == inputs["input_ids"].shape[1] + 6


def test_spec_strategy_in_a_generation_config(pair):
    target, drafter, inputs = pair
    expected = target.generate(**inputs, max_new_tokens=10, do_sample=False)
    config = GenerationConfig(max_new_tokens=10, do_sample=False, spec_strategy="static_tree",
                              spec_config=StaticTreeConfig(paths=[(0,), (0, 0)]))
    out = target.generate(**inputs, generation_config=config, assistant_model=drafter, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.spec_stats.strategy == "static_tree"
    assert out.spec_stats.drafted_tokens <= 2 * out.spec_stats.rounds


def test_spec_config_as_dict(pair):
    target, drafter, inputs = pair
    out = target.generate(**inputs, max_new_tokens=8, assistant_model=drafter, spec_strategy="sage",
                          spec_config={"d_min": 1, "d_max": 2}, return_dict_in_generate=True)
    assert max(out.spec_stats.accepted_lengths) <= 2


def test_registry_lists_strategies():
    assert set(STRATEGIES) >= {"chain", "static_tree", "sage"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(spec_strategy="nope"), "valid strategies: chain, laspec, plain, sage, static_tree"),
        (dict(spec_strategy="sage", num_beams=2), "beam search"),
        (dict(spec_strategy="sage", num_return_sequences=2, do_sample=False), "num_return_sequences"),
        (dict(spec_strategy="chain", spec_config=SageConfig()), "must be a ChainConfig"),
        (dict(spec_strategy="chain", spec_config={"num_draft_tokens": 0}), "ChainConfig.num_draft_tokens"),
        (dict(spec_strategy="chain", spec_config={"num_draft_tokens": 9}), "ChainConfig.num_draft_tokens"),
        (dict(spec_strategy="static_tree", spec_config={"paths": [(0, 1)]}), "prefix-closed"),
        (dict(spec_strategy="static_tree", spec_config={"paths": [(0,), (200,)]}), "StaticTreeConfig.paths"),
        (dict(spec_strategy="sage", spec_config={"alpha_source": "future"}), "alpha_source"),
        (dict(spec_strategy="sage", spec_config={"w_max": 500.0}), "SageConfig.w_max"),
        (dict(spec_strategy="sage", spec_config={"depth": 3}), "SageConfig has no field 'depth'"),
        (dict(spec_strategy="sage", cache_implementation="static"), "Static cache|DynamicCache"),
        (dict(spec_strategy="sage", output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    ],
)
def test_bad_requests_are_refused(pair, kwargs, message):
    target, drafter, inputs = pair
    with pytest.raises((ValueError, TypeError), match=message):
        target.generate(**inputs, max_new_tokens=4, assistant_model=drafter, **kwargs)


def test_missing_drafter_is_refused(pair):
    target, _, inputs = pair
    with pytest.raises(ValueError, match="needs a drafter"):
        target.generate(**inputs, max_new_tokens=4, spec_strategy="sage")


def test_flash_attention_is_refused(pair):
    target, drafter, inputs = pair
    text_config = target.config.get_text_config()
    saved = text_config._attn_implementation
    text_config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'.*sdpa"):
            target.generate(**inputs, max_new_tokens=4, assistant_model=drafter, spec_strategy="sage")
    finally:
        text_config._attn_implementation = saved


def test_vocabulary_mismatch_is_refused(pair):
    target, _, inputs = pair
    config = LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    other = LlamaForCausalLM(config).eval()
    with pytest.raises(ValueError, match="vocabulary|tokenizer"):
        target.generate(**inputs, max_new_tokens=4, assistant_model=other, spec_strategy="sage")


def test_qwen2_with_sliding_windows_is_exact(pair):
    _, _, inputs = pair
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen_config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                              sliding_window=4, max_window_layers=0)
    torch.manual_seed(0)
    target = Qwen2ForCausalLM(qwen_config).eval()
    drafter = LlamaForCausalLM(config).eval()
    assert inputs["attention_mask"].sum(-1).max() > 4  # the prompt is longer than the window
    expected = target.generate(**inputs, max_new_tokens=12, do_sample=False)
    out = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                          spec_strategy="sage")
    assert torch.equal(out, expected)


def test_recurrent_model_is_refused(pair):
    _, _, inputs = pair
    from transformers import MambaConfig, MambaForCausalLM

    target = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1)).eval()
    drafter = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1)).eval()
    with pytest.raises(ValueError, match="stateful|recurrent"):
        target.generate(input_ids=inputs["input_ids"], max_new_tokens=4, assistant_model=drafter,
                        spec_strategy="sage")


def test_streamer_with_batch_is_refused():
    target = build_model("llama")
    inputs = make_inputs("llama", batch_size=2)

    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(**inputs, max_new_tokens=4, assistant_model=build_drafter("llama", target, "small"),
                        spec_strategy="chain", streamer=Streamer())


def test_default_static_tree_is_prefix_closed():
    for size, depth in [(6, 5), (24, 6)]:
        paths = default_tree_paths(size, depth)
        assert len(paths) == size and max(len(p) for p in paths) <= depth
        assert all(p[:-1] in set(paths) for p in paths if len(p) > 1)
        assert paths[0] == (0,)


def test_quantized_drafter_keeps_output_exact(pair):
    target, drafter, inputs = pair
    original = {k: v.clone() for k, v in drafter.state_dict().items()}
    quantized = hf_adaptive_spec.quantize_drafter(drafter)
    assert all(torch.equal(original[k], v) for k, v in drafter.state_dict().items())  # the input is untouched
    expected = target.generate(**inputs, max_new_tokens=16, do_sample=False)
    out = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=quantized,
                          spec_strategy="sage")
    assert torch.equal(out, expected)


def test_cache_argument_follows_the_installed_transformers(pair):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache`; both releases of the pinned range work."""
    target, _, inputs = pair
    name = cache_argument(target)
    assert name in inspect.signature(target.forward).parameters

    class OldStyle(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_argument(OldStyle()) == "past_key_values"
    cache = DynamicCache(config=target.config)
    assert cache_from_kwargs({"past_key_values": cache}) is cache and cache_from_kwargs({"cache": cache}) is cache
    assert output_cache(target(**inputs, use_cache=True, **{name: cache})) is cache


def test_a_fresh_user_cache_is_accepted_and_runs_without_deprecation_warnings(pair):
    target, drafter, inputs = pair
    expected = target.generate(**inputs, max_new_tokens=8, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = target.generate(**inputs, max_new_tokens=8, do_sample=False, assistant_model=drafter,
                              spec_strategy="sage", **{cache_argument(target): DynamicCache(config=target.config)})
    assert torch.equal(out, expected)


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls that reach this library's decoding loop."""
    calls = []
    original = integration.speculative_decode

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(integration, "speculative_decode", counting)
    return calls


@pytest.fixture
def saved_sage(pair, monkeypatch):
    """The pair's target with `sage` (d_max=2) saved in a copy of its generation config."""
    target, drafter, inputs = pair
    generation_config = copy.deepcopy(target.generation_config)
    generation_config.spec_strategy = "sage"
    generation_config.spec_config = SageConfig(d_min=1, d_max=2, depth_cap=2)
    monkeypatch.setattr(target, "generation_config", generation_config)
    return target, drafter, inputs


def test_a_saved_strategy_runs_when_the_call_gives_a_drafter(saved_sage, spy):
    target, drafter, inputs = saved_sage
    expected = _stock_greedy(target, inputs)
    out = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert len(spy) == 1 and out.spec_stats.strategy == "sage" and max(out.spec_stats.accepted_lengths) <= 2


def test_a_saved_strategy_without_a_drafter_is_plain_generate(saved_sage, spy):
    target, _, inputs = saved_sage
    expected = _stock_greedy(target, inputs)
    assert torch.equal(target.generate(**inputs, max_new_tokens=12, do_sample=False), expected)
    assert torch.equal(target.generate(inputs["input_ids"], GenerationConfig(max_new_tokens=12, do_sample=False),
                                       attention_mask=inputs["attention_mask"]), expected)
    assert not spy


def test_spec_strategy_none_per_call_overrides_a_saved_strategy(saved_sage, spy):
    target, drafter, inputs = saved_sage
    expected = _stock_greedy(target, inputs)
    plain = target.generate(**inputs, max_new_tokens=12, do_sample=False, spec_strategy=None)
    assisted = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                               spec_strategy=None, return_dict_in_generate=True)
    assert torch.equal(plain, expected)
    assert torch.equal(assisted.sequences, expected) and not hasattr(assisted, "spec_stats")  # stock assisted
    assert not spy


def test_a_per_call_strategy_does_not_take_a_config_saved_for_another(saved_sage, spy):
    target, drafter, inputs = saved_sage
    out = target.generate(**inputs, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                          spec_strategy="chain", return_dict_in_generate=True)
    assert torch.equal(out.sequences, _stock_greedy(target, inputs))
    assert out.spec_stats.strategy == "chain" and len(spy) == 1
    assert target.generation_config.spec_config == SageConfig(d_min=1, d_max=2, depth_cap=2)  # untouched


def test_a_strategy_saved_with_the_model_round_trips(pair, tmp_path, spy):
    target, drafter, inputs = pair
    model = copy.deepcopy(target)
    model.generation_config.spec_strategy = "static_tree"
    model.generation_config.spec_config = StaticTreeConfig(paths=[(0,), (0, 0)])
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert loaded.generation_config.spec_strategy == "static_tree"
    assert StaticTreeConfig.from_dict(loaded.generation_config.spec_config) == StaticTreeConfig(paths=[(0,), (0, 0)])
    out = loaded.generate(**inputs, max_new_tokens=10, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, _stock_greedy(target, inputs, max_new_tokens=10))
    assert out.spec_stats.strategy == "static_tree" and out.spec_stats.drafted_tokens <= 2 * out.spec_stats.rounds
    assert len(spy) == 1


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(spec_strategy="sage", num_beams=2), "beam search"),
        (dict(spec_strategy="nope"), "valid strategies"),
        (dict(spec_strategy="static_tree", spec_config={"paths": [(0,), (200,)]}), "StaticTreeConfig.paths"),
        (dict(spec_strategy="sage", spec_config=ChainConfig()), "must be a SageConfig"),
    ],
)
@pytest.mark.parametrize("positional", [False, True])
def test_a_positional_generation_config_gets_the_same_checks(pair, spy, settings, message, positional):
    target, drafter, inputs = pair
    config = GenerationConfig(max_new_tokens=4, do_sample=False, **settings)
    with pytest.raises(ValueError, match=message):
        if positional:
            target.generate(inputs["input_ids"], config, assistant_model=drafter,
                            attention_mask=inputs["attention_mask"])
        else:
            target.generate(**inputs, generation_config=config, assistant_model=drafter)
    assert not spy


def test_a_positional_generation_config_and_drafter_run_speculation(pair, spy):
    target, drafter, inputs = pair
    config = GenerationConfig(max_new_tokens=10, do_sample=False, spec_strategy="chain")
    with pytest.raises(ValueError, match="needs a drafter"):  # the call names the strategy: no silent fallback
        target.generate(inputs["input_ids"], config, attention_mask=inputs["attention_mask"])
    # generate(inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn,
    #          synced_gpus, assistant_model, ...)
    out = target.generate(inputs["input_ids"], config, None, None, None, None, drafter,
                          attention_mask=inputs["attention_mask"])
    assert torch.equal(out, _stock_greedy(target, inputs, max_new_tokens=10))
    assert len(spy) == 1


def _stock_greedy(target, inputs, max_new_tokens=12):
    """Plain greedy `generate`, with the hook removed (so no saved strategy can apply)."""
    hf_adaptive_spec.uninstall()
    try:
        saved = {name: target.generation_config.__dict__.pop(name, None) for name in ("spec_strategy", "spec_config")}
        try:
            return target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        finally:
            target.generation_config.__dict__.update({k: v for k, v in saved.items() if v is not None})
    finally:
        hf_adaptive_spec.install()


def test_importing_the_package_imports_no_training_bench_or_asset_code():
    """`import hf_adaptive_spec` (the generate hook) loads the decoding code only (the training losses live in
    `hf_adaptive_spec.training.losses`)."""
    import ast
    import subprocess
    import sys

    code = "import sys, hf_adaptive_spec; print(sorted(m for m in sys.modules if m.startswith('hf_adaptive_spec.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    loaded = ast.literal_eval(out[-1])
    heavy = ("training", "bench", "cli", "loading", "registry", "scenes")
    assert "hf_adaptive_spec.decoding.loop" in loaded
    assert [m for m in loaded if m.split(".")[1] in heavy] == []
