"""The decoding core: the `generate()` hook, the speculative loop and its rounds (acceptance, logits processors,
retired rows, the returned cache), and `prepare`."""
