"""Where the package keeps what it makes on disk (converted models, measured cost curves, data), read by the
decoding core and the registry alike."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_CACHE", "default_cache_root"]

ENV_CACHE = "HF_ADAPTIVE_SPEC_CACHE"


def default_cache_root() -> Path:
    """``$HF_ADAPTIVE_SPEC_CACHE`` if set, else ``~/.cache/hf_adaptive_spec/models``."""
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hf_adaptive_spec" / "models"
