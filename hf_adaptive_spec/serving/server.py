"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) around the continuous-batching `Engine`.

Endpoints:
- ``POST /v1/chat/completions``: chat completions, streamed (server-sent events) or not, text and image
  content (data URLs, for a model with an image processor).
- ``GET /v1/models``, ``GET /v1/models/{name}``: the one served model.
- ``GET /health``: 200 with the engine's and the server's counters (503 while shutting down);
  ``GET /v1/stats``: the same counters, always 200.

With an API key (`create_app(api_key=...)`; the command line's ``--api-key`` or ``$HF_ADAPTIVE_SPEC_API_KEY``)
every route but ``/health`` wants ``Authorization: Bearer <key>``, as OpenAI clients send it: 401 without it or
with another key (compared in constant time). `serve` warns when it listens beyond the loopback without a key.

Answers besides 200: 400 (OpenAI error body, ``invalid_request_error``) for malformed JSON or a request
`parse_chat_request` refuses, an unknown model name, or a prompt that does not fit the model's context; 401
without the API key (when one is set); 413 for a body over the limit or an image over its byte or pixel limit;
429 when the engine's queue is full; 503 while the server shuts down. A client that disconnects gets its request
cancelled: its row leaves the batch at the next round boundary.

Shutdown (SIGTERM or Ctrl-C, through `serve`): the listening socket closes at once and new requests on open
connections get 503; requests in flight run on for up to `drain_timeout` seconds, then the engine stops and
those still running end with ``finish_reason: "cancelled"`` (not an OpenAI value: the server cut the answer
short); the process then exits with status 0.

The engine calls back on its own thread; the callbacks only hand the ids over to the event loop
(`loop.call_soon_threadsafe`), where they are decoded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import ipaddress
import json
import logging
import signal
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..adapters.compat import text_config, vocab_size
from ..chat_template import encode_chat, text_tokenizer
from . import API_KEY_ENV
from .chat import (MAX_IMAGE_PIXELS, ChatRequest, RequestError, SamplingDefaults, TextAssembler, error_body,
                   parse_chat_request)

__all__ = ["API_KEY_ENV", "ApiKeyMiddleware", "ServerState", "create_app", "error_kind", "error_response", "serve",
           "sse_error", "warn_if_exposed"]

logger = logging.getLogger("uvicorn.error")  # uvicorn configures it: shutdown notes go where its own do

DEFAULT_MAX_TOKENS = 512
MAX_BODY_BYTES = 32 * 1024 * 1024
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
OPEN_PATHS = ("/health",)  # routes an API key does not guard


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict] = None):
    """A JSON response with the OpenAI error body (`chat.error_body`)."""
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def sse_error(message: str, code: Optional[str] = None) -> str:
    """The server-sent event that ends a stream which cannot go on: ``data: {"error": ...}`` (then ``[DONE]``)."""
    return f"data: {json.dumps(error_body(message, 'server_error', code=code))}\n\n"


def _route_path(scope) -> str:
    """The request's path below the app's mount point (``root_path``, e.g. a Ray Serve route prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


class ApiKeyMiddleware:
    """ASGI middleware: 401 with an OpenAI error body (``code: invalid_api_key``) for every HTTP request but
    those to `open_paths` that does not carry ``Authorization: Bearer <api_key>``; the key is compared with
    `hmac.compare_digest`. Refusals are counted in `state` (``by_status``)."""

    def __init__(self, app, api_key: str, state: "ServerState", open_paths=OPEN_PATHS):
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a non-empty api_key")
        self.app = app
        self._key = api_key.encode()
        self._state = state
        self._open_paths = tuple(open_paths)

    def _refusal(self, scope) -> Optional[str]:
        """Why the request is refused, or None when it carries the key."""
        header = dict(scope.get("headers") or ()).get(b"authorization")
        if header is None:
            return "Missing API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            return "Incorrect API key provided"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _route_path(scope) not in self._open_paths:
            refusal = self._refusal(scope)
            if refusal is not None:
                self._state.by_status[401] += 1
                response = error_response(401, refusal, code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def warn_if_exposed(host: str, api_key: Optional[str]) -> None:
    """Warn (`UserWarning`) when `host` is reachable beyond this machine (not 127.x, ::1 or localhost) and no
    API key guards the server."""
    if api_key:
        return
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name
        loopback = host.lower() == "localhost"
    if not loopback:
        warnings.warn(f"serving on {host!r} without an API key: anyone who can reach this port can use the model; "
                      f"set --api-key or ${API_KEY_ENV}", UserWarning, stacklevel=2)


def error_kind(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status."""
    return {404: "not_found_error", 408: "timeout_error", 429: "rate_limit_error",
            503: "service_unavailable"}.get(status, "server_error" if status >= 500 else "invalid_request_error")


