"""What a server is built from: the target, its drafter, the strategy and the engine's limits, as one picklable
description (`ServedModel`). The single-process server (`hf-adaptive-spec serve`) and every Ray Serve replica
(`serving.ray_app`) build their engine from it the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Optional

from .chat import MAX_IMAGE_PIXELS

__all__ = ["ServedModel"]


@dataclass
class ServedModel:
    """A served model: how to load it and how its engine runs.

    Fields:
        target: registry name or local folder of the target; also the served name unless `served_model_name`.
        drafter: registry name, shipped LaSpec drafter or folder (None: strategy `plain`).
        strategy: None picks `plain` without a drafter, `laspec` for a LaSpec drafter, else `sage`.
        spec_config: the strategy's settings (a dict, as `generate` takes them).
        dtype, drafter_int8: how the models load (`loading.load_model`, `loading.load_assistant`).
        max_batch, max_queue: the engine's rows decoded together and requests waiting at most.
        threads: torch's intra-op threads (None: torch's default).
        prepare: compile the CPU kernel and measure the cost curve before serving.
        served_model_name: the name clients send (default: `target`).
        default_max_tokens: new tokens for a request that sets no limit.
        max_image_pixels: decoded images larger than this are refused (413).
    """

    target: str
    drafter: Optional[str] = None
    strategy: Optional[str] = None
    spec_config: Optional[dict] = None
    dtype: str = "float32"
    drafter_int8: bool = True
    max_batch: int = 8
    max_queue: int = 32
    threads: Optional[int] = None
    prepare: bool = False
    served_model_name: Optional[str] = None
    default_max_tokens: int = 512
    max_image_pixels: int = MAX_IMAGE_PIXELS

    @property
    def name(self) -> str:
        return self.served_model_name or self.target

    @classmethod
    def from_strings(cls, values: dict) -> "ServedModel":
        """A `ServedModel` from string values (``serve run module:builder key=value`` arguments, a config file's
        ``args``): numbers and booleans parsed, `spec_config` as JSON; values of the right type pass as they
        are. Raises `ValueError` naming an unknown key or a value that does not parse."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown served-model settings {', '.join(unknown)}; known: {', '.join(known)}")
        parsed = {}
        for key, value in values.items():
            if not isinstance(value, str) or key in ("target", "drafter", "strategy", "dtype", "served_model_name"):
                parsed[key] = value
                continue
            try:
                parsed[key] = _parse(key, value)
            except ValueError as error:
                raise ValueError(f"{key}={value!r}: {error}") from None
        return cls(**parsed)

    def resolved_strategy(self) -> str:
        """The strategy to serve with; raises `ValueError` when it and the drafter do not go together."""
        from ..strategies import get_strategy_class

        strategy = self.strategy
        if strategy is None:
            from ..loading import is_laspec

            strategy = "plain" if self.drafter is None else "laspec" if is_laspec(self.drafter) else "sage"
        drafts_nothing = get_strategy_class(strategy).drafts_nothing
        if drafts_nothing and self.drafter is not None:
            raise ValueError(f"--strategy {strategy} drafts nothing: leave --drafter out")
        if not drafts_nothing and self.drafter is None:
            raise ValueError(f"--strategy {strategy} needs --drafter")
        return strategy

    def build(self):
        """Load the models and build the engine (not started): ``(engine, processor_or_tokenizer)``."""
        import torch

        from ..loading import load_assistant, load_model
        from .engine import Engine

        if self.threads:
            torch.set_num_threads(self.threads)
        strategy = self.resolved_strategy()
        target, processor = load_model(self.target, self.dtype, option="--target")
        drafter = None if self.drafter is None else load_assistant(self.drafter, target, self.drafter_int8,
                                                                   self.dtype)
        if self.prepare:
            from ..decoding.prepare import prepare

            prepare(target, drafter, strategy, batch_sizes=sorted({1, self.max_batch}), spec_config=self.spec_config)
        engine = Engine(target, drafter, strategy=strategy, spec_config=self.spec_config, max_batch=self.max_batch,
                        max_queue=self.max_queue)
        return engine, processor

    def app_options(self) -> dict:
        """`server.create_app` keywords besides the engine, the processor and the name."""
        return {"default_max_tokens": self.default_max_tokens, "max_image_pixels": self.max_image_pixels}


def _parse(key: str, text: str):
    if key == "spec_config":
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("spec_config must be a JSON object")
        return value
    if key in ("drafter_int8", "prepare"):
        lowered = text.strip().lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError("expected true or false")
        return lowered in ("true", "1", "yes")
    if key == "threads" and text.strip().lower() in ("", "none"):
        return None
    return int(text)
