"""A continuous-batching engine whose step is one speculative round.

The engine drives the decoding loop through its step API only (`decoding.integration.open_run` and
`loop.Decoding`'s `prefill_result`, `step`, `join`, `leave`, `close`), with one `SpecRequest` resolved and checked
when the engine is built.

Requests wait in a bounded queue. Between rounds the engine admits as many as the batch has room for: each is
prefilled alone, exactly as `generate` prefills it (its own logits processors, stop ids and token limit), and its
rows join the running batch (the target's cache, the drafter's state, the strategy's per-row state, its random
generator, the cost rule's batch size). Each step then drafts, verifies and accepts for every row at once and
says what each row got; the new tokens go to each request's callback; finished and cancelled rows leave the batch,
and the cache drops the columns no row holds any more.

A sampled request draws from a generator of its own (seeded by `Request.seed`, else from the OS), never from
torch's global one: a seeded request gives the same tokens whatever else shares its batch. Greedy and sampled
requests run in two batches, each in a `contextvars` context of its own (the per-call settings a run enters --
CPU kernels, lean forward, the drafter's attachment -- never mix between them): the cost rule prices and trims
greedy rounds for the batch they run in, and a sampled row's tree must not depend on its neighbours.

    engine = Engine(model, drafter, strategy="laspec")
    engine.start()
    handle = engine.submit(Request(input_ids=ids, max_new_tokens=64), on_tokens=print)
    tokens = handle.result(timeout=60)
    engine.stop()

Strategy `plain` (no drafter) is plain continuous batching through the library's forward: speculation off.
"""

from __future__ import annotations

import collections
import contextvars
import threading
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..adapters.compat import vocab_size
from ..cost import SpecCalibration
from ..decoding.integration import open_run
from ..decoding.request import resolve_request

__all__ = ["Engine", "EngineStopped", "QueueFull", "Request", "RequestHandle"]


def _default_calibration() -> SpecCalibration:
    """An engine's own calibration: whether drafting pays at each batch size is kept across its batches
    (`keep_pauses`); the fixed curve `HF_ADAPTIVE_SPEC_COST_PROFILE` names, when set, as for `generate` calls."""
    return SpecCalibration.from_env(keep_pauses=True) or SpecCalibration(keep_pauses=True)


class QueueFull(RuntimeError):
    """The engine's waiting queue is full (a server answers 429)."""


class EngineStopped(RuntimeError):
    """The engine is not running or is shutting down (a server answers 503)."""


@dataclass
class Request:
    """One generation request.

    Fields:
        input_ids (list of `int` or `torch.LongTensor` of shape `(P,)` or `(1, P)`): the prompt's tokens (chat
            template applied).
        max_new_tokens (`int`): tokens to generate at most.
        stop_token_ids (tuple of `int`): tokens that end the request besides the model's EOS ids (included in the
            output, as `generate` includes its EOS).
        temperature (`float`): 0 for greedy decoding; > 0 samples at that temperature.
        top_p (`float`), top_k (`int`): nucleus and top-k filtering when sampling (1.0 / 0: off).
        seed (`int`, *optional*): seeds the request's own random generator when sampling: the same seed gives the
            same tokens, whatever else shares the batch (None: seeded from the OS).
        model_inputs (dict, *optional*): the processor's other outputs for this prompt (batch 1), e.g.
            `pixel_values` for an image request.
        request_id (`str`): an id for logs and callbacks.
    """

    input_ids: list | torch.Tensor
    max_new_tokens: int = 256
    stop_token_ids: tuple = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    model_inputs: dict | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0

    def prompt(self) -> torch.Tensor:
        """`(1, P)` prompt ids."""
        ids = torch.as_tensor(self.input_ids, dtype=torch.long)
        return ids.reshape(1, -1)

    def check(self, vocab_size: int | None) -> None:
        """Raise a `ValueError` naming the field of a request the engine cannot run."""
        ids = self.prompt()
        if ids.numel() == 0:
            raise ValueError("input_ids is empty: a request needs at least one prompt token.")
        if torch.as_tensor(self.input_ids).dim() > 2 or (torch.as_tensor(self.input_ids).dim() == 2
                                                          and torch.as_tensor(self.input_ids).shape[0] != 1):
            raise ValueError("input_ids must hold one prompt: shape (P,) or (1, P).")
        if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"input_ids holds a token outside the vocabulary [0, {vocab_size}).")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}.")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}.")
        if any(not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size)
               for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in the vocabulary, got {self.stop_token_ids!r}.")


