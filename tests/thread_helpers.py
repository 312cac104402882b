"""Running test work in several threads: `run_threads(work, count)` starts `work(index)` in `count` threads,
joins them all and raises the first error any of them raised."""

from __future__ import annotations

import threading


def run_threads(work, count: int) -> None:
    errors = []

    def guarded(index):
        try:
            work(index)
        except BaseException as error:  # reported by the caller's thread below
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
