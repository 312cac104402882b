"""Strategy configs: every field checked on construction, JSON round trips, and saving with a generation config."""

import json

import pytest
import torch
from transformers import GenerationConfig

from hf_adaptive_spec import ChainConfig, LaSpecConfig, RuntimeConfig, SageConfig, StaticTreeConfig
from hf_adaptive_spec.runtime import resolve_runtime

CPU = torch.device("cpu")

# (config class, field, a bad value, the error it raises): every field once with a wrong type, and once out of range
# where it has a range
BAD_VALUES = [
    (ChainConfig, "num_draft_tokens", "4", TypeError),
    (ChainConfig, "num_draft_tokens", 0, ValueError),
    (ChainConfig, "min_draft_tokens", 1.0, TypeError),
    (ChainConfig, "min_draft_tokens", 0, ValueError),
    (ChainConfig, "max_draft_tokens", True, TypeError),
    (ChainConfig, "max_draft_tokens", -1, ValueError),
    (ChainConfig, "adaptive", "yes", TypeError),
    (ChainConfig, "verify_cost", 1, TypeError),
    (StaticTreeConfig, "paths", "0", TypeError),
    (StaticTreeConfig, "paths", [], ValueError),
    (StaticTreeConfig, "paths", [(0,), ()], ValueError),
    (StaticTreeConfig, "paths", [(0,), (-1,)], ValueError),
    (StaticTreeConfig, "paths", [(0,), (0.5,)], TypeError),
    (StaticTreeConfig, "paths", [(0,), (True,)], TypeError),
    (StaticTreeConfig, "paths", [0, 1], TypeError),
    (StaticTreeConfig, "paths", [(0,), (0,)], ValueError),
    (StaticTreeConfig, "paths", [(0,), (1, 0)], ValueError),
    (SageConfig, "d_min", 2.0, TypeError),
    (SageConfig, "d_min", 0, ValueError),
    (SageConfig, "d_max", "8", TypeError),
    (SageConfig, "d_max", 0, ValueError),
    (SageConfig, "w_min", "1", TypeError),
    (SageConfig, "w_min", 0.5, ValueError),
    (SageConfig, "w_max", False, TypeError),
    (SageConfig, "w_max", 0, ValueError),
    (SageConfig, "n_max", 8.0, TypeError),
    (SageConfig, "n_max", 0, ValueError),
    (SageConfig, "top_k", 3.5, TypeError),
    (SageConfig, "top_k", 1, ValueError),
    (SageConfig, "top_k", None, TypeError),
    (SageConfig, "theta_scale", "0.1", TypeError),
    (SageConfig, "theta_scale", -1, ValueError),
    (SageConfig, "theta_scale", float("nan"), ValueError),
    (SageConfig, "expand_rule", 1, TypeError),
    (SageConfig, "expand_rule", "path", ValueError),
    (SageConfig, "alpha_init", None, TypeError),
    (SageConfig, "alpha_init", 1.5, ValueError),
    (SageConfig, "alpha_source", ("current_root",), TypeError),
    (SageConfig, "alpha_source", "future", ValueError),
    (SageConfig, "history_window", 10.0, TypeError),
    (SageConfig, "history_window", 0, ValueError),
    (SageConfig, "history_low", "2", TypeError),
    (SageConfig, "history_low", -1.0, ValueError),
    (SageConfig, "history_high", None, TypeError),
    (SageConfig, "history_high", -0.5, ValueError),
    (SageConfig, "depth_cap", 4.0, TypeError),
    (SageConfig, "depth_cap", -5, ValueError),
    (SageConfig, "adaptive_history", 0, TypeError),
    (SageConfig, "verify_cost", "no", TypeError),
    (SageConfig, "plan", "yes", TypeError),
    *[(config_class, name, value, error) for config_class in (ChainConfig, StaticTreeConfig, SageConfig)
      for name, value, error in (("visual_tokens", 2.0, TypeError), ("visual_tokens", -1, ValueError),
                                 ("visual_selection", None, TypeError), ("visual_selection", "always", ValueError))],
    (LaSpecConfig, "block_size", 4.0, TypeError),
    (LaSpecConfig, "block_size", 0, ValueError),
    (LaSpecConfig, "top_k", "2", TypeError),
    (LaSpecConfig, "top_k", 0, ValueError),
    (LaSpecConfig, "n_max", 1.5, TypeError),
    (LaSpecConfig, "n_max", 0, ValueError),
    (LaSpecConfig, "verify_cost", None, TypeError),
    (LaSpecConfig, "num_visual_tokens", 2.0, TypeError),
    (LaSpecConfig, "num_visual_tokens", -1, ValueError),
    (LaSpecConfig, "context_lookup", True, TypeError),
    (LaSpecConfig, "context_lookup", -1, ValueError),
    (LaSpecConfig, "lookup_tokens", "8", TypeError),
    (LaSpecConfig, "lookup_tokens", 0, ValueError),
    (LaSpecConfig, "datastore", 1, TypeError),
    (LaSpecConfig, "datastore_tokens", None, TypeError),
    (LaSpecConfig, "datastore_tokens", 0, ValueError),
]
# the runtime settings (`spec_runtime`), apart from the strategies' configs
BAD_VALUES += [(RuntimeConfig, name, value, TypeError)
               for name, value in (("cpu_kernels", "no"), ("compact_weights", 1), ("lean_forward", "yes"),
                                   ("host_trees", None), ("retire_rows", "yes"))]


