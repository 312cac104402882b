"""Models split across devices or processes: accelerate's hooks and transformers' tensor parallelism.

- accelerate (`from_pretrained(..., device_map=..., offload_folder=...)`, `cpu_offload`, `disk_offload`,
  `dispatch_model`): the model runs through its hooks, which bring offloaded weights in for each forward. The
  library's own fast paths leave hooked modules alone (`ops.cpu_linear.fast_linears` skips modules whose
  `forward` is replaced, `lean.lean_forward` refuses them), a LaSpec drafter calls a hooked or sharded LM head
  of the target as a module instead of reading its weight, and `execution_device` is where such a model
  computes while its weights rest on the meta device.
- tensor parallelism (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` under
  `torchrun`): every rank runs the same loop on the same inputs, and every target forward is a collective, so
  every rank must verify the same tree in the same round. Drafting and acceptance are deterministic functions
  of the drafter and of the target's outputs (replicated across ranks); the cost rule's choices (which nodes
  pay for their verification, how far to draft, when drafting pauses) follow each rank's own timings, so the
  loop does not apply it under tensor parallelism (`tensor_parallel`).
- refused up front (`check_placement`): pipeline parallelism, FSDP, and parameters sharded over more than one
  mesh dimension or over several meshes.
"""

from __future__ import annotations

import torch

__all__ = ["check_placement", "execution_device", "tensor_parallel", "tensor_parallel_group"]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _meshes(model) -> set:
    """The device meshes of `model`'s DTensor parameters (empty when none are sharded)."""
    if not _distributed():
        return set()
    from torch.distributed.tensor import DTensor

    return {parameter.device_mesh for parameter in model.parameters() if isinstance(parameter, DTensor)}


def _fsdp(model) -> bool:
    kinds = []
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        kinds = [FSDPModule, FullyShardedDataParallel]
    except ImportError:  # a torch build without them
        pass
    return any(isinstance(module, tuple(kinds)) for module in model.modules()) if kinds else False


def check_placement(model, role: str) -> None:
    """Raise `NotImplementedError` naming the problem when `model` is split in a way the loop cannot keep exact."""
    name = type(model).__name__
    if getattr(model, "_pp_stage", None) is not None:
        raise NotImplementedError(
            f"The {role} {name} is split into pipeline stages (pipeline parallelism): each rank holds some layers "
            "only, and tree rounds are not passed between stages. spec_strategy supports tensor parallelism "
            "(tp_plan) and accelerate's device_map / offloading."
        )
    if _distributed() and _fsdp(model):
        raise NotImplementedError(
            f"The {role} {name} is sharded with FSDP: its ranks decode different rows and would run different "
            "numbers of rounds through collective forwards. spec_strategy supports tensor parallelism (tp_plan)."
        )
    meshes = _meshes(model)
    if len(meshes) > 1 or any(mesh.ndim != 1 for mesh in meshes):
        shapes = sorted(str(dict(zip(mesh.mesh_dim_names or range(mesh.ndim), mesh.shape))) for mesh in meshes)
        raise NotImplementedError(
            f"The {role} {name} has parameters sharded over {', '.join(shapes)}: spec_strategy supports tensor "
            "parallelism over one mesh dimension (every rank decoding the same rows)."
        )


def tensor_parallel_group(model):
    """The process group over which `model`'s parameters are sharded (tensor parallelism), or None."""
    meshes = _meshes(model)
    if len(meshes) != 1:
        return None
    mesh = next(iter(meshes))
    return mesh.get_group() if mesh.ndim == 1 and mesh.size() > 1 else None


def execution_device(model, default: torch.device) -> torch.device:
    """Where `model` computes: `model.device`, or for a model whose weights rest on the meta device between
    forwards (accelerate's `cpu_offload` / `disk_offload`) the execution device of its first hook that names
    one, else `default`."""
    device = model.device
    if device.type != "meta":
        return device
    for module in model.modules():
        hooked = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if hooked is not None:
            return torch.device(hooked)
    return torch.device(default)


def tensor_parallel(*models) -> bool:
    """Whether any of `models` is sharded over a process group (transformers' tensor parallelism)."""
    return any(model is not None and tensor_parallel_group(model) is not None for model in models)
