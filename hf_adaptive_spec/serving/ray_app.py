"""The OpenAI-compatible server as Ray Serve replicas: N engines behind Ray Serve's HTTP proxy and router.

Each replica (`EngineReplica`) loads the models of a `ServedModel`, builds its own `Engine` (its own cost rule and
calibration) and serves the app `server.create_app` builds, through ``@serve.ingress``: the same routes, answers
and refusals as the single-process server (``hf-adaptive-spec serve``). Ray's router spreads requests over the
replicas; a replica whose engine thread has ended fails `check_health` and Ray replaces it; a replica that dies
(killed, or its process exits) is replaced too. `/health` adds the replica's name and how many replicas of the
deployment run against the target (``replicas``); every answer carries the replica's name (``x-replica``).

What a client sees when its replica dies is settled in the proxy, by `ReplicaFailureMiddleware`, which Ray's
proxy loads from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (`PROXY_CALLBACK`; `start_serve` sets it in the
controller's environment, which the proxies inherit; a config file sets it under ``controller_options``): a
request nothing was sent for yet is sent again (to a live replica), then answered 503 with an OpenAI error body;
a stream cut short ends with an error event and ``data: [DONE]``. Answers are never altered: a client gets the
tokens one replica generated, or an error.

Shutdown (SIGTERM / Ctrl-C to `run`, or the deployment deleted): Ray stops routing to the replicas and waits for
the requests in flight for up to ``graceful_shutdown_timeout_s`` (``--drain-timeout``) before the app's lifespan
stops the engine.

Entry points: `application` (a bound app for ``serve.run``), `build_app` (the builder for ``serve run
hf_adaptive_spec.serving.ray_app:build_app target=... replicas=2`` and config files), `run` (the command line).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading
from typing import Optional

import ray
from ray import serve
from starlette.middleware import Middleware

from .server import (API_KEY_ENV, MAX_BODY_BYTES, create_app, error_kind, error_response, sse_error,
                     warn_if_exposed)
from .served_model import ServedModel

logger = logging.getLogger(__name__)

__all__ = ["APP_NAME", "PROXY_CALLBACK", "EngineReplica", "ReplicaFailureMiddleware", "application", "build_app",
           "deployment_options", "proxy_middlewares", "run", "start_serve"]

APP_NAME = "hf_adaptive_spec"
REPLICA_HEADER = "x-replica"
RETRIED_HEADER = "x-retried"  # on an answer the proxy got after sending the request again: how many times
PROXY_CALLBACK = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "hf_adaptive_spec.serving.ray_app:proxy_middlewares"}
APP_ARGS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "num_cpus", "drain_timeout",
            "api_key")


class _ReplicaHeader:
    """ASGI middleware: every HTTP answer names the replica that gave it."""

    def __init__(self, app, replica: str):
        self.app = app
        self._header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self.app(scope, receive, named)


@serve.deployment(name="EngineReplica", health_check_period_s=5.0, health_check_timeout_s=60.0,
                  graceful_shutdown_wait_loop_s=0.5, max_constructor_retry_count=3)
@serve.ingress()
class EngineReplica:
    """One replica: the engine of `model` behind `create_app`'s routes (guarded by `api_key` when set).
    `wanted` says how many replicas the deployment targets (``{"target": N}`` or ``{"min": a, "max": b}``)."""

    def __init__(self, model: ServedModel, api_key: Optional[str] = None, wanted: Optional[dict] = None):
        # Ray lets a replica take at most max_batch + max_queue requests at once (`deployment_options`): the
        # engine holds them all, even when they arrive together (before a round admits any)
        model = dataclasses.replace(model, max_queue=model.max_batch + model.max_queue)
        context = serve.get_replica_context()
        self.replica_name = context.replica_id.to_full_id_str()  # the replica's actor name (namespace "serve")
        self._app_name, self._deployment = context.app_name, context.deployment
        self._wanted = dict(wanted or {})
        self.engine, processor = model.build()
        self.server_app = create_app(self.engine, processor, model.name, api_key=api_key,
                                     extra_stats=self.cluster, **model.app_options())
        self.server_app.add_middleware(_ReplicaHeader, replica=self.replica_name)

    def __serve_build_asgi_app__(self):
        return self.server_app

    def check_health(self) -> None:
        """Ray's health check: the engine's thread must run while the replica serves."""
        state = self.server_app.state.serving
        if state.engine_started and not state.draining and not self.engine.running:
            raise RuntimeError(f"replica {self.replica_name}: the engine's thread has ended")

    def cluster(self) -> dict:
        """This replica's name and the deployment's replicas by state (``running`` against the target)."""
        try:
            deployment = serve.status().applications[self._app_name].deployments[self._deployment]
        except Exception as error:  # the controller out of reach must not break /health
            return {"replica": self.replica_name, "replicas": {"error": f"{type(error).__name__}: {error}"}}
        states = {str(getattr(state, "value", state)): count for state, count in deployment.replica_states.items()}
        return {"replica": self.replica_name,
                "replicas": {"running": states.get("RUNNING", 0), **self._wanted, "states": states,
                             "status": str(getattr(deployment.status, "value", deployment.status))}}


class _Response:
    """What an inner app sent of its response; an error the proxy made itself (no replica's name on it, not
    JSON: backpressure, no replica, a timeout) is sent as an OpenAI error body with the same status. The answer
    to a request sent again (`retried` > 0) says so in `RETRIED_HEADER`."""

    def __init__(self, send, retried: int = 0):
        self._send = send
        self._retried = retried
        self.started = False
        self.complete = False
        self.event_stream = False
        self._proxy_error = None  # (status, Retry-After) of a proxy-made error, held while its text is read
        self._text = b""

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = {key.lower(): value for key, value in message.get("headers", ())}
            content_type = headers.get(b"content-type", b"")
            self.event_stream = content_type.startswith(b"text/event-stream")
            if (message["status"] >= 400 and REPLICA_HEADER.encode() not in headers
                    and not content_type.startswith(b"application/json")):
                self._proxy_error = (message["status"], headers.get(b"retry-after"))
                return
            if self._retried:
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (RETRIED_HEADER.encode(), str(self._retried).encode())]}
        elif message["type"] == "http.response.body":
            if self._proxy_error is not None:
                self._text += message.get("body", b"")
                if message.get("more_body", False):
                    return
                await self._send_proxy_error()
                self.complete = True
                return
            self.complete = not message.get("more_body", False)
        await self._send(message)

    async def _send_proxy_error(self) -> None:
        status, retry_after = self._proxy_error
        text = self._text.decode("utf-8", "replace").strip() or f"HTTP {status}"
        response = error_response(status, text, kind=error_kind(status),
                                  headers={"Retry-After": retry_after.decode()} if retry_after else None)
        await self._send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
        await self._send({"type": "http.response.body", "body": response.body, "more_body": False})


class _Request:
    """The client's side of one request: its body, kept to be sent again, and whether the client went away."""

    def __init__(self, receive, max_body_bytes: int):
        self._receive = receive
        self._max_body_bytes = max_body_bytes
        self.body: list = []  # the http.request messages read so far
        self.whole = False  # the body was read to its end (within the limit): it can be sent again
        self.gone = False

    async def read_body(self) -> None:
        size = 0
        while True:
            message = await self._receive()
            if message["type"] != "http.request":
                self.gone = message["type"] == "http.disconnect"
                self.body.append(message)
                return
            self.body.append(message)
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.whole = True
                return
            if size > self._max_body_bytes:  # too large to keep: the app reads the rest (and refuses it)
                return

    def replay(self):
        """A `receive` that gives the kept messages first, then the client's own."""
        pending = list(self.body)

        async def receive():
            if pending:
                return pending.pop(0)
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
            return message

        return receive