@dataclass
class _Prompt:
    input_ids: list  # token ids of the templated prompt (image placeholders expanded)
    model_inputs: Optional[dict]  # the processor's other outputs (pixel_values, ...), batch 1


class _Events:
    """What the engine reports for one request, handed from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: collections.deque = collections.deque()
        self._ready = asyncio.Event()

    def _put(self, item) -> None:
        self._items.append(item)
        self._ready.set()

    def _post(self, item) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the loop has closed (process exiting): nobody waits any more
            pass

    def on_tokens(self, token_ids) -> None:
        self._post(("tokens", list(token_ids)))

    def on_finish(self, reason: str, error: Optional[str] = None) -> None:
        self._post(("finish", reason, error))

    async def next(self, timeout: Optional[float] = None):
        """The next event, or None after `timeout` seconds without one."""
        while not self._items:
            self._ready.clear()
            if timeout is None:
                await self._ready.wait()
            else:
                try:
                    await asyncio.wait_for(self._ready.wait(), timeout)
                except asyncio.TimeoutError:
                    return None
        return self._items.popleft()


class ServerState:
    """Everything the endpoints share: the engine, the processor, limits, and counters."""

    def __init__(self, engine, processor, model_name: str, max_context: Optional[int] = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, sampling: Optional[SamplingDefaults] = None,
                 max_body_bytes: int = MAX_BODY_BYTES, manage_engine: bool = True,
                 max_image_pixels: int = MAX_IMAGE_PIXELS):
        self.engine = engine
        self.processor = processor
        self.tokenizer = text_tokenizer(processor)
        self.model_name = model_name
        # a processor with an image processor takes images; everything goes through the processor then
        self.accepts_images = getattr(processor, "image_processor", None) is not None
        if not getattr(processor, "chat_template", None) and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{model_name!r} has no chat template: /v1/chat/completions needs one")
        model = getattr(engine, "model", None)
        if max_context is None:
            max_context = getattr(text_config(model), "max_position_embeddings", None)
        self.max_context = max_context
        self.vocab_size = vocab_size(model)
        if sampling is None:
            sampling = SamplingDefaults.from_generation_config(getattr(model, "generation_config", None))
        self.sampling = sampling
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes
        self.max_image_pixels = max_image_pixels
        self.manage_engine = manage_engine
        self.created = int(time.time())
        self.draining = False
        self._stop_lock = threading.Lock()
        self._engine_stopped = False
        self.engine_started = not manage_engine  # an engine the app does not manage runs already
        self.active = 0  # requests submitted and not answered yet
        self.served = 0  # answers completed (any finish reason)
        self.completion_tokens = 0
        self.by_status: collections.Counter = collections.Counter()
        self.finish_reasons: collections.Counter = collections.Counter()

    # --- engine life --------------------------------------------------------------------------------------
    def stop_engine(self) -> None:
        """Stop the engine once (blocking: joins its thread); running requests end as cancelled."""
        with self._stop_lock:
            if self._engine_stopped:
                return
            self._engine_stopped = True
        self.draining = True
        if self.engine_started:
            self.engine.stop()

    def stats(self) -> dict:
        try:
            engine_stats = self.engine.stats()
        except Exception as error:  # the counters must never break /health
            engine_stats = {"error": f"{type(error).__name__}: {error}"}
        return {
            "model": self.model_name,
            "status": "draining" if self.draining else "ok",
            "engine": engine_stats,
            "server": {"active": self.active, "served": self.served, "completion_tokens": self.completion_tokens,
                       "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
                       "finish_reasons": dict(self.finish_reasons)},
        }

    # --- requests -----------------------------------------------------------------------------------------
    def encode(self, chat: ChatRequest) -> _Prompt:
        """The templated prompt's ids, and for a processor the other model inputs (runs in a worker thread)."""
        if not self.accepts_images:
            return _Prompt(encode_chat(self.processor, chat.messages)["input_ids"][0].tolist(), None)
        encoded = encode_chat(self.processor, chat.messages, chat.images)
        extra = {key: value for key, value in encoded.items() if key not in ("input_ids", "attention_mask")}
        return _Prompt(encoded["input_ids"][0].tolist(), extra or None)

    def max_new_tokens(self, requested: Optional[int], prompt_tokens: int) -> int:
        """The request's own limit, or the server default cut to what the context leaves; 400 when the prompt
        (plus an explicit limit) does not fit."""
        if self.max_context is None:
            return requested if requested is not None else self.default_max_tokens
        room = self.max_context - prompt_tokens
        if room < 1:
            raise RequestError(f"This model's maximum context length is {self.max_context} tokens; the prompt "
                               f"has {prompt_tokens} tokens", param="messages", code="context_length_exceeded")
        if requested is None:
            return min(self.default_max_tokens, room)
        if requested > room:
            raise RequestError(f"This model's maximum context length is {self.max_context} tokens; the prompt "
                               f"has {prompt_tokens} tokens and max_tokens asks for {requested} more",
                               param="max_tokens", code="context_length_exceeded")
        return requested

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _chunk(completion_id: str, created: int, model: str, delta: dict, finish_reason: Optional[str] = None) -> str:
    payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Generation:
    """One submitted request: its engine handle, its events and the text assembled so far."""

    def __init__(self, state: ServerState, handle, events: _Events, chat: ChatRequest, prompt: _Prompt):
        self.state = state
        self.handle = handle
        self.events = events
        self.chat = chat
        self.prompt_tokens = len(prompt.input_ids)
        self.text = TextAssembler(state.decode, chat.stop)
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self._closed = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    async def deltas(self, timeout: Optional[float] = None):
        """Text deltas as rounds arrive ("" on a timeout: the caller checks its client); ends when the answer
        does (`finish_reason` or `error` set)."""
        while not self.done:
            event = await self.events.next(timeout)
            if event is None:
                yield ""
                continue
            if event[0] == "tokens":
                delta = self.text.feed(event[1])
                if self.text.stopped:  # a stop string: the answer is complete, the row can go
                    self.handle.cancel()
                    self.finish_reason = "stop"
                if delta:
                    yield delta
                continue
            _, reason, error = event
            if reason == "error":
                self.error = error or "the engine failed on this request"
                return
            self.finish_reason = reason
            tail = self.text.flush()
            if tail:
                yield tail

    def close(self, status: int = 200) -> None:
        """Account for the request once; cancel it in the engine if it is still running (client gone)."""
        if self._closed:
            return
        self._closed = True
        if not self.done:
            self.handle.cancel()
            self.finish_reason = "disconnected"
        state = self.state
        state.active -= 1
        state.served += 1
        state.completion_tokens += self.text.num_tokens
        state.by_status[status] += 1
        state.finish_reasons[self.finish_reason or "error"] += 1

    def usage(self) -> dict:
        completion = self.text.num_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


