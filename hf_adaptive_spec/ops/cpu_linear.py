"""A small-batch linear kernel for CPUs: what a tree verification forward spends its time in.

A verification forward runs a few tokens through every linear layer of the target. On CPUs, MKL's sgemm
packs the weight panel on each such call, so 4 tokens cost about 1.5x and 8 tokens about 2x what one token
costs although the same weights are streamed (SmolLM2-135M, fp32, 2 cores: linear layers 26 ms for one
row, 45 ms for 4, 58 ms for 8). `csrc/small_linear.cpp` reads every weight row once (AVX-512 or AVX2, prefetched):
29 ms for 4 rows, 34 ms for 8. It changes no result beyond float rounding: each output is the same dot
product, summed in another order, and which tokens are accepted is still decided by the target's own
greedy choice (outputs are tested equal to plain `generate`).

Use:
- `linear(x, weight, bias)`: the kernel for fp32 CPU inputs with 2..`max_rows()` rows (24 with AVX-512, 12
  with AVX2) while `enabled()`, else `torch.nn.functional.linear`. One row (a plain decoding step) always
  goes to torch, so root-only rounds run exactly what plain decoding runs.
- `fast_linears(*models, compact=())`: a context in which those models' `nn.Linear` layers call `linear` (the
  speculative loop wraps its rounds in it; the prefill stays stock).
- Compact drafter weights: a drafter only proposes tokens (the target decides each one), and a drafter
  forward on a CPU is bound by reading its weights. The layers of the models passed as `compact` (the loop
  passes the drafter: a LaSpec one, or an independent one) read a bf16 copy of each fp32 weight, widened to fp32 in registers, for 1..
  `max_rows()` rows: half the bytes. A weight that is exactly a bf16 value (a drafter loaded from a bf16
  checkpoint) gives bitwise the fp32 kernel's result; others (the LaSpec draft head: rows of the target's
  LM head) are rounded to bf16 for drafting only. `use_compact_weights(False)` reads the fp32 weights.
- Control: `HF_ADAPTIVE_SPEC_CPU_KERNELS=0` (off), `auto` (default: on where torch runs AVX-512 or AVX2
  kernels and the kernel builds), `1` (required: an error if it cannot be used); `use_cpu_kernels(False)`.

The kernel is compiled on first use with `torch.utils.cpp_extension` (a C++ compiler and ninja; ~40 s
once, cached under `$HF_ADAPTIVE_SPEC_KERNEL_CACHE` or `~/.cache/hf_adaptive_spec/kernels`). If that fails
under `auto`, one warning is issued and torch's linear is used: results are the same, only slower.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import scoped, tensor_version

__all__ = ["linear", "fast_linears", "active", "enabled", "available", "use_cpu_kernels", "use_compact_weights", "single_row_kernel",
           "compact_linear", "MIN_ROWS", "max_rows"]

MIN_ROWS = 2  # one row is a plain decoding step: torch's gemv, exactly as plain generate (`single_row_kernel`)
# most rows per call, by build (SmolLM2's shapes, 2 cores): AVX-512 24 rows 56 vs 77 ms with MKL, 32 rows 78 vs
# 65; the AVX2 build (run on the same CPU, against MKL's AVX-512 path) 8 rows 64 vs 93 ms, 16 rows 105 vs 103
_MAX_ROWS = {"avx512": 24, "avx2": 12}
logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("csrc") / "small_linear.cpp"
_ISA_FLAGS = {"avx512": ["-mavx512f", "-mfma"], "avx2": ["-mavx2", "-mfma"]}  # by torch's CPU capability
_FLAGS = ["-O3", "-fopenmp"]
_MODES = ("auto", "0", "1")
_MODE = contextvars.ContextVar("hf_adaptive_spec_cpu_kernels", default=None)
_ACTIVE = contextvars.ContextVar("hf_adaptive_spec_cpu_kernels_active", default=False)  # in a fast_linears block
# ids of the models whose layers run the kernel in this context (inside its `fast_linears` blocks)
_ACTIVE_MODELS = contextvars.ContextVar("hf_adaptive_spec_cpu_kernels_models", default=frozenset())
_COMPACT = contextvars.ContextVar("hf_adaptive_spec_cpu_compact_weights", default=True)
_COMPACT_MODELS = contextvars.ContextVar("hf_adaptive_spec_cpu_compact_models", default=frozenset())
_COMPACT_KEY = "bf16_weight"  # where a holder dict keeps its bf16 copy
# the bf16 copies of the compact layers of this context's `fast_linears` block: id(layer) -> holder dict; made
# on first use inside the block and dropped with it, never stored on the layers
_COMPACT_COPIES = contextvars.ContextVar("hf_adaptive_spec_cpu_compact_copies", default=None)
# fewest rows a routed layer runs on the kernel (1: single-row steps too, for the drafter-less plain mode)
_MIN_ROWS = contextvars.ContextVar("hf_adaptive_spec_cpu_kernel_min_rows", default=None)


def _mode() -> str:
    mode = _MODE.get()
    if mode is None:
        mode = os.environ.get("HF_ADAPTIVE_SPEC_CPU_KERNELS", "auto").strip().lower() or "auto"
        mode = {"on": "1", "true": "1", "off": "0", "false": "0"}.get(mode, mode)
    if mode not in _MODES:
        raise ValueError(f"HF_ADAPTIVE_SPEC_CPU_KERNELS={mode!r}; valid values: auto, 0, 1.")
    return mode


def use_cpu_kernels(on: bool | str):
    """Force the CPU kernels on (True: error if unavailable), off (False) or "auto" inside a `with` block."""
    mode = {True: "1", False: "0"}.get(on, on)
    if mode not in _MODES:
        raise ValueError(f"use_cpu_kernels takes True, False or 'auto', got {on!r}.")
    return scoped(_MODE, mode)


def single_row_kernel(on: bool = True):
    """Inside a `with` block, routed layers run one-row inputs on the kernel too (the `plain` strategy: every
    step is one row per sequence, and the kernel reads each weight row once where torch's one-row product is
    1.6-2.3x slower on 2 CPU cores). Outside it one row goes to torch, as plain decoding runs it."""
    if not isinstance(on, bool):
        raise ValueError(f"single_row_kernel takes True or False, got {on!r}.")
    return scoped(_MIN_ROWS, 1 if on else None)


def use_compact_weights(on: bool):
    """Inside a `with` block, let drafters' layers read bf16 copies of their weights (True, the default) or
    their fp32 weights (False). The output tokens are the same either way; only the drafts may differ."""
    if not isinstance(on, bool):
        raise ValueError(f"use_compact_weights takes True or False, got {on!r}.")
    return scoped(_COMPACT, on)


@functools.lru_cache(maxsize=None)
def _isa() -> str | None:
    """The kernel build for this CPU: "avx512", "avx2" or None (what torch's own CPU kernels use)."""
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability())


