"""hf_adaptive_spec: exact tree speculative decoding inside HuggingFace `generate()`.

    import hf_adaptive_spec
    out = model.generate(**inputs, assistant_model=drafter, spec_strategy="sage")

Without `spec_strategy`, `generate` is stock transformers.
"""

from .drafters.quantize import quantize_drafter
from .integration import install, is_installed, uninstall
from .loop import SpecGenerateOutput, SpecStats
from .strategies import (
    STRATEGIES,
    ChainConfig,
    SageConfig,
    StaticTreeConfig,
    Strategy,
    StrategyConfig,
    register_strategy,
)

__version__ = "0.1.0"

install()

__all__ = [
    "STRATEGIES",
    "ChainConfig",
    "SageConfig",
    "SpecGenerateOutput",
    "SpecStats",
    "StaticTreeConfig",
    "Strategy",
    "StrategyConfig",
    "install",
    "quantize_drafter",
    "is_installed",
    "register_strategy",
    "uninstall",
]