@pytest.mark.parametrize("config_class, name, value, error", BAD_VALUES,
                         ids=[f"{c.__name__}.{n}={v!r}" for c, n, v, _ in BAD_VALUES])
def test_a_bad_value_is_refused_on_construction_naming_its_field(config_class, name, value, error):
    with pytest.raises(error, match=rf"{config_class.__name__}\.{name}\b"):
        config_class(**{name: value})


def test_every_field_has_a_bad_value_above():
    from dataclasses import fields

    covered = {(c, n) for c, n, _, _ in BAD_VALUES}
    for config_class in (ChainConfig, StaticTreeConfig, SageConfig, LaSpecConfig):
        for field in fields(config_class):
            assert (config_class, field.name) in covered


@pytest.mark.parametrize(
    "config_class, values, message",
    [
        (ChainConfig, dict(min_draft_tokens=5, num_draft_tokens=4), r"ChainConfig\.min_draft_tokens must be <= "),
        (ChainConfig, dict(num_draft_tokens=9, max_draft_tokens=8), r"ChainConfig\.num_draft_tokens must be <= "),
        (ChainConfig, dict(min_draft_tokens=9, max_draft_tokens=8), r"ChainConfig\.min_draft_tokens must be <= "),
        (SageConfig, dict(d_min=4, d_max=3), r"SageConfig\.d_min must be <= SageConfig\.d_max"),
        (SageConfig, dict(d_min=4, depth_cap=3), r"SageConfig\.d_min must be <= SageConfig\.depth_cap"),
        (SageConfig, dict(w_min=3, w_max=2.5), r"SageConfig\.w_min must be <= SageConfig\.w_max"),
        (SageConfig, dict(history_low=3.5), r"SageConfig\.history_low must be <= SageConfig\.history_high"),
    ],
)
def test_inverted_ranges_are_refused(config_class, values, message):
    with pytest.raises(ValueError, match=message):
        config_class(**values)


def test_a_range_broken_by_a_device_default_says_which_default():
    with pytest.raises(ValueError, match=r"ChainConfig\.num_draft_tokens.*max_draft_tokens=8: the cpu default"):
        ChainConfig(num_draft_tokens=10).resolve(CPU)
    with pytest.raises(ValueError, match=r"SageConfig\.d_min.*d_min=3: the cuda default"):
        SageConfig(d_max=2).resolve(torch.device("cuda"))


