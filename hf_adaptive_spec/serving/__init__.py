"""Serving: a continuous-batching engine whose step is one speculative round (requests join and leave between
rounds), an OpenAI-compatible HTTP server on it, and a bounded HTTP load generator (`http_load`).

The engine is importable without the server's dependencies (`fastapi`, `uvicorn`, `httpx`: the `serve` extra);
the Ray Serve replicas (`ray_app`) need Ray Serve (the `ray` extra).
"""

API_KEY_ENV = "HF_ADAPTIVE_SPEC_API_KEY"  # the API key the command line's serve and loadtest use by default
