"""How a call's rounds run, apart from what its strategy verifies: `generate(..., spec_runtime=...)`.

None of these settings changes a token; they change how fast rounds run, and exist to compare or to work around
a platform. A strategy's config (`spec_config`) says what each round verifies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["RUNTIME_FIELDS", "RuntimeConfig", "resolve_runtime"]


@dataclass
class RuntimeConfig:
    """Runtime settings of a speculative call (`generate(..., spec_runtime=RuntimeConfig(...))`, or a dict of its
    fields).

    Args:
        cpu_kernels (`bool`, *optional*): the small-batch linear kernel for the rounds on a CPU
            (`ops.cpu_linear`): True requires it (an error where it cannot run), False turns it off; None (default)
            follows `HF_ADAPTIVE_SPEC_CPU_KERNELS` (`auto`: on where it runs).
        compact_weights (`bool`, *optional*): with the kernel, the drafter's linear layers (a LaSpec drafter's, or
            an independent float drafter's) read bf16 copies of their weights, made for the call (drafts only: the
            target decides every token; the copies take half the drafter's float32 weight memory while the call
            runs); None (default): on, unless `cpu_linear.use_compact_weights(False)` is in force.
        lean_forward (`bool`, *optional*): round forwards of supported models skip transformers' per-module Python
            (`adapters.lean`; bitwise the same logits); None (default): on, unless `lean.use_lean_forward(False)` is
            in force.
        host_trees (`bool`, defaults to True): a LaSpec block drafter at batch 1 (greedy, no processors) builds its
            tree with host lists (`trees.host`: the same tree).
        retire_rows (`bool`, defaults to True): at batch > 1, rows that finished leave the batch between rounds
            (their cache and state are dropped; the output is assembled as before), so the forwards of the rows
            still decoding no longer carry them. Not with logits processors that read a row's index in the batch.
    """

    cpu_kernels: bool | None = None
    compact_weights: bool | None = None
    lean_forward: bool | None = None
    host_trees: bool = True
    retire_rows: bool = True

    def __post_init__(self):
        for item in fields(self):
            value = getattr(self, item.name)
            allowed = (value is None and item.default is None) or isinstance(value, bool)
            if not allowed:
                requirement = "True, False or None" if item.default is None else "True or False"
                raise TypeError(f"RuntimeConfig.{item.name} must be {requirement}, got {value!r}.")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> RuntimeConfig:
        unknown = sorted(set(values) - set(RUNTIME_FIELDS))
        if unknown:
            raise TypeError(f"RuntimeConfig has no field {unknown[0]!r}; its fields: {', '.join(RUNTIME_FIELDS)}.")
        return cls(**values)


RUNTIME_FIELDS = tuple(item.name for item in fields(RuntimeConfig))


def resolve_runtime(value) -> RuntimeConfig:
    """`spec_runtime` as given (None, a dict of `RuntimeConfig` fields, or a `RuntimeConfig`), checked."""
    if value is None:
        return RuntimeConfig()
    if isinstance(value, RuntimeConfig):
        return value
    if isinstance(value, dict):
        return RuntimeConfig.from_dict(value)
    raise ValueError(f"spec_runtime must be a hf_adaptive_spec.RuntimeConfig (or a dict of its fields), got "
                     f"{type(value).__name__}.")