def _cpu_supported() -> str | None:
    """None when this CPU and torch build can run the kernel, else why not."""
    if _isa() is None:
        return (f"the CPU capability torch reports is {torch.backends.cpu.get_cpu_capability()}; "
                "the kernel needs AVX512 or AVX2")
    return None


def _location(isa: str) -> tuple[str, Path, list]:
    """(extension name, build folder, compiler flags) of the kernel for `isa` (per source and torch version)."""
    flags = _FLAGS + _ISA_FLAGS[isa]
    digest = hashlib.sha1((_SOURCE.read_text() + " ".join(flags) + torch.__version__).encode()).hexdigest()[:12]
    root = os.environ.get("HF_ADAPTIVE_SPEC_KERNEL_CACHE") or Path.home() / ".cache" / "hf_adaptive_spec" / "kernels"
    name = f"hf_adaptive_spec_small_linear_{isa}_{digest}"
    return name, Path(root).expanduser() / name, flags


def is_built() -> bool:
    """Whether this CPU's kernel is compiled already (loading it then takes a moment, not a build)."""
    if _cpu_supported() is not None:
        return False
    name, build, _ = _location(_isa())
    return (build / f"{name}.so").exists()


@functools.lru_cache(maxsize=None)
def _build(isa: str):
    """The extension compiled for `isa` (once per machine, source and torch version), loaded.

    A library built already is imported as it is: torch's `load` would run ninja again, which rebuilds it
    whenever the source's path differs (another checkout of the package) and waits on a lock file that a
    build killed midway leaves behind, forever (beside a CPU-heavy process a serving replica's first request
    waited on one). A build runs in a folder of its own and moves the library into place when done, so no
    lock is shared and no half-built library is ever read."""
    from torch.utils.cpp_extension import load

    name, build, flags = _location(isa)
    library = build / f"{name}.so"
    if library.exists():
        return _import_library(name, library)
    logger.warning("hf_adaptive_spec: compiling the CPU small-batch linear kernel (%s) for the speculative "
                   "rounds (once per machine, ~40 s; HF_ADAPTIVE_SPEC_CPU_KERNELS=0 skips it)", isa)
    build.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}.build-", dir=build.parent))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cpp_extension's notes about compiler versions
            module = load(name=name, sources=[str(_SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                          build_directory=str(scratch), verbose=False)
        os.replace(scratch / f"{name}.so", library)  # atomic: other processes see all of it or none
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return module


def _import_library(name: str, path: Path):
    """The compiled extension at `path`, imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_BACKGROUND: dict[str, subprocess.Popen] = {}


def build_in_background() -> subprocess.Popen | None:
    """Start compiling this CPU's kernel in a separate process at the lowest priority (once per process), so no
    call waits for it: rounds use torch's linear until it is built. None when built already or unsupported."""
    if _cpu_supported() is not None or is_built():
        return None
    isa = _isa()
    process = _BACKGROUND.get(isa)
    if process is None or process.poll() not in (None, 0):
        code = f"from hf_adaptive_spec.ops import cpu_linear; cpu_linear._build({isa!r})"
        process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19))
        _BACKGROUND[isa] = process
        logger.warning("hf_adaptive_spec: compiling the CPU small-batch linear kernel in the background (once per "
                       "machine); speculative rounds use torch's linear until it is ready. "
                       "`hf_adaptive_spec.prepare()` builds it up front.")
    return process


