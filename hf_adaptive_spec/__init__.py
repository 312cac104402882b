"""hf_adaptive_spec: exact tree speculative decoding inside HuggingFace `generate()`.

    import hf_adaptive_spec
    out = model.generate(**inputs, assistant_model=drafter, spec_strategy="sage")

Without `spec_strategy`, `generate` is stock transformers.
"""

from .drafters.laspec import LaSpecDrafterConfig, LaSpecDrafterModel, LaSpecDrafterOutput, register_auto_classes
from .drafters.hub import list_drafters, load_drafter, push_drafter_to_hub
from .cost import CostProfile, SpecCalibration
from .drafters.datastore import TokenDatastore
from .drafters.quantize import quantize_drafter
from .decoding.integration import install, is_installed, uninstall
from .decoding.stats import SpecGenerateOutput, SpecStats
from .decoding.prepare import prepare
from .runtime import RuntimeConfig
from .drafters.vision import QueryCapture, VisualKeyStore, select_visual_tokens
from .strategies import (
    STRATEGIES,
    ChainConfig,
    LaSpecConfig,
    SageConfig,
    StaticTreeConfig,
    Strategy,
    StrategyConfig,
    register_strategy,
)

__version__ = "0.1.0"

install()
register_auto_classes()  # AutoConfig / AutoModel load "laspec_drafter" folders

__all__ = [
    "LaSpecDrafterConfig",
    "LaSpecDrafterModel",
    "LaSpecDrafterOutput",
    "QueryCapture",
    "RuntimeConfig",
    "VisualKeyStore",
    "register_auto_classes",
    "select_visual_tokens",
    "STRATEGIES",
    "ChainConfig",
    "LaSpecConfig",
    "SageConfig",
    "CostProfile",
    "SpecCalibration",
    "SpecGenerateOutput",
    "SpecStats",
    "StaticTreeConfig",
    "Strategy",
    "StrategyConfig",
    "TokenDatastore",
    "install",
    "list_drafters",
    "load_drafter",
    "push_drafter_to_hub",
    "quantize_drafter",
    "is_installed",
    "prepare",
    "register_strategy",
    "uninstall",
]