class ReplicaFailureMiddleware:
    """ASGI middleware for Ray Serve's HTTP proxy: how a request ends when the replica serving it dies, and
    OpenAI error bodies for the errors the proxy makes itself (`_Response`).

    Ray's proxy returns without an answer when a replica dies before answering, and stops mid-body when it dies
    mid-stream. Here a request nothing was sent for yet is sent again (its body kept, up to `max_body_bytes`) at
    most `retries` times, `retry_delay_s` x the try apart (the router has dropped the dead replica by then; the
    answer carries ``x-retried: <times>``), then answered 503 (``code: replica_unavailable``,
    ``Retry-After``); a server-sent event stream cut short ends with an error event (``code: replica_failed``)
    and ``data: [DONE]``; any other body cut short is left incomplete (the connection closes). Nothing is sent
    to a client that went away.
    """

    def __init__(self, app, retries: int = 2, retry_delay_s: float = 0.5, max_body_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = _Request(receive, self.max_body_bytes)
        await request.read_body()
        for attempt in range(self.retries + 1):
            response = _Response(send, retried=attempt)
            await self.app(scope, request.replay(), response.send)
            if response.complete or request.gone:
                return
            if response.started:
                if response.event_stream:
                    message = ("the replica serving this request stopped mid-answer; the answer above is "
                               "incomplete: send the request again")
                    await send({"type": "http.response.body", "more_body": False,
                                "body": (sse_error(message, code="replica_failed") + "data: [DONE]\n\n").encode()})
                return
            if not request.whole:
                break
            if attempt < self.retries:
                await asyncio.sleep(self.retry_delay_s * (attempt + 1))
        tries = f"{attempt + 1} {'try' if attempt == 0 else 'tries'}"
        unavailable = error_response(503, f"no replica could answer this request ({tries}: the replica serving it "
                                     "stopped before answering); retry later", kind="service_unavailable",
                                     code="replica_unavailable", headers={"Retry-After": "1"})
        await unavailable(scope, receive, send)


def proxy_middlewares() -> list:
    """The proxy's middlewares (`ReplicaFailureMiddleware`): what ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``
    names (`PROXY_CALLBACK`)."""
    return [Middleware(ReplicaFailureMiddleware)]


#: Serve's controller gives a proxy this long to answer its readiness and health checks (its defaults: 5 s and
#: 10 s) unless the environment says otherwise: the proxy imports this package, torch and transformers for the
#: middleware, and beside a CPU-heavy process its checks took longer than 5 s; the controller then killed
#: the proxy and started it again, over and over, and the serve command gave up (2026-12-07, AMD EPYC, 2 cores)
PROXY_CHECK_TIMEOUTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "120"}