def max_rows() -> int:
    """Most rows a call may have to run the kernel on this CPU (more go to torch)."""
    return _MAX_ROWS.get(_isa(), 0)


def _extension():
    """The compiled extension for this CPU; raises with the reason when there is none."""
    reason = _cpu_supported()
    if reason is not None:
        raise RuntimeError(reason)
    return _build(_isa())


@functools.lru_cache(maxsize=None)
def _load_error() -> str | None:
    try:
        _extension()
    except Exception as error:  # noqa: BLE001 - any build failure means "not available", with its reason
        return f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
    return None


def available() -> bool:
    """True when the kernel runs on this machine (builds it on first call)."""
    return _cpu_supported() is None and _load_error() is None


def enabled(wait: bool = False) -> bool:
    """Whether `fast_linears` will route layers to the kernel under the current setting.

    In "auto" mode a kernel not compiled yet is built in the background (`build_in_background`) and this says
    False until it is, unless `wait`; with `HF_ADAPTIVE_SPEC_CPU_KERNELS=1` (the kernel is required) it waits.
    """
    mode = _mode()
    if mode == "0":
        return False
    if mode == "auto" and not wait and _cpu_supported() is None and not is_built():
        build_in_background()
        return False
    if available():
        return True
    reason = _cpu_supported() or _load_error()
    if mode == "1":
        raise RuntimeError("The CPU small-batch kernel is required (HF_ADAPTIVE_SPEC_CPU_KERNELS=1 or "
                           f"use_cpu_kernels(True)) but cannot be used: {reason}")
    _warn_once(reason)
    return False


@functools.lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    if _cpu_supported() is None:  # a CPU without AVX2 is expected, not worth a warning
        warnings.warn(f"hf_adaptive_spec: the CPU small-batch linear kernel is unavailable ({reason}); tree "
                      "verification uses torch's linear (same results, slower).", stacklevel=3)


def active() -> bool:
    """True inside `fast_linears` with the kernel in use."""
    return _ACTIVE.get()


