"""int8 weight quantization for a drafter on the CPU.

A drafter only proposes tokens; the target decides every one of them, so a
cheaper, slightly less accurate drafter never changes the output. On a CPU
a drafter forward is bound by reading its fp32 weights: int8 weights about
halve its cost (figures in CHANGELOG.md), which moves the break-even
point of speculation a long way. Never apply this to the
target.
"""

from __future__ import annotations

import warnings

import torch


def quantize_drafter(model: torch.nn.Module) -> torch.nn.Module:
    """Return a copy of `model` whose `nn.Linear` layers use dynamic int8 quantization (CPU only).

    Args:
        model: the drafter (`assistant_model`), on the CPU.

    Returns:
        A new module; `model` itself is left unchanged.

    Examples:
        >>> drafter = hf_adaptive_spec.quantize_drafter(drafter)  # doctest: +SKIP
        >>> target.generate(**inputs, assistant_model=drafter, spec_strategy="sage")  # doctest: +SKIP
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("quantize_drafter quantizes for the CPU; move the drafter to the CPU first.")
    quantize_dynamic = getattr(getattr(torch, "ao", None), "quantization", None)
    quantize_dynamic = getattr(quantize_dynamic, "quantize_dynamic", None)
    if quantize_dynamic is None:
        raise RuntimeError("This torch build has no torch.ao.quantization.quantize_dynamic; keep the fp32 drafter.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)  # "quantized tensor creation functions are deprecated"
        quantized = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=False)
    return quantized.eval()