class RequestHandle:
    """A submitted request: its tokens so far, how it ended, and `cancel`.

    `on_tokens(token_ids)` and `on_finish(reason, error)` run on the engine's thread (keep them short); `reason` is
    "stop" (an EOS or stop id), "length" (`max_new_tokens`), "cancelled" or "error" (`error`: the message).
    """

    def __init__(self, request: Request, on_tokens: Callable | None, on_finish: Callable | None):
        self.request = request
        self.request_id = request.request_id
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._on_tokens, self._on_finish = on_tokens, on_finish
        self._cancelled = threading.Event()
        self._done = threading.Event()

    def cancel(self) -> None:
        """Ask the engine to drop the request (thread-safe); its row leaves the batch at the next round's end."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until the request ends; its generated tokens. Raises `TimeoutError` past `timeout`, and
        `RuntimeError` if the engine failed on it."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s.")
        if self.finish_reason == "error":
            raise RuntimeError(f"request {self.request_id} failed: {self.error}")
        return list(self.tokens)

    def _emit(self, tokens: list[int]) -> None:
        if not tokens:
            return
        self.tokens.extend(tokens)
        if self._on_tokens is not None:
            self._on_tokens(tokens)

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self._done.is_set():
            return
        self.finish_reason, self.error = reason, error
        self._done.set()
        if self._on_finish is not None:
            self._on_finish(reason, error)


class _Batch:
    """A running batch: a `loop.Decoding` whose rows are requests, in a `contextvars` context of its own."""

    def __init__(self, context: contextvars.Context, run, handles: list):
        self.context, self.run, self.handles = context, run, handles


class Engine:
    """Continuous batching with speculative rounds.

    Args:
        model: the target (an HF causal LM or VLM; `import hf_adaptive_spec` installed the generate hook).
        drafter (*optional*): the drafter model (`assistant_model`); None for strategy `plain`.
        strategy (`str`): `plain`, `chain`, `static_tree`, `sage`, `laspec` or a registered one.
        spec_config (*optional*): the strategy's settings (a config object or a dict), as `generate` takes them.
        max_batch (`int`): rows decoded together at most; more requests wait.
        max_queue (`int`): requests waiting at most; `submit` raises `QueueFull` beyond.
        eos_token_id (`int` or list, *optional*): ids that end every request (default: the model's
            generation config).
        pad_token_id (`int`, *optional*): filler id (default: the model's, else the first EOS id).
        calibration ([`SpecCalibration`], *optional*): what the cost rule learns, kept across requests (default: a
            fresh one with `keep_pauses=True`: whether drafting pays at each batch size outlives the batches).
        spec_runtime (*optional*): how rounds run (`RuntimeConfig` or a dict of its fields), as `generate` takes it.
    """

    def __init__(self, model, drafter=None, strategy: str = "laspec", spec_config=None, max_batch: int = 8,
                 max_queue: int = 32, eos_token_id=None, pad_token_id: int | None = None,
                 calibration: SpecCalibration | None = None, spec_runtime=None):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch} and {max_queue}.")
        # what each round verifies and how it runs, resolved and checked once for every request
        self.spec = resolve_request(model, strategy, spec_config=spec_config, spec_runtime=spec_runtime,
                                    assistant_model=drafter, light_trace=True,
                                    calibration=calibration if calibration is not None else _default_calibration())
        if self.spec.config.independent_drafter_options().get("visual_selection") == "round":
            raise ValueError("spec_config visual_selection='round' re-picks a drafter's visual tokens from the rows' "
                             "own queries every round, which rows joining a running batch cannot share yet; serve "
                             "with visual_selection='prefill' (or without visual_tokens).")
        self.model, self.drafter, self.strategy = model, drafter, strategy
        self.calibration = self.spec.calibration
        self.max_batch, self.max_queue = max_batch, max_queue
        generation_config = model.generation_config
        eos = generation_config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        pad = generation_config.pad_token_id if pad_token_id is None else pad_token_id
        self.pad_token_id = int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        self.vocab_size = vocab_size(model)
        self._waiting: collections.deque = collections.deque()
        self._condition = threading.Condition()
        self._batches: dict[bool, _Batch | None] = {False: None, True: None}  # by do_sample
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counters = collections.Counter()
        self._verified_nodes = collections.Counter()  # draft nodes verified per row-round -> row-rounds

    # ---- the caller's side (any thread)

    def start(self) -> Engine:
        """Start the engine's thread (idempotent)."""
        with self._condition:
            if self._stopping:
                raise EngineStopped("the engine was stopped; build a new one.")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="hf-adaptive-spec-engine", daemon=True)
                self._thread.start()
        return self

    def submit(self, request: Request, on_tokens: Callable | None = None,
               on_finish: Callable | None = None) -> RequestHandle:
        """Queue `request`; returns its handle. Raises `ValueError` for a request the engine cannot run,
        `QueueFull` when `max_queue` requests wait, `EngineStopped` when the engine is not running."""
        request.check(self.vocab_size)
        handle = RequestHandle(request, on_tokens, on_finish)
        with self._condition:
            if self._stopping or self._thread is None:
                raise EngineStopped("the engine is not running.")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue}).")
            self._waiting.append(handle)
            self._counters["submitted"] += 1
            self._condition.notify()
        return handle

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop admitting; waiting and running requests end as "cancelled"; the thread ends (idempotent)."""
        with self._condition:
            self._stopping = True
            self._condition.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> dict:
        """What the engine is doing and has done: rows running, requests waiting, rounds, tokens, and the
        structures verified (`verified_nodes`: draft nodes per row-round -> row-rounds; 0 = a plain step)."""
        with self._condition:
            running = sum(len(b.handles) for b in self._batches.values() if b is not None)
            return {
                "strategy": self.strategy,
                "running": running,
                "waiting": len(self._waiting),
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
                "stopping": self._stopping,
                **{name: self._counters[name] for name in ("submitted", "finished", "cancelled", "errors", "rounds",
                                                           "row_rounds", "tokens", "prefills")},
                "verified_nodes": dict(sorted(self._verified_nodes.items())),
            }

    # ---- the engine's thread

    def _serve(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread
        try:
            while True:
                with self._condition:
                    while not self._stopping and not self._waiting and not self._has_rows():
                        self._condition.wait()
                    if self._stopping:
                        break
                self._admit()
                for do_sample in (False, True):
                    if self._batches[do_sample] is not None:
                        self._round(do_sample)
        finally:
            self._shutdown()

    def _has_rows(self) -> bool:
        return any(batch is not None for batch in self._batches.values())

    def _rows(self) -> int:
        return sum(len(batch.handles) for batch in self._batches.values() if batch is not None)

    def _admit(self) -> None:
        """Prefill waiting requests while the batch has room; their rows join the running batch of their mode."""
        while self._rows() < self.max_batch:
            with self._condition:
                if not self._waiting or self._stopping:
                    return
                handle = self._waiting.popleft()
            if handle.cancelled:
                self._end(handle, "cancelled")
                continue
            try:
                self._prefill(handle)
            except Exception as error:  # the request fails alone; the batch goes on
                self._fail([handle], error)

    def _generate_kwargs(self, request: Request) -> dict:
        prompt = request.prompt().to(self.model.device)
        extra = dict(request.model_inputs or {})
        extra.setdefault("attention_mask", torch.ones_like(prompt))
        kwargs = dict(input_ids=prompt, **extra, max_new_tokens=request.max_new_tokens,
                      eos_token_id=self.eos_token_ids + [t for t in request.stop_token_ids
                                                         if t not in self.eos_token_ids],
                      pad_token_id=self.pad_token_id, do_sample=request.do_sample)
        if request.do_sample:
            kwargs.update(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k)
        else:  # the model's saved sampling defaults do not apply to a greedy request
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs

    def _generator(self, request: Request) -> torch.Generator | None:
        """A sampled request's own random generator (greedy requests draw nothing)."""
        if not request.do_sample:
            return None
        generator = torch.Generator(device=self.model.device)
        if request.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.seed)
        return generator

    def _prefill(self, handle: RequestHandle) -> None:
        request = handle.request
        do_sample = request.do_sample
        batch = self._batches[do_sample]
        context = batch.context if batch is not None else contextvars.copy_context()
        spec = self.spec.for_call(generator=self._generator(request))
        run = context.run(open_run, self.model, spec, **self._generate_kwargs(request))
        self._counters["prefills"] += 1
        first = run.prefill_result
        handle._emit(first.new_tokens()[0])
        if first.done:  # the first token ended it (EOS, or max_new_tokens=1)
            context.run(run.close)
            self._end(handle, first.finish_reasons()[0])
            return
        if batch is None:
            with self._condition:
                self._batches[do_sample] = _Batch(context, run, [handle])
            return
        try:
            context.run(batch.run.join, run)
        finally:
            context.run(run.close)  # the batch's own scope holds what both entered
        with self._condition:
            batch.handles.append(handle)

    def _round(self, do_sample: bool) -> None:
        batch = self._batches[do_sample]
        try:
            result = batch.context.run(batch.run.step)
        except Exception as error:
            self._close(do_sample)
            self._fail(batch.handles, error)
            return
        self._counters["rounds"] += 1
        for handle, tokens in zip(batch.handles, result.new_tokens()):
            handle._emit(tokens)
            self._counters["tokens"] += len(tokens)
        decoding = result.decoding_rows()
        self._counters["row_rounds"] += len(decoding)
        self._verified_nodes.update(drafted for drafted, _ in decoding)
        reasons = result.finish_reasons()
        leaving = [row for row, handle in enumerate(batch.handles) if reasons[row] is not None or handle.cancelled]
        if not leaving:
            return
        for row in leaving:
            self._end(batch.handles[row], reasons[row] or "cancelled")
        staying = [row for row in range(len(batch.handles)) if row not in set(leaving)]
        if not staying:
            self._close(do_sample)
            return
        try:
            batch.context.run(batch.run.leave, leaving)
        except Exception as error:
            self._close(do_sample)
            self._fail([batch.handles[row] for row in staying], error)
            return
        with self._condition:
            batch.handles = [batch.handles[row] for row in staying]

    def _end(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        self._counters[{"cancelled": "cancelled", "error": "errors"}.get(reason, "finished")] += 1
        try:
            handle._finish(reason, error)
        except Exception:  # a failing callback must not stop the engine
            traceback.print_exc()

    def _fail(self, handles: list, error: Exception) -> None:
        message = f"{type(error).__name__}: {error}"
        for handle in handles:
            self._end(handle, "error", message)

    def _close(self, do_sample: bool) -> None:
        with self._condition:
            batch, self._batches[do_sample] = self._batches[do_sample], None
        if batch is not None:
            batch.context.run(batch.run.close)

    def _shutdown(self) -> None:
        """The thread's end: every request still here ends as "cancelled"."""
        with self._condition:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), collections.deque()
        for handle in waiting:
            self._end(handle, "cancelled")
        for do_sample in (False, True):
            batch = self._batches[do_sample]
            if batch is None:
                continue
            handles = list(batch.handles)
            try:
                self._close(do_sample)
            finally:
                for handle in handles:
                    self._end(handle, "cancelled")