def kernel_calls() -> int:
    """How many calls have run the compiled kernel in this process (0 when it is not built)."""
    return _extension().kernel_calls() if _cpu_supported() is None and _load_error() is None else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; inside `fast_linears`, fp32 CPU inputs of 2..`max_rows()` rows without
    autograd go through the small-batch kernel (the checks and the fallback run in C++)."""
    if not _ACTIVE.get():
        return F.linear(x, weight, bias)
    return _extension().linear(x, weight, bias, MIN_ROWS, max_rows())


def _compact_copy(weight: torch.Tensor, holder: dict) -> torch.Tensor:
    """The bf16 copy of `weight` kept in `holder`, made again when the weight changed (storage or version)."""
    key = (weight.data_ptr(), tensor_version(weight), tuple(weight.shape))
    cached = holder.get(_COMPACT_KEY)
    if cached is None or cached[0] != key:
        cached = (key, weight.detach().to(torch.bfloat16).contiguous())
        holder[_COMPACT_KEY] = cached
    return cached[1]


def compact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, holder: dict,
                   owner: nn.Module) -> torch.Tensor:
    """`linear` for a weight of the drafter `owner` that is not an `nn.Linear` (the LaSpec draft head): inside
    `fast_linears(..., compact=[owner, ...])`, fp32 CPU inputs of 1..`max_rows()` rows read a bf16 copy of
    `weight` (kept in `holder`, a dict the caller owns); otherwise exactly `linear(x, weight, bias)`."""
    if (id(owner) not in _COMPACT_MODELS.get() or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or not weight.is_contiguous()):
        return linear(x, weight, bias)
    return _extension().linear(x, weight, bias, 1, max_rows(), _compact_copy(weight, holder))


def _routed_forward(module: nn.Linear, kernel_linear, most_rows: int, owner: int):
    """`module.forward` while some `fast_linears` block holds it: the compiled dispatcher (checks and fallback in
    C++) in a context inside such a block, for the layers of its models (a `compact` model's layers read their
    bf16 copy, held by the block, for 1..most_rows rows); `nn.Linear.forward` anywhere else, so another thread
    running the same model is bitwise stock."""

    def forward(input):
        if owner not in _ACTIVE_MODELS.get():
            return nn.Linear.forward(module, input)
        if owner in _COMPACT_MODELS.get():
            holder = _COMPACT_COPIES.get().setdefault(id(module), {})
            return kernel_linear(input, module.weight, module.bias, 1, most_rows, _compact_copy(module.weight, holder))
        return kernel_linear(input, module.weight, module.bias, _MIN_ROWS.get() or MIN_ROWS, most_rows)

    return forward


# id(nn.Linear) -> (the forward set on it, how many fast_linears blocks hold it)
_ROUTED: dict[int, list] = {}
_ROUTED_LOCK = threading.Lock()


@contextlib.contextmanager
def fast_linears(*models, compact=()):
    """Route the `nn.Linear` layers of `models` (fp32, on the CPU) to `linear` inside the block.

    The layers of the models in `compact` (drafters only: never a target) read bf16 copies of their weights
    for 1..`max_rows()` rows while `use_compact_weights` is on (see the module docstring). Layers whose `forward` is already replaced on the instance (accelerate's offload hooks, another wrapper)
    and subclasses of `nn.Linear` (quantized or adapter layers) are left alone. Does nothing when
    `enabled()` is False. The layers are routed for as long as some block (of any thread) holds them, but only
    calls made inside a block, in its own context, reach the kernel: another thread running the same model
    meanwhile runs `nn.Linear.forward`, bitwise stock.
    """
    if not enabled():
        yield False
        return
    kernel_linear, most_rows = _extension().linear, max_rows()
    compact_ids = {id(model) for model in compact if model is not None} if _COMPACT.get() else set()
    owners = {id(model) for model in (*models, *compact) if model is not None}
    held = []
    try:
        with _ROUTED_LOCK:
            for model in (*models, *compact):
                if model is None:
                    continue
                for module in model.modules():
                    if type(module) is not nn.Linear:
                        continue
                    routed = _ROUTED.get(id(module))
                    if routed is not None:  # already routed by a block of this or another thread
                        routed[1] += 1
                        held.append(module)
                        continue
                    weight = module.weight
                    if "forward" in module.__dict__ or weight.device.type != "cpu" or weight.dtype != torch.float32:
                        continue
                    module.forward = _routed_forward(module, kernel_linear, most_rows, id(model))
                    _ROUTED[id(module)] = [module.forward, 1]
                    held.append(module)
        tokens = (_ACTIVE.set(True), _ACTIVE_MODELS.set(_ACTIVE_MODELS.get() | frozenset(owners)),
                  _COMPACT_MODELS.set(frozenset(compact_ids)), _COMPACT_COPIES.set({}))
        try:
            yield True
        finally:
            for variable, token in zip((_ACTIVE, _ACTIVE_MODELS, _COMPACT_MODELS, _COMPACT_COPIES)[::-1],
                                       tokens[::-1]):
                variable.reset(token)
    finally:
        with _ROUTED_LOCK:
            for module in held:
                routed = _ROUTED[id(module)]
                routed[1] -= 1
                if routed[1] == 0:
                    del _ROUTED[id(module)]
                    if module.__dict__.get("forward") is routed[0]:
                        del module.__dict__["forward"]
