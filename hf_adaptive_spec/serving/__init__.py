"""Serving: a continuous-batching engine whose step is one speculative round (requests join and leave between
rounds), an OpenAI-compatible HTTP server on it, and a bounded HTTP load generator (`http_load`).

The engine is importable without the server's dependencies (`fastapi`, `uvicorn`, `httpx`: the `serve` extra).
"""
