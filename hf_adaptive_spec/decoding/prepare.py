"""`prepare(model, drafter)`: do ahead of time the one-off work a first speculative call skips.

A speculative `generate` never waits for one-off setup: on a CPU it starts from a prior cost curve that its own
rounds correct (`cost.prior_profile`, `cost.refine_profile`), and a CPU kernel not compiled yet is built in a
background process while torch's linear serves (`ops.cpu_linear.build_in_background`). `prepare` does both
in full instead, for those who want the first call at full speed: it waits for the kernel, then runs a short
speculative call per batch size inside `cost.measure_cost_curve`, so the verifier's cost curve is measured with
exactly the setting real calls use (kernels, lean forward, batch size, threads) and stored on disk.
"""

from __future__ import annotations

import time

import torch

from ..adapters.compat import vocab_size
from ..cost import measure_cost_curve
from ..drafters.laspec import LaSpecDrafterModel
from ..ops import cpu_linear
from ..strategies import get_strategy_class

__all__ = ["prepare"]


def _strategy_for(drafter, strategy: str | None) -> str:
    if strategy is None:
        return "laspec" if isinstance(drafter, LaSpecDrafterModel) else "sage"
    return "chain" if strategy == "static_tree" else strategy  # static trees are not priced: chain measures the curve


@torch.no_grad()
def prepare(model, assistant_model, spec_strategy: str | None = None, batch_sizes=(1,), prompt_length: int = 64,
            spec_config=None) -> dict:
    """Compile the CPU kernel and measure the verifier's cost curve for `model` at each batch size, now.

    Args:
        model: the target.
        assistant_model: the drafter the calls will use (the curve is measured inside a speculative call).
        spec_strategy (`str`, *optional*): the strategy the calls will use (default: "laspec" for a LaSpec
            drafter, else "sage"); a cost-aware setting of it is measured.
        batch_sizes (iterable of `int`): the batch sizes the calls will run (a curve per batch size).
        prompt_length (`int`): length of the synthetic prompt the measurement runs behind.
        spec_config: the strategy settings the calls will use (a cost-aware setting is forced).

    Returns:
        `dict` with `kernel` (whether the CPU kernel is in use), `seconds` (total) and `profiles` (one dict per
        batch size: batch size, the seconds the measurement took).
    """
    start = time.perf_counter()
    kernel = model.device.type == "cpu" and cpu_linear.enabled(wait=True)
    strategy = _strategy_for(assistant_model, spec_strategy)
    if get_strategy_class(strategy).drafts_nothing:  # `plain`: no cost rule, only the kernel to build
        return {"kernel": kernel, "seconds": time.perf_counter() - start, "profiles": []}
    config = dict(spec_config or {})
    if strategy in ("sage", "chain"):
        config["verify_cost"] = True
    vocab = vocab_size(model)
    generator = torch.Generator().manual_seed(0)
    profiles = []
    for batch_size in batch_sizes:
        input_ids = torch.randint(vocab // 2, vocab, (batch_size, prompt_length), generator=generator)
        input_ids = input_ids.to(model.device)
        with measure_cost_curve():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 assistant_model=assistant_model, spec_strategy=strategy, spec_config=config or None,
                                 max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        profiles.append({"batch_size": batch_size, "seconds": out.spec_stats.time_profile})
    return {"kernel": kernel, "seconds": time.perf_counter() - start, "profiles": profiles}
