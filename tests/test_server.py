"""The OpenAI-compatible server: a real uvicorn server on a free 127.0.0.1 port, a real HTTP client (httpx),
the real continuous-batching engine on tiny random models (nothing downloaded).

Greedy answers over HTTP (streamed and not, one at a time and several at once) equal what plain `generate`
gives each prompt alone; malformed requests get 400 with an OpenAI error body, a full queue 429, a client that
leaves mid-stream frees its row, SIGTERM ends the process cleanly. Nothing here depends on machine speed: every
wait polls a condition under a generous deadline.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import signal
import socket
import struct
import subprocess
import sys
import time
import warnings
import zlib

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import tiny_models  # noqa: E402
from tiny_server import (CHAT_TEMPLATE, build_engine, build_models, build_tokenizer, free_port,  # noqa: E402
                         running_server, save_tiny_pair, wait_for)

from hf_adaptive_spec.serving.chat import (RequestError, SamplingDefaults, TextAssembler,  # noqa: E402
                                           parse_chat_request)
from hf_adaptive_spec.serving.server import create_app, warn_if_exposed  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny-llama"
TIMEOUT = 120.0  # seconds: a bound on any one wait, never a performance threshold
LONG = 60_000  # new tokens no tiny model finishes while a test holds it (the server's context is set to allow it)
PROMPTS = ["hello world", "tell me a story about cats", "why is the sky blue", "what about dogs w3 w7 w9 w11",
           "how", "the dogs is a story w1 w2"]


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False)


def _messages(prompt: str) -> list:
    return [{"role": "user", "content": prompt}]


def _plain(model, tokenizer, messages, max_new_tokens: int, processor=None, images=None):
    """(generated ids, text, finish reason) of plain greedy `generate` on this prompt alone."""
    if processor is not None:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=images, return_tensors="pt")
    else:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    reason = "stop" if ids and ids[-1] == tiny_models.EOS_ID else "length"
    return ids, tokenizer.decode(ids, skip_special_tokens=True), reason


def _read_stream(lines) -> dict:
    """The parts of a streamed answer: chunks, text, finish reason, usage; checks the SSE framing."""
    chunks, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        chunks.append(json.loads(data))
    assert done, "the stream ended without [DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    with_choices = [c for c in chunks if c["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)
    finishes = [c["choices"][0]["finish_reason"] for c in with_choices if c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and with_choices[-1]["choices"][0]["finish_reason"] == finishes[0]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == MODEL
        assert chunk["id"] == chunks[0]["id"]
    return {"text": text, "finish_reason": finishes[0], "usage": usage[0] if usage else None, "chunks": chunks}


def _engine_stats(client) -> dict:
    return client.get("/health").json()["engine"]


# --- request parsing and incremental text (no server) ---------------------------------------------------


def test_parse_chat_request_fields():
    chat = parse_chat_request({"model": MODEL, "messages": [{"role": "developer", "content": "be short"},
                                                            {"role": "user", "content": [
                                                                {"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
                               "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3,
                               "stop": "x", "stream": True, "stream_options": {"include_usage": True},
                               "user": "u", "frequency_penalty": 0, "logprobs": False, "n": 1}, MODEL)
    assert chat.messages == [{"role": "system", "content": "be short"}, {"role": "user", "content": "a\nb"}]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k, chat.seed) == (7, 0.5, 0.9, 5, 3)
    assert chat.stop == ("x",) and chat.stream and chat.include_usage
    defaults = parse_chat_request({"messages": _messages("hi")}, MODEL, defaults=SamplingDefaults(0.7, 0.8, 20))
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.7, 0.8, 20, None)


@pytest.mark.parametrize("body, param", [
    ([1, 2], None),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
    ({"messages": _messages("x"), "temperature": 2.5}, "temperature"),
    ({"messages": _messages("x"), "temperature": True}, "temperature"),
    ({"messages": _messages("x"), "top_p": 0}, "top_p"),
    ({"messages": _messages("x"), "max_tokens": 0}, "max_tokens"),
    ({"messages": _messages("x"), "max_tokens": 1.5}, "max_tokens"),
    ({"messages": _messages("x"), "max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
    ({"messages": _messages("x"), "n": 2}, "n"),
    ({"messages": _messages("x"), "stop": [1]}, "stop"),
    ({"messages": _messages("x"), "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": _messages("x"), "stop": ""}, "stop"),
    ({"messages": _messages("x"), "stream": "yes"}, "stream"),
    ({"messages": _messages("x"), "logprobs": True}, "logprobs"),
    ({"messages": _messages("x"), "tools": [{"type": "function"}]}, "tools"),
    ({"messages": _messages("x"), "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": _messages("x"), "best_of": 2}, "best_of"),
    ({"messages": _messages("x"), "model": "gpt-4o"}, "model"),
    ({"messages": _messages("x"), "stop_token_ids": [500]}, "stop_token_ids"),
])
def test_parse_chat_request_refuses(body, param):
    with pytest.raises(RequestError) as error:
        parse_chat_request(body, MODEL, vocab_size=128)
    assert error.value.status == 400 and error.value.param == param
    assert error.value.body()["error"]["type"] == "invalid_request_error" and error.value.message


def _png_data_url(width=10, height=12, seed=0) -> str:
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_parse_images():
    url = _png_data_url()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what"}]}]}
    chat = parse_chat_request(body, MODEL, accepts_images=True)
    assert chat.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "what"}]
    assert chat.images[0].size == (10, 12) and chat.images[0].mode == "RGB"
    with pytest.raises(RequestError, match="takes no images"):
        parse_chat_request(body, MODEL, accepts_images=False)
    for bad, match in [("https://example.com/cat.png", "only data URLs"), ("data:text/plain;base64,aGk=", "image/"),
                       ("data:image/png;base64,@@@", "base64"), ("data:image/png;base64,aGVsbG8=", "cannot be decoded"),
                       ("data:image/png,rawbytes", "base64 encoded")]:
        body["messages"][0]["content"][0]["image_url"]["url"] = bad
        with pytest.raises(RequestError, match=match):
            parse_chat_request(body, MODEL, accepts_images=True)


def _png_header_url(width: int, height: int) -> str:
    """A PNG that claims `width` x `height` pixels in its header and holds a few bytes of data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.mark.parametrize("url, limit, match", [
    (_png_data_url(), 100, "the image is 10x12 = 120 pixels, over the limit of 100 pixels"),
    (_png_header_url(9000, 9000), None, "9000x9000 = 81000000 pixels, over the limit of 67108864 pixels"),
    (_png_header_url(100_000, 100_000), None, "more than 67108864 pixels, the limit"),  # PIL's own bound first
])
def test_images_over_the_pixel_limit_get_413(url, limit, match):
    """The size is read from the header and refused before any pixel is decoded."""
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    options = {} if limit is None else {"max_image_pixels": limit}
    with pytest.raises(RequestError, match=match) as error:
        parse_chat_request(body, MODEL, accepts_images=True, **options)
    assert (error.value.status, error.value.code) == (413, "image_too_large")


