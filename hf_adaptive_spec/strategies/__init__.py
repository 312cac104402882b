"""The strategy registry: one name, one strategy class and its config class."""

from __future__ import annotations

from .base import Strategy, StrategyConfig
from .chain import ChainConfig, ChainStrategy
from .laspec import LaSpecConfig, LaSpecStrategy
from .plain import PlainConfig, PlainStrategy
from .sage import SageConfig, SageStrategy
from .static_tree import StaticTreeConfig, StaticTreeStrategy, default_tree_paths

STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(strategy_class: type[Strategy]) -> type[Strategy]:
    """Add a strategy class under its `name`; a duplicate or empty name is an error."""
    name = strategy_class.name
    if not name:
        raise ValueError(f"{strategy_class.__name__} has no `name`.")
    if name in STRATEGIES and STRATEGIES[name] is not strategy_class:
        raise ValueError(f"A strategy named {name!r} is already registered ({STRATEGIES[name].__name__}).")
    STRATEGIES[name] = strategy_class
    return strategy_class


def get_strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ValueError(f"Unknown spec_strategy {name!r}; valid strategies: {', '.join(sorted(STRATEGIES))}.")
    return STRATEGIES[name]


def resolve_config(name: str, spec_config, device) -> StrategyConfig:
    """The strategy's config from `spec_config` (None, a dict of its fields such as `to_dict` gives, or the
    strategy's config object), resolved."""
    config_class = get_strategy_class(name).config_class
    if spec_config is None:
        spec_config = config_class()
    elif isinstance(spec_config, dict):
        spec_config = config_class.from_dict(spec_config)
    elif not isinstance(spec_config, config_class):
        raise ValueError(
            f"spec_config for spec_strategy={name!r} must be a {config_class.__name__} (or a dict of its fields), "
            f"got {type(spec_config).__name__}."
        )
    return spec_config.resolve(device)


for _cls in (ChainStrategy, StaticTreeStrategy, SageStrategy, LaSpecStrategy, PlainStrategy):
    register_strategy(_cls)

__all__ = [
    "STRATEGIES",
    "ChainConfig",
    "ChainStrategy",
    "LaSpecConfig",
    "LaSpecStrategy",
    "PlainConfig",
    "PlainStrategy",
    "SageConfig",
    "SageStrategy",
    "StaticTreeConfig",
    "StaticTreeStrategy",
    "Strategy",
    "StrategyConfig",
    "default_tree_paths",
    "get_strategy_class",
    "register_strategy",
    "resolve_config",
]