async def _read_json(request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise RequestError(f"the request body is larger than {limit} bytes", status=413)
    body = bytearray()
    async for piece in request.stream():
        body.extend(piece)
        if len(body) > limit:
            raise RequestError(f"the request body is larger than {limit} bytes", status=413)
    if not body:
        raise RequestError("the request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}")


class _EngineStream(StreamingResponse):
    """Server-sent events of one generation; whatever ends the response (the answer, the client gone, the task
    cancelled) closes the generation, so a request never outlives its client in the batch."""

    def __init__(self, generation: _Generation, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close(200)


class _Routes:
    """The app's route handlers over one `ServerState` (`create_app` registers them)."""

    def __init__(self, state: ServerState, extra_stats: Optional[Callable[[], dict]] = None):
        self.state = state
        self.extra_stats = extra_stats

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        state = self.state
        if state.manage_engine:
            state.engine.start()
            state.engine_started = True
        try:
            yield
        finally:
            state.draining = True
            if state.manage_engine:
                await run_in_threadpool(state.stop_engine)

    # --- errors, counters and the model list ---------------------------------------------------------------
    async def http_error(self, request, exc):
        return error_response(exc.status_code, str(exc.detail), kind=error_kind(exc.status_code))

    async def validation_error(self, request, exc):  # pragma: no cover - the endpoints parse bodies themselves
        return error_response(400, str(exc))

    def refuse(self, status: int, message: str, kind: Optional[str] = None, param: Optional[str] = None,
               code: Optional[str] = None, headers: Optional[dict] = None):
        """`error_response` (its type from the status unless `kind` is given), counted in ``by_status``."""
        self.state.by_status[status] += 1
        return error_response(status, message, kind or error_kind(status), param, code, headers)

    async def all_stats(self) -> dict:
        stats = self.state.stats()
        if self.extra_stats is not None:
            stats.update(await run_in_threadpool(self.extra_stats))
        return stats

    async def health(self):
        return JSONResponse(await self.all_stats(), status_code=503 if self.state.draining else 200)

    async def stats(self):
        return await self.all_stats()

    def model_card(self) -> dict:
        return {"id": self.state.model_name, "object": "model", "created": self.state.created,
                "owned_by": "hf_adaptive_spec"}

    async def models(self):
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, name: str):
        if name != self.state.model_name:
            return error_response(404, f"The model {name!r} does not exist", kind="not_found_error", param="model",
                                  code="model_not_found")
        return self.model_card()

    # --- chat completions ----------------------------------------------------------------------------------
    async def chat_completions(self, request: Request):
        state = self.state
        if state.draining:
            return self.refuse(503, "the server is shutting down")
        try:
            chat, prompt, max_new_tokens = await self.read_request(request)
        except RequestError as error:
            return self.refuse(error.status, error.message, error.kind, error.param, error.code)
        from .engine import EngineStopped, QueueFull, Request as EngineRequest

        engine_request = EngineRequest(
            input_ids=prompt.input_ids, max_new_tokens=max_new_tokens, stop_token_ids=chat.stop_token_ids,
            temperature=chat.temperature, top_p=chat.top_p, top_k=chat.top_k, seed=chat.seed,
            model_inputs=prompt.model_inputs,
        )
        events = _Events(asyncio.get_running_loop())
        try:
            handle = state.engine.submit(engine_request, on_tokens=events.on_tokens, on_finish=events.on_finish)
        except QueueFull:
            return self.refuse(429, "the server's queue is full; retry later", headers={"Retry-After": "1"})
        except EngineStopped:
            return self.refuse(503, "the server is shutting down")
        except ValueError as error:
            return self.refuse(400, str(error))
        state.active += 1
        generation = _Generation(state, handle, events, chat, prompt)
        if chat.stream:
            return _EngineStream(generation, self.stream_events(generation))
        return await self.complete(request, generation)

    async def read_request(self, request: Request) -> tuple:
        """`(ChatRequest, _Prompt, max new tokens)` of a request; `RequestError` for one the server refuses."""
        state = self.state
        body = await _read_json(request, state.max_body_bytes)
        chat = parse_chat_request(body, state.model_name, accepts_images=state.accepts_images,
                                  defaults=state.sampling, vocab_size=state.vocab_size,
                                  max_image_pixels=state.max_image_pixels)
        try:
            prompt = await run_in_threadpool(state.encode, chat)
        except (ValueError, TypeError, jinja2.TemplateError) as error:  # the template or processor refused
            raise RequestError(f"the messages cannot be turned into a prompt: {type(error).__name__}: {error}",
                               param="messages")
        return chat, prompt, state.max_new_tokens(chat.max_tokens, len(prompt.input_ids))

    async def stream_events(self, generation: _Generation):
        model_name = self.state.model_name

        def chunk(delta, finish_reason=None):
            return _chunk(generation.id, generation.created, model_name, delta, finish_reason)

        yield chunk({"role": "assistant", "content": ""})
        async for delta in generation.deltas():
            yield chunk({"content": delta})
        if generation.error is not None:
            yield sse_error(generation.error)
        else:
            yield chunk({}, generation.finish_reason)
            if generation.chat.include_usage:
                payload = {"id": generation.id, "object": "chat.completion.chunk", "created": generation.created,
                           "model": model_name, "choices": [], "usage": generation.usage()}
                yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"

    async def complete(self, request: Request, generation: _Generation):
        status = 200
        try:
            parts = []
            loop = asyncio.get_running_loop()
            checked = loop.time()
            async for delta in generation.deltas(timeout=DISCONNECT_POLL_S):
                parts.append(delta)
                if loop.time() - checked >= DISCONNECT_POLL_S:  # between rounds, or after a quiet poll
                    checked = loop.time()
                    if await request.is_disconnected():
                        status = 499  # the client closed the request; close() cancels it
                        return error_response(499, "the client disconnected")
            if generation.error is not None:
                status = 500
                return error_response(500, generation.error, kind="server_error")
            return {
                "id": generation.id, "object": "chat.completion", "created": generation.created,
                "model": self.state.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                             "logprobs": None, "finish_reason": generation.finish_reason}],
                "usage": generation.usage(),
            }
        finally:
            generation.close(status)


