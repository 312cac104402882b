"""A bounded load generator for an OpenAI-compatible chat server (`hf-adaptive-spec loadtest`).

N requests arrive at times drawn from a seeded generator; each is streamed, so the client sees its time to
first token as well as its end-to-end latency. The run stops by itself: after the last request, or when
`time_limit` seconds have passed (requests still open are closed then, and counted as ``timeout``; those
not yet sent as ``not_sent``). Only the given URL is contacted (``POST /v1/chat/completions``, and
``GET /health`` before and after for the server's counters), with ``Authorization: Bearer <api_key>`` when
given; proxy settings from the environment are ignored.

Arrivals (`hf_adaptive_spec.traffic`, drawn with `ARRIVAL_OPTIONS`: bursts of a fixed size, the first request
at time 0, the numbers from ``random.Random(seed)``):
- ``poisson``: exponential gaps of mean ``1 / rate``.
- ``bursty``: bursts of `burst_size` requests; burst starts have exponential gaps of mean
  ``burst_size / rate`` (the same mean rate), and requests within a burst are `burst_gap` seconds apart
  (default 0: a burst arrives at once).

The report (`run_load`) is a JSON-ready dict: the settings, request counts (``total = ok + failed + not_sent``,
failures by HTTP status or ``timeout`` / ``connection_error`` / ``stream_error``), latency (mean, p50, p90,
p99) and time to first token (mean, p50, p90) in seconds over the requests answered in full (`traffic.summary`;
percentiles by linear interpolation), throughput (completion tokens per second and answered requests per second
over the run's wall time), the server's ``/health`` before and after and the change of every counter in it
(e.g. the engine's rounds and the structures it verified), and one record per request (its times, status, token
counts, answer text, and behind Ray Serve the replica that answered and how many times the request was sent
again).
`markdown_table` puts reports side by side.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .. import traffic
from . import API_KEY_ENV

__all__ = ["ARRIVAL_OPTIONS", "DEFAULT_PROMPTS", "LoadSpec", "arrival_times", "load_prompts", "markdown_table",
           "run_load"]

DEFAULT_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences what a hash table is.",
    "Give three tips for writing clear commit messages.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn rain.",
    "Summarize the rules of tic-tac-toe.",
    "Write a SQL query that counts the orders per customer.",
    "Why is the sky blue? Answer briefly.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "List four common sorting algorithms and their average complexity.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What does the HTTP status code 429 mean?",
    "Write a short product description for a reusable water bottle.",
    "Explain recursion to a ten-year-old.",
    "Write a bash one-liner that counts the lines of all .py files in a folder.",
    "Name three differences between TCP and UDP.",
)

# the served load tests' traces: bursts of `burst_size` at once, the first request at time 0, `random.Random(seed)`
ARRIVAL_OPTIONS = traffic.ArrivalOptions(burst_sizes="fixed", first_arrival="at_zero", seeding="seed")


@dataclass
class LoadSpec:
    """The settings of one load run (see the module docstring for the arrival processes)."""

    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    rate: float = 2.0  # mean requests per second
    arrivals: str = "poisson"
    requests: int = 32
    seed: int = 0
    max_tokens: int = 64
    prompts: Sequence[str] = DEFAULT_PROMPTS
    burst_size: int = traffic.BURST_SIZE
    burst_gap: float = 0.0
    time_limit: float = 600.0  # seconds for the whole run
    temperature: float = 0.0
    model: Optional[str] = None  # default: the first model the server lists
    label: Optional[str] = None  # a name for the run in tables
    api_key: Optional[str] = field(default=None, repr=False)  # sent as "Authorization: Bearer"; not reported

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        traffic.check_arrivals(self.requests, self.rate, self.arrivals, self.burst_size, self.burst_gap)
        if not self.time_limit > 0:
            raise ValueError(f"time_limit must be positive, got {self.time_limit}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.prompts:
            raise ValueError("prompts must not be empty")


def arrival_times(count: int, rate: float, arrivals: str = "poisson", seed: int = 0,
                  burst_size: int = traffic.BURST_SIZE, burst_gap: float = 0.0) -> list:
    """`count` send times in seconds from the start (ascending, the first at 0): `traffic.arrival_times` with
    `ARRIVAL_OPTIONS`."""
    return traffic.arrival_times(count, rate, arrivals, seed, ARRIVAL_OPTIONS, burst_size, burst_gap)


def load_prompts(path) -> list:
    """Prompts from a file: a JSON array of strings (or of objects with a "prompt"), JSON lines of such
    objects or strings, or plain text with one prompt per non-empty line."""
    text = Path(path).read_text(encoding="utf-8")

    def prompt_of(item):
        if isinstance(item, str):
            return item
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            return item["prompt"]
        raise ValueError(f"{path}: each prompt must be a string or an object with a 'prompt' string")

    stripped = text.strip()
    if stripped.startswith("["):
        prompts = [prompt_of(item) for item in json.loads(stripped)]
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            prompts = [prompt_of(json.loads(line)) for line in lines]
        except json.JSONDecodeError:
            prompts = [line.strip() for line in lines]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


@dataclass
class _Record:
    index: int
    scheduled_s: float  # arrival time from the start of the run
    prompt: str
    sent_s: Optional[float] = None
    status: Optional[str] = None  # "200", another HTTP status, timeout, connection_error, stream_error, not_sent
    ttft_s: Optional[float] = None
    latency_s: Optional[float] = None
    end_s: Optional[float] = None
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    text: str = ""  # the answer as streamed
    error: Optional[str] = None
    replica: Optional[str] = None  # the Ray Serve replica that answered (its x-replica header)
    retried: int = 0  # how many times the Ray Serve proxy sent the request again (its x-retried header)
    done: bool = field(default=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "200" and self.done and self.error is None


async def _health(client, url: str) -> Optional[dict]:
    try:
        response = await client.get(url + "/health")
        return response.json()
    except Exception as error:  # the run goes on without the server's counters
        return {"unreachable": f"{type(error).__name__}: {error}"}


async def _model_name(client, url: str) -> Optional[str]:
    try:
        data = (await client.get(url + "/v1/models")).json()["data"]
        return data[0]["id"]
    except Exception:
        return None


def _stream_lines_error(obj) -> Optional[str]:
    error = obj.get("error")
    if error is None:
        return None
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)


async def _one(client, spec: LoadSpec, url: str, model: Optional[str], record: _Record, clock_zero: float,
               deadline: float) -> None:
    delay = clock_zero + record.scheduled_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if time.perf_counter() >= deadline:
        record.status = "not_sent"
        return
    body = {"messages": [{"role": "user", "content": record.prompt}], "max_tokens": spec.max_tokens,
            "temperature": spec.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    start = time.perf_counter()
    record.sent_s = start - clock_zero
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            record.status = str(response.status_code)
            record.replica = response.headers.get("x-replica")
            record.retried = int(response.headers.get("x-retried", 0))
            if response.status_code != 200:
                record.error = (await response.aread()).decode("utf-8", "replace")[:300]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    record.done = True
                    break
                obj = json.loads(data)
                message = _stream_lines_error(obj)
                if message is not None:
                    record.status, record.error = "stream_error", message
                    continue
                if obj.get("usage"):
                    record.prompt_tokens = obj["usage"].get("prompt_tokens")
                    record.completion_tokens = obj["usage"].get("completion_tokens")
                for choice in obj.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        record.text += content
                        if record.ttft_s is None:
                            record.ttft_s = time.perf_counter() - start
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
            if not record.done and record.error is None:
                record.status, record.error = "stream_error", "the stream ended without [DONE]"
    except asyncio.CancelledError:
        record.status, record.error = "timeout", f"open when the time limit ({spec.time_limit}s) ran out"
        raise
    except Exception as error:  # httpx errors, a broken stream, bad JSON in a line
        import httpx

        if isinstance(error, httpx.TimeoutException):
            record.status = "timeout"
        elif isinstance(error, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
            record.status = "connection_error"
        else:
            record.status = "stream_error"
        record.error = f"{type(error).__name__}: {error}"
    finally:
        now = time.perf_counter()
        record.end_s = now - clock_zero
        record.latency_s = now - start
        if record.ok and record.ttft_s is None:  # an empty answer: its first token came with the end
            record.ttft_s = record.latency_s


def _numeric_delta(before, after):
    """`after - before` for every number in `after` (nested dicts; a counter `before` lacks counts from 0)."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        out = {}
        for key in after:
            delta = _numeric_delta(before.get(key, {} if isinstance(after[key], dict) else 0), after[key])
            if delta is not None and delta != {}:
                out[key] = delta
        return out
    numbers = (int, float)
    if isinstance(before, numbers) and isinstance(after, numbers) and not isinstance(before, bool) \
            and not isinstance(after, bool):
        return after - before
    return None