def controller_env() -> dict:
    """The environment `start_serve` gives Serve's controller: `PROXY_CALLBACK`, and `PROXY_CHECK_TIMEOUTS` where
    this process's environment sets none."""
    timeouts = {name: os.environ.get(name, value) for name, value in PROXY_CHECK_TIMEOUTS.items()}
    return {**timeouts, **PROXY_CALLBACK}


def start_serve(host: str = "127.0.0.1", port: int = 8000):
    """``serve.start`` with the proxy on `host`:`port` and `ReplicaFailureMiddleware` in it (through the
    controller's environment, `controller_env`: with time for a slow proxy's checks). A cluster whose Serve
    runs already keeps its own settings.

    Serve waits 60 s for its proxy to be ready, then raises; on a busy machine the proxy's process (which
    imports this package, torch and transformers for the middleware) can take longer. The controller keeps
    starting it: the second call connects to that controller, and the proxy serves once it is up (probe
    ``/health``)."""
    options = {"http_options": {"host": host, "port": port},
               "controller_options": {"runtime_env": {"env_vars": controller_env()}}}
    try:
        return serve.start(**options)
    except TimeoutError as error:
        logger.warning("hf_adaptive_spec: Serve's proxy is slow to start (%s); it goes on starting", error)
        return serve.start(**options)