def test_valid_values_are_kept():
    sage = SageConfig(d_min=2, d_max=2, w_min=1, w_max=3, theta_scale=0, alpha_init=1, history_low=2, history_high=2)
    assert (sage.w_min, sage.w_max, sage.theta_scale, sage.alpha_init) == (1, 3, 0, 1)
    assert sage.resolve(CPU).depth_cap == 2
    assert ChainConfig(num_draft_tokens=3, min_draft_tokens=3, max_draft_tokens=3).resolve(CPU).num_draft_tokens == 3
    assert LaSpecConfig(num_visual_tokens=0, context_lookup=0, datastore=False).resolve(CPU).top_k == 2
    tree = StaticTreeConfig(paths=[[0, 1], [1], [0]])  # lists (as from JSON), any order
    assert tree.paths == [(0,), (1,), (0, 1)]


def test_numpy_numbers_become_plain_numbers():
    np = pytest.importorskip("numpy")
    sage = SageConfig(d_max=np.int64(6), w_max=np.float32(2.5), top_k=np.int32(4))
    assert type(sage.d_max) is int and type(sage.top_k) is int and type(sage.w_max) is float
    assert json.loads(json.dumps(sage.to_dict()))["d_max"] == 6
    assert StaticTreeConfig(paths=[(np.int64(0),)]).paths == [(0,)]


@pytest.mark.parametrize(
    "config, smallest_vocab, message",
    [
        (StaticTreeConfig(paths=[(0,), (5,)]), 6, r"StaticTreeConfig\.paths .*rank 5"),
        (SageConfig(w_max=11.0), 11, r"SageConfig\.w_max"),
        (LaSpecConfig(top_k=11), 11, r"LaSpecConfig\.top_k"),
    ],
)
def test_candidates_beyond_the_vocabulary_are_refused(config, smallest_vocab, message):
    resolved = config.resolve(CPU)
    resolved.check_vocab(smallest_vocab)
    with pytest.raises(ValueError, match=message):
        resolved.check_vocab(smallest_vocab - 1)


def test_sage_entropy_over_more_tokens_than_the_vocabulary_is_fine():
    SageConfig(top_k=12).resolve(CPU).check_vocab(8)  # Eq. 7's top-k entropy is taken over min(top_k, V)


CONFIGS = [
    ChainConfig(),
    ChainConfig(num_draft_tokens=3, min_draft_tokens=2, max_draft_tokens=5, adaptive=False, verify_cost=True),
    StaticTreeConfig(),
    StaticTreeConfig(paths=[(0,), (1,), (0, 0), (0, 1), (0, 0, 2)]),
    SageConfig(),
    SageConfig(d_min=1, d_max=12, w_min=1.5, w_max=4, n_max=30, top_k=5, theta_scale=0.2, expand_rule="cumulative",
               alpha_init=0.25, alpha_source="previous_root", history_window=4, history_low=1.0, history_high=2.5,
               depth_cap=14, adaptive_history=False, verify_cost=True),
    LaSpecConfig(),
    LaSpecConfig(block_size=4, top_k=3, n_max=10, verify_cost=False, num_visual_tokens=0, context_lookup=2,
                 lookup_tokens=5, datastore=False, datastore_tokens=3),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: type(c).__name__)
def test_to_dict_from_dict_round_trip_through_json(config):
    values = json.loads(json.dumps(config.to_dict()))
    again = type(config).from_dict(values)
    assert again == config
    assert again.to_dict() == config.to_dict()
    resolved = config.resolve(CPU)
    assert type(config).from_dict(json.loads(json.dumps(resolved.to_dict()))) == resolved


def test_static_tree_paths_come_back_as_tuples():
    values = json.loads(json.dumps(StaticTreeConfig(paths=[(0,), (0, 1), (0, 0)]).to_dict()))
    assert values == {"paths": [[0], [0, 0], [0, 1]], "visual_tokens": None, "visual_selection": "prefill"}
    assert StaticTreeConfig.from_dict(values).paths == [(0,), (0, 0), (0, 1)]


def test_from_dict_names_an_unknown_field():
    with pytest.raises(TypeError, match="SageConfig has no field 'depth'"):
        SageConfig.from_dict({"depth": 3})
    with pytest.raises(TypeError, match="needs a dict"):
        SageConfig.from_dict([("d_max", 3)])