def _byte_level_tokenizer():
    """A byte-level BPE trained here on a few lines (offline): multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(["hello world, the stop word", "plain text only"], trainer)
    return backend


def test_text_assembler_holds_back_incomplete_characters():
    backend = _byte_level_tokenizer()
    text = "ab é 😀 done"
    ids = backend.encode(text).ids
    assert len(ids) > len(text.split())  # the emoji and é are several byte tokens
    assembler = TextAssembler(backend.decode)
    deltas = [assembler.feed([token]) for token in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + assembler.flush() == text
    assert assembler.num_tokens == len(ids)


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_text_assembler_stop_strings(rounds):
    backend = _byte_level_tokenizer()
    text = "hello world, the stop word and more"
    ids = backend.encode(text).ids
    assembler = TextAssembler(backend.decode, stop=("stop w", "zzz"))
    deltas = []
    for start in range(0, len(ids), rounds):  # `rounds` tokens per round
        deltas.append(assembler.feed(ids[start:start + rounds]))
        if assembler.stopped:
            break
    assert assembler.stopped and "".join(deltas) + assembler.flush() == "hello world, the "
    # the fewest tokens whose text holds the stop string
    expected = next(k for k in range(1, len(ids) + 1) if "stop w" in backend.decode(ids[:k]))
    assert assembler.num_tokens == expected
    # nothing that could still become a stop string was sent early
    partial = TextAssembler(backend.decode, stop=("world!",))
    sent = partial.feed(backend.encode("hello world").ids)
    assert sent == "hello " and partial.flush() == "world"


# --- the served model -----------------------------------------------------------------------------------


class Served:
    """A running server around the tiny model (and its untouched twin, for plain `generate`)."""

    def __init__(self, strategy: str, **engine_options):
        self.strategy = strategy
        self.tokenizer = build_tokenizer()
        target, drafter = build_models(strategy)
        self.reference = copy.deepcopy(target)
        self.engine = build_engine(strategy, models=(target, drafter), **engine_options)

    def expected(self, prompt: str, max_tokens: int):
        return _plain(self.reference, self.tokenizer, _messages(prompt), max_tokens)


@pytest.fixture(scope="module", params=["plain", "chain"])
def served(request):
    server = Served(request.param)
    app = create_app(server.engine, server.tokenizer, MODEL)
    with running_server(app) as url:
        server.url = url
        yield server


@pytest.fixture(scope="module")
def long_server():
    """One row at a time, one waiting request at most, and room for LONG new tokens: a long request holds the
    engine for as long as a test wants."""
    server = Served("plain", max_batch=1, max_queue=1)
    app = create_app(server.engine, server.tokenizer, MODEL, max_context=LONG + 64)
    with running_server(app) as url:
        server.url = url
        yield server


def test_greedy_equals_plain(served):
    with _client(served.url) as client:
        for prompt, max_tokens in [(PROMPTS[0], 12), (PROMPTS[1], 20)]:
            ids, text, reason = served.expected(prompt, max_tokens)
            body = {"model": MODEL, "messages": _messages(prompt), "max_tokens": max_tokens}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["object"] == "chat.completion" and answer["model"] == MODEL
            choice = answer["choices"][0]
            assert choice["message"] == {"role": "assistant", "content": text}
            assert choice["finish_reason"] == reason
            prompt_tokens = len(served.tokenizer.apply_chat_template(_messages(prompt), add_generation_prompt=True,
                                                                     return_dict=True)["input_ids"])
            assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                                       "total_tokens": prompt_tokens + len(ids)}
            with client.stream("POST", "/v1/chat/completions",
                               json={**body, "stream": True, "stream_options": {"include_usage": True}}) as stream:
                assert stream.status_code == 200
                assert stream.headers["content-type"].startswith("text/event-stream")
                streamed = _read_stream(stream.iter_lines())
            assert streamed["text"] == text and streamed["finish_reason"] == reason
            assert streamed["usage"]["completion_tokens"] == len(ids)
        # the answers ended; their rows leave the batch at the end of the round that finished them
        stats = wait_for(lambda: (lambda s: s["running"] == 0 and s["waiting"] == 0 and s)(_engine_stats(client)),
                          "the finished rows to leave")
        assert stats["strategy"] == served.strategy


async def _ask(client, prompt: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": MODEL, "messages": _messages(prompt), "max_tokens": max_tokens, "stream": stream}
    if not stream:
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"]}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines()]
    return _read_stream(lines)


def test_concurrent_requests_each_equal_plain(served):
    """Six requests at once on a batch of four: some wait and join between rounds, all end at different times."""
    jobs = [(prompt, 6 + 5 * i, i % 2 == 0) for i, prompt in enumerate(PROMPTS)]
    expected = [served.expected(prompt, max_tokens) for prompt, max_tokens, _ in jobs]

    async def run():
        async with httpx.AsyncClient(base_url=served.url, timeout=TIMEOUT, trust_env=False) as client:
            return await asyncio.gather(*(_ask(client, *job) for job in jobs))

    answers = asyncio.run(run())
    for (prompt, max_tokens, stream), answer, (ids, text, reason) in zip(jobs, answers, expected):
        assert answer["text"] == text, (prompt, max_tokens, stream)
        assert answer["finish_reason"] == reason
    with _client(served.url) as client:
        stats = wait_for(lambda: (lambda s: s["running"] == 0 and s)(_engine_stats(client)), "the rows to leave")
    assert stats["prefills"] >= len(jobs)


def test_stop_strings_cut_the_answer(served):
    ids, text, _ = served.expected(PROMPTS[2], 16)
    words = text.split(" ")
    stop = words[4]
    cut = text[:text.index(stop)]
    tokens_to_stop = next(k for k in range(1, len(ids) + 1)
                          if stop in served.tokenizer.decode(ids[:k], skip_special_tokens=True))
    body = {"messages": _messages(PROMPTS[2]), "max_tokens": 16, "stop": [stop, "never there"]}
    with _client(served.url) as client:
        answer = client.post("/v1/chat/completions", json=body).json()
        assert answer["choices"][0]["message"]["content"] == cut
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == tokens_to_stop
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            streamed = _read_stream(stream.iter_lines())
        assert streamed["text"] == cut and streamed["finish_reason"] == "stop"
        wait_for(lambda: _engine_stats(client)["running"] == 0, "the stopped rows to leave")


def test_stop_token_ids_and_sampling(served):
    ids, text, _ = served.expected(PROMPTS[3], 12)
    stop_id = ids[3]
    first = ids.index(stop_id)
    with _client(served.url) as client:
        answer = client.post("/v1/chat/completions", json={"messages": _messages(PROMPTS[3]), "max_tokens": 12,
                                                           "stop_token_ids": [stop_id]}).json()
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == first + 1
        assert answer["choices"][0]["message"]["content"] == served.tokenizer.decode(ids[:first + 1],
                                                                                     skip_special_tokens=True)
        sampled = client.post("/v1/chat/completions", json={"messages": _messages(PROMPTS[0]), "max_tokens": 8,
                                                            "temperature": 0.9, "top_p": 0.95, "seed": 7})
        assert sampled.status_code == 200, sampled.text
        assert sampled.json()["usage"]["completion_tokens"] >= 1


def _assert_error(response, status: int, kind: str = "invalid_request_error", match: str = ""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind and match.lower() in error["message"].lower(), error
    return error


def test_bad_requests_get_400_and_the_server_goes_on(served):
    url = "/v1/chat/completions"
    with _client(served.url) as client:
        _assert_error(client.post(url, content=b'{"messages": [', headers={"content-type": "application/json"}),
                      400, match="not valid JSON")
        _assert_error(client.post(url, content=b""), 400, match="empty")
        _assert_error(client.post(url, json={"model": MODEL}), 400, match="'messages' is required")
        _assert_error(client.post(url, json={"messages": []}), 400, match="must not be empty")
        _assert_error(client.post(url, json={"messages": _messages("x"), "temperature": 7}), 400, match="temperature")
        _assert_error(client.post(url, json={"messages": _messages("x"), "temperature": "hot"}), 400,
                      match="must be a number")
        _assert_error(client.post(url, json={"messages": _messages("x"), "n": 2}), 400, match="'n' must be 1")
        _assert_error(client.post(url, json={"messages": _messages("x"), "model": "gpt-4o"}), 400,
                      match="does not exist")
        _assert_error(client.post(url, json={"messages": _messages("x"), "frobnicate": 1}), 400,
                      match="Unrecognized request argument supplied: frobnicate")
        image = [{"type": "image_url", "image_url": {"url": _png_data_url()}}, {"type": "text", "text": "what"}]
        _assert_error(client.post(url, json={"messages": [{"role": "user", "content": image}]}), 400,
                      match="takes no images")
        # over-long: max_tokens beyond the context (1024), and a prompt beyond it
        _assert_error(client.post(url, json={"messages": _messages("x"), "max_tokens": 5000}), 400,
                      match="maximum context length")
        error = _assert_error(client.post(url, json={"messages": _messages("hello " * 1100)}), 400,
                              match="maximum context length")
        assert error["code"] == "context_length_exceeded"
        _assert_error(client.get("/v1/nothing"), 404, kind="not_found_error")
        _assert_error(client.get(url), 405)
        assert client.post(url, json={"messages": _messages("hello"), "max_tokens": 3}).status_code == 200
        assert client.get("/health").json()["server"]["by_status"]["400"] >= 12


def test_health_and_models(served):
    with _client(served.url) as client:
        health = client.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ok" and body["model"] == MODEL
        for key in ("running", "waiting", "rounds", "tokens", "max_batch", "max_queue"):
            assert key in body["engine"]
        assert client.get("/v1/stats").json()["engine"]["strategy"] == served.strategy
        models = client.get("/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
        assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
        _assert_error(client.get("/v1/models/other"), 404, kind="not_found_error")


def _first_content(lines) -> str:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                return delta["content"]
    raise AssertionError("no content in the stream")


def test_full_queue_gets_429(long_server):
    body = {"messages": _messages(PROMPTS[0]), "max_tokens": LONG, "stream": True}
    with _client(long_server.url) as running, _client(long_server.url) as waiting, \
            _client(long_server.url) as client:
        # (a line iterator closes its connection when dropped: each is kept until its block ends)
        with running.stream("POST", "/v1/chat/completions", json=body) as first:
            first_lines = first.iter_lines()
            _first_content(first_lines)  # its row is in the batch (of one)
            with waiting.stream("POST", "/v1/chat/completions", json=body) as second:
                assert second.status_code == 200
                second_lines = second.iter_lines()
                next(second_lines)  # the role chunk: it was accepted, and waits in the queue (of one)
                wait_for(lambda: (lambda s: s["running"] == 1 and s["waiting"] == 1)(_engine_stats(client)),
                          "one running and one waiting request", show=lambda: _engine_stats(client))
                response = client.post("/v1/chat/completions", json={**body, "stream": False})
                _assert_error(response, 429, kind="rate_limit_error", match="queue is full")
                assert response.headers.get("retry-after") == "1"
                del first_lines, second_lines
        # both clients have gone: their rows leave, and the server serves again
        wait_for(lambda: (lambda s: s["running"] == 0 and s["waiting"] == 0)(_engine_stats(client)),
                  "the abandoned requests to leave")
        ids, text, _ = long_server.expected(PROMPTS[1], 6)
        answer = client.post("/v1/chat/completions", json={"messages": _messages(PROMPTS[1]), "max_tokens": 6})
        assert answer.json()["choices"][0]["message"]["content"] == text


def test_disconnect_mid_stream_frees_the_row(long_server):
    body = {"messages": _messages(PROMPTS[2]), "max_tokens": LONG, "stream": True}
    with _client(long_server.url) as client:
        cancelled = _engine_stats(client)["cancelled"]
        with _client(long_server.url) as leaving:
            with leaving.stream("POST", "/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()
                _first_content(lines)
                _first_content(lines)
                assert _engine_stats(client)["running"] == 1
        wait_for(lambda: _engine_stats(client)["running"] == 0, "the row of the client that left to go")
        assert _engine_stats(client)["cancelled"] == cancelled + 1
        assert client.post("/v1/chat/completions", json={"messages": _messages("hello"), "max_tokens": 2}) \
            .status_code == 200


def test_disconnect_before_a_whole_answer_frees_the_row(long_server):
    """A non-streamed request whose client closes the connection is cancelled too."""
    payload = json.dumps({"messages": _messages(PROMPTS[4]), "max_tokens": LONG}).encode()
    port = int(long_server.url.rsplit(":", 1)[1])
    with _client(long_server.url) as client:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            wait_for(lambda: _engine_stats(client)["running"] == 1, "the request to run")
        wait_for(lambda: _engine_stats(client)["running"] == 0, "the row of the closed connection to go")


def test_image_request_on_a_vlm():
    """A tiny Llava behind a processor (built offline): an image request equals plain generate on the processor's
    inputs; the same server still answers text."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from hf_adaptive_spec.serving.engine import Engine

    tokenizer = build_tokenizer()
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": tiny_models.LLAVA_IMAGE_SIZE},
                                            crop_size={"height": tiny_models.LLAVA_IMAGE_SIZE,
                                                       "width": tiny_models.LLAVA_IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=tiny_models.LLAVA_PATCH, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, image_token="<image>", chat_template=CHAT_TEMPLATE)
    model = tiny_models.build_model("llava")
    reference = copy.deepcopy(model)
    url = _png_data_url(width=11, height=9, seed=3)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is the sky"}]
    chat = parse_chat_request({"messages": [{"role": "user", "content": content}]}, MODEL, accepts_images=True)
    ids, text, reason = _plain(reference, tokenizer, chat.messages, 10, processor=processor, images=chat.images)
    _, plain_text, _ = _plain(reference, tokenizer, [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
                              10, processor=processor)
    app = create_app(Engine(model, None, strategy="plain"), processor, MODEL)
    with running_server(app) as server_url, _client(server_url) as client:
        answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                           "max_tokens": 10})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == text
        assert answer.json()["usage"]["prompt_tokens"] == len(processor(
            text=[processor.apply_chat_template(chat.messages, add_generation_prompt=True, tokenize=False)],
            images=chat.images)["input_ids"][0])
        answer = client.post("/v1/chat/completions", json={"messages": _messages("hello"), "max_tokens": 10})
        assert answer.json()["choices"][0]["message"]["content"] == plain_text
        _assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}), 400, match="data URLs")
        _assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _png_header_url(9000, 9000)}}]}]}), 413,
            match="over the limit of 67108864 pixels")


