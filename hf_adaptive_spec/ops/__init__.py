"""Hot per-round tensor helpers, each with a torch reference and (where written) a Triton kernel.

Dispatch: a Triton kernel runs when the inputs live on a CUDA device, triton
imports, and a kernel exists for that op; one CPU row (batch 1) of a tree op
runs its host version in `host.py` (same results, without the op overhead of
small tensors); everything else uses the torch reference in `reference.py`.
`triton` is imported lazily, so a CPU-only install without triton imports and
works. Tests force a backend with `use_backend("torch" | "triton")`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import warnings

import torch

from . import host, reference

__all__ = [
    "ancestor_matrix",
    "tree_attention_mask",
    "compact_kv_",
    "sage_confidence",
    "greedy_accept",
    "quantize_int8",
    "visual_scores",
    "visual_vote",
    "use_backend",
    "triton_available",
]

def tensor_version(tensor: torch.Tensor) -> int:
    """`tensor._version`, for keys of caches derived from a tensor; -1 for an inference tensor (made under
    `torch.inference_mode()`), which has no version counter and cannot change outside inference mode."""
    return -1 if tensor.is_inference() else tensor._version


_BACKEND = contextvars.ContextVar("hf_adaptive_spec_ops_backend", default="auto")
_BACKENDS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when the `triton` package can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _triton_module():
    from . import triton_kernels  # imports triton

    return triton_kernels


@contextlib.contextmanager
def scoped(variable: contextvars.ContextVar, value):
    """`variable` set to `value` inside a `with` block (the backend switches of this package)."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def use_backend(name: str):
    """Force the ops backend inside a `with` block: "auto" (default), "torch" or "triton"."""
    if name not in _BACKENDS:
        raise ValueError(f"Unknown ops backend {name!r}; valid backends: {', '.join(_BACKENDS)}.")
    return scoped(_BACKEND, name)


def _kernel_for(op_name: str, tensor: torch.Tensor | None):
    """The Triton kernel (or host version) to run for `op_name` on `tensor`, or None for the torch reference."""
    backend = _BACKEND.get()
    if backend == "torch" or tensor is None:
        return None
    if backend == "auto" and not (tensor.is_cuda and triton_available()):
        if op_name in host.__all__ and tensor.device.type == "cpu" and tensor.dim() >= 1 and tensor.shape[0] == 1:
            return getattr(host, op_name)  # one CPU row: walking the tree in Python is ~10x faster
        return None
    if not triton_available():
        raise RuntimeError("The triton ops backend was forced but `triton` is not installed.")
    try:
        module = _triton_module()
    except ImportError as error:  # triton is there but broken: results stay right on the reference path
        if backend == "triton":
            raise
        warnings.warn(f"triton failed to import ({error}); using the torch reference ops.", stacklevel=3)
        return None
    return getattr(module, op_name, None)


def _dispatch(op_name: str):
    reference_fn = getattr(reference, op_name)

    @functools.wraps(reference_fn)
    def dispatched(first, *args, **kwargs):
        probe = (first[0] if first else None) if isinstance(first, (list, tuple)) else first
        kernel = _kernel_for(op_name, probe)
        if kernel is None:
            out = kwargs.pop("out", None)  # the references allocate; honour a caller's buffer by copying
            result = reference_fn(first, *args, **kwargs)
            if out is not None:
                out.copy_(result[0] if isinstance(result, tuple) else result)
                return (out, *result[1:]) if isinstance(result, tuple) else out
            return result
        return kernel(first, *args, **kwargs)

    return dispatched


ancestor_matrix = _dispatch("ancestor_matrix")
tree_attention_mask = _dispatch("tree_attention_mask")
compact_kv_ = _dispatch("compact_kv_")
sage_confidence = _dispatch("sage_confidence")
greedy_accept = _dispatch("greedy_accept")
quantize_int8 = _dispatch("quantize_int8")
visual_scores = _dispatch("visual_scores")
visual_vote = _dispatch("visual_vote")