def deployment_options(model: ServedModel, replicas: int = 1, min_replicas: Optional[int] = None,
                       max_replicas: Optional[int] = None, target_ongoing_requests: Optional[float] = None,
                       num_cpus: float = 1.0, drain_timeout: float = 30.0) -> tuple[dict, dict]:
    """``(options for EngineReplica.options, the replicas wanted)``: `replicas` fixed, or Ray's autoscaling
    between `min_replicas` and `max_replicas` (either given; `replicas` the initial count) at
    `target_ongoing_requests` per replica (default: the engine's `max_batch`). A replica asks Ray for
    `num_cpus` CPUs and takes at most ``max_batch + max_queue`` requests at once (Ray's
    ``max_ongoing_requests``: the router sends a request to a replica with room). The router holds the requests
    not on a replica yet, those being placed included (a burst), up to the replicas' room (at most replicas)
    plus ``max_queue``, and refuses the next with 429 and ``Retry-After: 1`` (Ray's backpressure). Requests in
    flight may run on for `drain_timeout` seconds when a replica stops. Raises `ValueError` naming a bad
    value."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if num_cpus <= 0:
        raise ValueError(f"num_cpus must be > 0, got {num_cpus}")
    if drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0, got {drain_timeout}")
    room = model.max_batch + model.max_queue
    options = {"ray_actor_options": {"num_cpus": num_cpus}, "max_ongoing_requests": room,
               "backpressure_config": {"status_code": 429, "retry_after_s": 1},
               "graceful_shutdown_timeout_s": drain_timeout}
    if min_replicas is None and max_replicas is None:
        if target_ongoing_requests is not None:
            raise ValueError("target_ongoing_requests applies to autoscaling: give min_replicas or max_replicas")
        return ({**options, "num_replicas": replicas, "max_queued_requests": replicas * room + model.max_queue},
                {"target": replicas})
    low = 1 if min_replicas is None else min_replicas
    high = max(low, replicas) if max_replicas is None else max_replicas
    if low < 0 or high < 1 or low > high:
        raise ValueError(f"autoscaling needs 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                         f"min_replicas={low}, max_replicas={high}")
    target = model.max_batch if target_ongoing_requests is None else target_ongoing_requests
    if target <= 0:
        raise ValueError(f"target_ongoing_requests must be > 0, got {target}")
    autoscaling = {"min_replicas": low, "max_replicas": high, "initial_replicas": min(max(replicas, low), high),
                   "target_ongoing_requests": target}
    return ({**options, "autoscaling_config": autoscaling, "max_queued_requests": high * room + model.max_queue},
            {"min": low, "max": high})


def application(model: ServedModel, api_key: Optional[str] = None, **scaling):
    """The bound Ray Serve application (for ``serve.run``): `EngineReplica` of `model` with
    `deployment_options(model, **scaling)`, every route but /health guarded by `api_key` when set."""
    model.resolved_strategy()  # a strategy without its drafter fails here, not in every replica
    options, wanted = deployment_options(model, **scaling)
    return EngineReplica.options(**options).bind(model, api_key, wanted)


def build_app(args: dict):
    """The application builder for ``serve run hf_adaptive_spec.serving.ray_app:build_app key=value ...`` and
    config files (``import_path`` + ``args``): `ServedModel` fields (``target``, ``drafter``, ``strategy``,
    ``max_batch``, ...) and `deployment_options`' (``replicas``, ``min_replicas``, ``max_replicas``,
    ``target_ongoing_requests``, ``num_cpus``, ``drain_timeout``), ``api_key`` (default:
    ``$HF_ADAPTIVE_SPEC_API_KEY``). Values may be strings."""
    args = dict(args)
    app_args = {key: args.pop(key) for key in APP_ARGS if key in args}
    api_key = app_args.pop("api_key", None) or os.environ.get(API_KEY_ENV) or None
    scaling = {}
    for key, value in app_args.items():
        number = float if key in ("target_ongoing_requests", "num_cpus", "drain_timeout") else int
        try:
            scaling[key] = number(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={value!r} is not a number") from None
    return application(ServedModel.from_strings(args), api_key=api_key, **scaling)


@contextlib.contextmanager
def _stop_signals():
    """An event SIGTERM and SIGINT set while the block runs (the previous handlers restored afterwards)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(model: ServedModel, host: str = "127.0.0.1", port: int = 8000, ray_address: Optional[str] = None,
        api_key: Optional[str] = None, **scaling) -> int:
    """Serve `model` as Ray Serve replicas until SIGTERM / Ctrl-C (blocking); 0 after a clean shutdown.

    Joins the cluster at `ray_address` (``auto``, or the head's ``IP:6379``), else starts Ray on this machine;
    `start_serve(host, port)`; deploys `application(model, api_key, **scaling)` as ``APP_NAME`` at ``/``. At the
    signal (one during the deployment counts once it is done) the app is deleted (its replicas drain for up to
    `scaling`'s ``drain_timeout``); Ray started here stops too.
    """
    warn_if_exposed(host, api_key)
    app = application(model, api_key=api_key, **scaling)
    _, wanted = deployment_options(model, **scaling)
    ray.init(**({"address": ray_address} if ray_address else {"include_dashboard": False}))
    try:
        with _stop_signals() as stop:  # after ray.init, which sets its own handlers
            start_serve(host, port)
            serve.run(app, name=APP_NAME, route_prefix="/")
            replicas = (f"{wanted['target']} replica(s)" if "target" in wanted
                        else f"autoscaling between {wanted['min']} and {wanted['max']} replicas")
            print(f"serving {model.name} on http://{host}:{port}/v1 ({replicas})", flush=True)
            while not stop.wait(1.0):
                pass
            print("shutting down: requests in flight run on while the replicas drain", flush=True)
            serve.delete(APP_NAME)
            if ray_address is None:
                serve.shutdown()
    finally:
        ray.shutdown()
    return 0

