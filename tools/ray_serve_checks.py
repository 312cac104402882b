"""Checks of `hf-adaptive-spec serve --replicas` on a real model, each a bounded load run against 127.0.0.1:

- ``answers``: N replicas under a bounded concurrent run; every greedy answer is compared with plain greedy
  `generate` for that prompt alone (run after the server has stopped).
- ``kill``: the same, with one replica killed (``ray.kill``) while requests run; every answer is compared, every
  failed request is listed with its error, and the run waits until Ray has replaced the replica and a request
  is answered by the new one.

Each writes ``<name>.json`` (the load generator's report, the comparison, the events) into ``--out``:

    python tools/ray_serve_checks.py answers --out docs/benchmarks/ray_replicas_2026-12-06_xeon
    python tools/ray_serve_checks.py kill --out docs/benchmarks/ray_replicas_2026-12-06_xeon
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from hf_adaptive_spec.serving.http_load import LoadSpec, run_load

TARGET, DRAFTER = "smollm2-135m-instruct", "laspec-smollm2-135m-instruct"


def start_server(port: int, replicas: int, log_path: Path, timeout: float = 600.0) -> subprocess.Popen:
    """`hf-adaptive-spec serve --replicas` in a process of its own; returns once /health answers 200."""
    command = [sys.executable, "-m", "hf_adaptive_spec.cli", "serve", "--target", TARGET, "--drafter", DRAFTER,
               "--strategy", "laspec", "--port", str(port), "--replicas", str(replicas), "--replica-cpus", "1",
               "--log-level", "warning"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5, trust_env=False).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    process.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout}s: see {log_path}")


def stop_server(process: subprocess.Popen, timeout: float = 300.0) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def plain_answers(prompts, max_tokens: int) -> dict:
    """Plain greedy `generate` of the target for each prompt alone: prompt -> text."""
    import torch

    from hf_adaptive_spec.chat_template import encode_chat, text_tokenizer
    from hf_adaptive_spec.loading import load_model

    model, processor = load_model(TARGET)
    tokenizer = text_tokenizer(processor)
    answers = {}
    with torch.no_grad():
        for prompt in sorted(set(prompts)):
            inputs = encode_chat(processor, [{"role": "user", "content": prompt}])
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
            answers[prompt] = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return answers


def compare(report: dict, max_tokens: int) -> dict:
    """Every answered request against plain greedy; every other one with its status, its error and whether the
    text streamed before the error begins plain greedy's answer."""
    records = report["per_request"]
    plain = plain_answers([r["prompt"] for r in records if r["text"] or r["status"] == "200"], max_tokens)
    answered = [r for r in records if r["status"] == "200" and r["error"] is None]
    wrong = [r["index"] for r in answered if r["text"] != plain[r["prompt"]]]
    failed = [{"index": r["index"], "status": r["status"], "error": r["error"], "replica": r["replica"],
               "streamed_tokens_correct": plain[r["prompt"]].startswith(r["text"]) if r["text"] else None}
              for r in records if not (r["status"] == "200" and r["error"] is None)]
    return {"answered": len(answered), "equal_to_plain": len(answered) - len(wrong), "wrong": wrong,
            "failed": failed, "retried": [r["index"] for r in records if r["retried"]],
            "replicas": sorted({r["replica"] for r in answered if r["replica"]})}


class Events:
    """What happened to the served replicas during a run, in seconds from its start."""

    def __init__(self, url: str):
        self.url = url
        self.start = time.monotonic()
        self.items: list = []

    def add(self, event: str, **details) -> None:
        self.items.append({"event": event, "at_s": round(time.monotonic() - self.start, 2), **details})

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=120, trust_env=False).json()


def kill_one_replica(events: Events, after_s: float) -> None:
    """After `after_s` seconds kill the replica that answers /health (``ray.kill``; Serve's controller starts a
    new one)."""
    import ray

    time.sleep(after_s)
    ray.init(address="auto", log_to_driver=False)
    try:
        victim = events.health()["replica"]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        events.add("killed", replica=victim)
    finally:
        ray.shutdown()  # the server's Ray stops with it; a connection left open would end this process


def wait_for_a_new_replica(events: Events, known: set, timeout: float = 600.0) -> None:
    """Until /health counts every replica running again and a replica not in `known` answers a request."""
    deadline = time.monotonic() + timeout
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=events.url, timeout=120, trust_env=False) as client:
        while time.monotonic() < deadline:
            replicas = client.get("/health").json()["replicas"]
            if replicas["running"] == replicas["target"]:
                answer = client.post("/v1/chat/completions", json=body)
                if answer.status_code == 200 and answer.headers.get("x-replica") not in known:
                    events.add("a new replica answered", replica=answer.headers["x-replica"], replicas=replicas)
                    return
            time.sleep(1.0)
    raise RuntimeError(f"no new replica answered within {timeout}s")


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    process = start_server(args.port, args.replicas, out / f"{args.check}_server.log")
    events = Events(f"http://127.0.0.1:{args.port}")
    try:
        known = {events.health()["replica"] for _ in range(20)}
        events.add("serving", replicas=sorted(known))
        killer = threading.Thread(target=kill_one_replica, args=(events, args.kill_after))
        if args.check == "kill":
            killer.start()
        report = run_load(LoadSpec(url=events.url, rate=args.rate, requests=args.requests,
                                   max_tokens=args.max_tokens, time_limit=args.time_limit,
                                   label=f"{args.check}, {args.replicas} replicas"))
        events.add("load run ended")
        if args.check == "kill":
            killer.join()
            wait_for_a_new_replica(events, known)
    finally:
        code = stop_server(process)
    result = {"command": " ".join(sys.argv), "server_exit_status": code, "events": events.items,
              "comparison": compare(report, args.max_tokens), "report": report}
    (out / f"{args.check}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({"comparison": result["comparison"], "events": events.items}, indent=2))
    return 0 if not result["comparison"]["wrong"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["answers", "kill"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--kill-after", type=float, default=6.0, help="kill: seconds into the run")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
