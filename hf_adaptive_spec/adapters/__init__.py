"""How the library runs a transformers model: what it can run exactly (`compat`), its text config and
vocabulary size (`model_config`), tree attention, the lean forward, sliding windows, split placement, the
target's recorded hidden states, and `ModelRunner` (one model, its cache and the tree blocks run against it)."""