def test_serve_command_and_sigterm(tmp_path):
    """`hf-adaptive-spec serve` in a process of its own (the tiny pair from folders, strategy chain): it answers
    as plain generate does; on SIGTERM a request still running after the drain timeout ends with finish_reason
    "cancelled" and [DONE], and the process exits with status 0."""
    target_path, drafter_path = save_tiny_pair(tmp_path, LONG + 64)
    port = free_port()
    log_path = tmp_path / "server.log"
    log = open(log_path, "w")
    command = [sys.executable, "-m", "hf_adaptive_spec.cli", "serve", "--target", target_path, "--drafter",
               drafter_path, "--strategy", "chain", "--no-drafter-int8", "--port", str(port), "--drain-timeout", "1",
               "--threads", "1", "--max-batch", "2", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            assert process.poll() is None, "the server process ended: " + log_path.read_text()
            try:
                return httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, "the server process to listen", interval=0.2)
        tokenizer = build_tokenizer()
        _, text, _ = _plain(build_models("plain")[0], tokenizer, _messages(PROMPTS[1]), 12)
        with _client(url) as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == target_path
            answer = client.post("/v1/chat/completions", json={"model": target_path, "max_tokens": 12,
                                                               "messages": _messages(PROMPTS[1])}).json()
            assert answer["choices"][0]["message"]["content"] == text
            assert client.get("/health").json()["engine"]["strategy"] == "chain"
            body = {"messages": _messages(PROMPTS[0]), "max_tokens": LONG, "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()
                first = _first_content(lines)
                process.send_signal(signal.SIGTERM)
                rest = [json.loads(line[6:]) if line != "data: [DONE]" else line for line in lines if line]
        assert first and rest[-1] == "data: [DONE]"
        assert rest[-2]["choices"][0]["finish_reason"] == "cancelled"
        assert all(chunk["choices"][0]["finish_reason"] is None for chunk in rest[:-2])
        assert process.wait(TIMEOUT) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_shutting_down_answers_503():
    """While draining (after SIGTERM) and once the engine has stopped, requests get 503; /health says so."""
    server = Served("plain")
    app = create_app(server.engine, server.tokenizer, MODEL, manage_engine=False)  # an engine never started
    body = {"messages": _messages("hello"), "max_tokens": 2}
    with running_server(app) as url, _client(url) as client:
        _assert_error(client.post("/v1/chat/completions", json=body), 503, kind="service_unavailable",
                      match="shutting down")
        app.state.serving.draining = True
        _assert_error(client.post("/v1/chat/completions", json=body), 503, kind="service_unavailable")
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert client.get("/v1/stats").status_code == 200


@pytest.mark.parametrize("argv, match", [
    (["--strategy", "plain", "--drafter", "some-drafter"], "drafts nothing"),
    (["--strategy", "chain"], "needs --drafter"),
])
def test_serve_command_refuses_a_strategy_without_its_drafter(argv, match):
    from hf_adaptive_spec.cli import main

    with pytest.raises(SystemExit, match=match):
        main(["serve", "--target", "does-not-matter", *argv])


def test_api_key_guards_every_route_but_health():
    """With an API key: 401 (OpenAI error body, code invalid_api_key) without it, with another key or another
    scheme, on every route but /health; the key as OpenAI clients send it passes."""
    openai = pytest.importorskip("openai")
    server = Served("plain")
    app = create_app(server.engine, server.tokenizer, MODEL, api_key="s3cret")
    body = {"messages": _messages("hello"), "max_tokens": 2}
    with running_server(app) as url, _client(url) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                        {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cret-and-more"}):
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/stats"),
                                 ("GET", "/no/such/route")):
                response = client.request(method, path, json=body, headers=headers)
                error = _assert_error(response, 401)
                assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
        assert client.get("/health").status_code == 200
        answer = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert answer.status_code == 200, answer.text
        assert client.get("/v1/stats", headers={"authorization": "bearer s3cret"}).json()["server"]["by_status"][
            "401"] == 20
        openai_client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0,
                                      http_client=httpx.Client(trust_env=False, timeout=TIMEOUT))
        assert [m.id for m in openai_client.models.list().data] == [MODEL]
        openai_client.api_key = "wrong"
        with pytest.raises(openai.AuthenticationError):
            openai_client.models.list()


@pytest.mark.parametrize("host, key, warns", [
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.5", None, True), ("example.com", None, True),
    ("127.0.0.1", None, False), ("127.3.2.1", None, False), ("::1", None, False), ("[::1]", None, False),
    ("localhost", None, False), ("0.0.0.0", "a-key", False),
])
def test_serving_beyond_the_loopback_without_a_key_warns(host, key, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_exposed(host, key)
    assert any("without an API key" in str(w.message) for w in caught) == warns
