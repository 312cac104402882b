"""The benchmark (`python -m hf_adaptive_spec.bench`, `hf-adaptive-spec bench`): the run over prompts and
methods, the batched modes (concurrency sweep, arrivals replay), load tests against the server, vision sweeps,
memory, cold starts, statistics, reports and the docs tables."""