def create_app(engine, processor_or_tokenizer, model_name: str, *, max_context: Optional[int] = None,
               default_max_tokens: int = DEFAULT_MAX_TOKENS, sampling: Optional[SamplingDefaults] = None,
               manage_engine: bool = True, max_body_bytes: int = MAX_BODY_BYTES,
               max_image_pixels: int = MAX_IMAGE_PIXELS, api_key: Optional[str] = None,
               extra_stats: Optional[Callable[[], dict]] = None):
    """A FastAPI app serving `engine` under `model_name`, OpenAI style.

    Args:
        engine: a `serving.engine.Engine` (not started: the app's lifespan starts it, and stops it at shutdown,
            unless `manage_engine=False`).
        processor_or_tokenizer: the target's tokenizer, or its processor (a processor with an image processor
            makes the server accept images); its chat template builds the prompt.
        model_name: the name clients send as `model` (and `/v1/models` lists).
        max_context: prompt + new tokens limit (default: the model's ``max_position_embeddings``).
        default_max_tokens: new tokens for a request that sets no limit (cut to the context left).
        sampling: defaults for requests that leave sampling fields out (default: the model's generation
            config; greedy when it does not sample).
        manage_engine: start and stop the engine with the app.
        max_body_bytes: larger bodies get 413.
        max_image_pixels: larger decoded images get 413.
        api_key: when set, every route but ``/health`` wants ``Authorization: Bearer <api_key>`` (else 401).
        extra_stats: called (in a worker thread) for more entries of ``/health`` and ``/v1/stats`` (e.g. a Ray
            Serve replica's name and how many replicas of the deployment run).

    Returns:
        The app; ``app.state.serving`` is its `ServerState`.
    """
    state = ServerState(engine, processor_or_tokenizer, model_name, max_context=max_context,
                        default_max_tokens=default_max_tokens, sampling=sampling,
                        max_body_bytes=max_body_bytes, manage_engine=manage_engine,
                        max_image_pixels=max_image_pixels)
    routes = _Routes(state, extra_stats)
    app = FastAPI(title="hf_adaptive_spec", lifespan=routes.lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.serving = state
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, state=state)
    app.add_exception_handler(StarletteHTTPException, routes.http_error)
    app.add_exception_handler(RequestValidationError, routes.validation_error)
    app.get("/health")(routes.health)
    app.get("/v1/stats")(routes.stats)
    app.get("/v1/models")(routes.models)
    app.get("/v1/models/{name:path}")(routes.model)
    app.post("/v1/chat/completions")(routes.chat_completions)
    return app