async def run_load_async(spec: LoadSpec) -> dict:
    """`run_load` inside a running event loop."""
    import httpx

    spec.validate()
    url = spec.url.rstrip("/")
    times = arrival_times(spec.requests, spec.rate, spec.arrivals, spec.seed, spec.burst_size, spec.burst_gap)
    order = list(range(len(spec.prompts)))
    random.Random(spec.seed + 1).shuffle(order)
    records = [_Record(i, t, spec.prompts[order[i % len(order)]]) for i, t in enumerate(times)]
    limits = httpx.Limits(max_connections=spec.requests + 2, max_keepalive_connections=spec.requests + 2)
    timeout = httpx.Timeout(spec.time_limit, connect=min(10.0, spec.time_limit))
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else None
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, follow_redirects=False,
                                 headers=headers) as client:
        model = spec.model or await _model_name(client, url)
        before = await _health(client, url)
        clock_zero = time.perf_counter()
        deadline = clock_zero + spec.time_limit
        tasks = [asyncio.create_task(_one(client, spec, url, model, r, clock_zero, deadline)) for r in records]
        _, pending = await asyncio.wait(tasks, timeout=spec.time_limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - clock_zero
        after = await _health(client, url)
    for record in records:
        if record.status is None:  # cancelled while waiting for its arrival time
            record.status = "not_sent"
    return _report(spec, model, records, wall, before, after)


def _report(spec: LoadSpec, model, records: list, wall: float, before, after) -> dict:
    answered = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok and r.status != "not_sent"]
    errors: dict = {}
    for record in failed:
        key = record.status if record.status != "200" else "stream_error"
        errors[key] = errors.get(key, 0) + 1
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = max(ends) if ends else wall  # from the start to the last answer or failure
    completion = sum(r.completion_tokens or 0 for r in answered)
    settings = asdict(spec)
    settings["prompts"] = len(spec.prompts)
    settings["api_key"] = "set" if spec.api_key else None
    return {
        "label": spec.label,
        "settings": settings,
        "model": model,
        "requests": {"total": len(records), "ok": len(answered), "failed": len(failed),
                     "not_sent": sum(r.status == "not_sent" for r in records), "errors": errors},
        "duration_s": duration,
        "wall_s": wall,
        "latency_s": traffic.summary([r.latency_s for r in answered], (50, 90, 99)),
        "ttft_s": traffic.summary([r.ttft_s for r in answered], (50, 90)),
        "completion_tokens": completion,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in answered),
        "throughput_tok_s": completion / duration if duration > 0 else None,
        "requests_per_s": len(answered) / duration if duration > 0 else None,
        "finish_reasons": _count(r.finish_reason for r in answered),
        "server": {"before": before, "after": after, "delta": _numeric_delta(before or {}, after or {})},
        "per_request": [{k: v for k, v in asdict(r).items() if k != "done"} for r in records],
    }