@pytest.mark.parametrize("config", CONFIGS[1::2], ids=lambda c: type(c).__name__)
def test_a_generation_config_saves_and_loads_its_spec_config(tmp_path, config):
    from hf_adaptive_spec.strategies import STRATEGIES, resolve_config

    name = next(n for n, s in STRATEGIES.items() if s.config_class is type(config))
    generation_config = GenerationConfig(max_new_tokens=7, spec_strategy=name, spec_config=config)
    generation_config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["spec_strategy"] == name and saved["spec_config"] == config.to_dict()
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.spec_strategy == name and loaded.max_new_tokens == 7
    assert type(config).from_dict(loaded.spec_config) == config
    assert resolve_config(name, loaded.spec_config, CPU) == config.resolve(CPU)  # generate takes the dict as is


def test_runtime_settings_apply_to_their_call_only():
    """`cpu_kernels`, `lean_forward` (and `compact_weights`) of a `spec_runtime` hold inside the call's rounds and
    nowhere else; the output stays plain greedy."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from hf_adaptive_spec.adapters import lean
    from hf_adaptive_spec.ops import cpu_linear
    from tiny_models import build_drafter, build_model, make_inputs

    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    inputs = make_inputs("llama", batch_size=1)
    expected = target.generate(**inputs, max_new_tokens=10, do_sample=False)
    seen = []

    class Record(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append((cpu_linear.active(), lean.lean_forward(target) is not None))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def spec(**runtime):
        seen.clear()
        out = target.generate(**inputs, max_new_tokens=10, do_sample=False, assistant_model=drafter,
                              spec_strategy="sage", spec_runtime=RuntimeConfig(**runtime),
                              stopping_criteria=StoppingCriteriaList([Record()]))
        assert torch.equal(out, expected) and seen
        return seen

    assert all(not kernel and not lean_on for kernel, lean_on in spec(cpu_kernels=False, lean_forward=False,
                                                                      compact_weights=False))
    assert all(lean_on for _, lean_on in spec())  # the default: lean forwards where supported
    with lean.use_lean_forward(False):  # a field left None follows the caller's setting
        assert all(not lean_on for _, lean_on in spec())
        assert all(lean_on for _, lean_on in spec(lean_forward=True))
    assert lean.lean_forward(target) is not None and not cpu_linear.active()
    from dataclasses import fields

    runtime = {"cpu_kernels", "compact_weights", "lean_forward", "host_trees", "retire_rows"}
    for config_class in (ChainConfig, StaticTreeConfig, SageConfig, LaSpecConfig):  # what to verify only
        assert not runtime & {f.name for f in fields(config_class)}


def test_a_runtime_setting_in_spec_config_is_refused_naming_spec_runtime():
    from tiny_models import build_drafter, build_model, make_inputs

    with pytest.raises(TypeError, match=r"'retire_rows' is a runtime setting.*spec_runtime"):
        SageConfig.from_dict({"retire_rows": False})
    with pytest.raises(TypeError, match="RuntimeConfig has no field 'n_max'"):
        resolve_runtime({"n_max": 3})
    with pytest.raises(ValueError, match="spec_runtime must be"):
        resolve_runtime(3)
    assert resolve_runtime({"lean_forward": False}) == RuntimeConfig(lean_forward=False)
    target = build_model("llama")
    drafter = build_drafter("llama", target, "small")
    inputs = make_inputs("llama", batch_size=1)
    with pytest.raises(TypeError, match="spec_runtime"):
        target.generate(**inputs, max_new_tokens=4, assistant_model=drafter, spec_strategy="chain",
                        spec_config={"cpu_kernels": False})
    with pytest.raises(ValueError, match="spec_runtime must be"):
        target.generate(**inputs, max_new_tokens=4, assistant_model=drafter, spec_strategy="chain",
                        spec_runtime="fast")
    with pytest.raises(ValueError, match="spec_runtime sets how speculative rounds run"):
        target.generate(**inputs, max_new_tokens=4, spec_runtime={"lean_forward": False})