def _uvicorn_server(app, host: str, port: int, drain_timeout: float, log_level: str):
    """A uvicorn server that, on SIGTERM / Ctrl-C, refuses new requests at once and stops the engine after
    `drain_timeout` seconds (requests still running then end as cancelled), before uvicorn's own wait ends."""
    import uvicorn

    state: ServerState = app.state.serving

    class _DrainingServer(uvicorn.Server):
        drain_timer: Optional[threading.Timer] = None

        def handle_exit(self, sig, frame):
            if self.drain_timer is None:
                state.draining = True
                logger.info("shutting down: requests in flight may run on for up to %.0fs", drain_timeout)
                self.drain_timer = threading.Timer(drain_timeout, state.stop_engine)
                self.drain_timer.daemon = True
                self.drain_timer.start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout + 30.0)
    return _DrainingServer(config)


def serve(engine, processor_or_tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          drain_timeout: float = 30.0, log_level: str = "info", **app_options) -> int:
    """Serve `engine` over HTTP until SIGTERM / Ctrl-C (blocking); 0 after a clean shutdown.

    Args:
        engine, processor_or_tokenizer, model_name: as `create_app` (other `create_app` options as keywords,
            `api_key` among them).
        host, port: where to listen (default localhost only; `warn_if_exposed` warns beyond it without a key).
        drain_timeout: seconds requests in flight may run on after a shutdown signal.
        log_level: uvicorn's log level.
    """
    warn_if_exposed(host, app_options.get("api_key"))
    app = create_app(engine, processor_or_tokenizer, model_name, **app_options)
    server = _uvicorn_server(app, host, port, drain_timeout, log_level)
    # uvicorn raises a signal it shut down for again once it is done (so a default handler would end the process
    # by that signal): while serving, SIGTERM / SIGINT only ask the server to exit, and the status is 0.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: setattr(server, "should_exit", True))
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if server.drain_timer is not None:
            server.drain_timer.cancel()
        app.state.serving.stop_engine()  # the lifespan did unless startup failed
    return 0