def _count(items) -> dict:
    out: dict = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out


def run_load(spec: LoadSpec) -> dict:
    """Run `spec` against its server (blocking) and return the report (see the module docstring)."""
    return asyncio.run(run_load_async(spec))


def table_cell(value, digits: int = 2) -> str:
    """A Markdown table cell: `value` with `digits` decimals, "-" for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def table_row(cells: Sequence[str]) -> str:
    """A Markdown table row of `cells`."""
    return "| " + " | ".join(cells) + " |"


def markdown_table(reports: Sequence[dict]) -> str:
    """One row per report: label, arrivals, rate, answered / total, latency mean / p50 / p90 / p99 (s),
    TTFT mean / p50 / p90 (s), completion tokens per second, requests per second."""
    lines = ["| run | arrivals | rate (req/s) | ok / total | latency mean | p50 | p90 | p99 | TTFT mean | p50 | p90 "
             "| tok/s | req/s |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for report in reports:
        settings, latency, ttft = report["settings"], report["latency_s"], report["ttft_s"]
        label = report.get("label") or settings.get("url")
        seconds = (latency["mean"], latency["p50"], latency["p90"], latency["p99"], ttft["mean"], ttft["p50"],
                   ttft["p90"])
        lines.append(table_row([str(label), settings["arrivals"], f"{settings['rate']:g}",
                                f"{report['requests']['ok']} / {report['requests']['total']}",
                                *map(table_cell, seconds), table_cell(report["throughput_tok_s"], 1),
                                table_cell(report["requests_per_s"])]))
    return "\n".join(lines)


# --- command line -----------------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--rate", type=float, default=2.0, help="mean requests per second")
    parser.add_argument("--arrivals", default="poisson", choices=traffic.PROCESSES)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default=None,
                        help="a file of prompts (JSON array, JSON lines or one per line); default: built-in list")
    parser.add_argument("--burst-size", type=int, default=traffic.BURST_SIZE, help="bursty: requests per burst")
    parser.add_argument("--burst-gap", type=float, default=0.0, help="bursty: seconds between requests of a burst")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model", default=None, help="default: the model the server lists")
    parser.add_argument("--label", default=None, help="the run's name in the table")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--api-key", default=None,
                        help=f"sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none)")


def run(args) -> int:
    """`hf-adaptive-spec loadtest`: run, print the table (and where the report went); 0 when every request was
    answered, 1 otherwise."""
    spec = LoadSpec(url=args.url, rate=args.rate, arrivals=args.arrivals, requests=args.requests, seed=args.seed,
                    max_tokens=args.max_tokens, prompts=tuple(load_prompts(args.prompts)) if args.prompts
                    else DEFAULT_PROMPTS, burst_size=args.burst_size, burst_gap=args.burst_gap,
                    time_limit=args.time_limit, temperature=args.temperature, model=args.model, label=args.label,
                    api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)
    try:
        spec.validate()
    except ValueError as error:
        raise SystemExit(f"loadtest: {error}")
    report = run_load(spec)
    print(markdown_table([report]))
    counts = report["requests"]
    failures = ", ".join(f"{key}: {value}" for key, value in sorted(counts["errors"].items()))
    print(f"\n{counts['ok']} of {counts['total']} answered, {counts['failed']} failed"
          f"{' (' + failures + ')' if failures else ''}, {counts['not_sent']} not sent")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"report: {args.out}")
    return 0 if counts["ok"] == counts["total"] else 1
