"""OpenAI chat-completion requests: parsing and validation of the JSON body, images from data URLs, and the
incremental text of a streamed answer.

Nothing here touches a model or the network: `parse_chat_request` turns a decoded JSON body into a
`ChatRequest` (or raises `RequestError`, which the server answers with an OpenAI-style error body), and
`TextAssembler` turns the token ids an engine hands out round by round into text deltas that are safe to send
(no half of a multi-byte character, nothing that could still become a stop string).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

__all__ = ["ChatRequest", "RequestError", "SamplingDefaults", "TextAssembler", "decode_data_url", "error_body",
           "parse_chat_request"]

MAX_STOP_STRINGS = 4  # as the OpenAI API
MAX_IMAGE_BYTES = 16 * 1024 * 1024  # decoded size of one data URL
MAX_IMAGE_PIXELS = 64 * 1024 * 1024

# Fields this server implements (besides `messages`).
_IMPLEMENTED = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                "stop_token_ids", "stream", "stream_options", "n"}
# Fields accepted and ignored: they do not change the answer.
_IGNORED = {"user", "metadata", "service_tier", "store", "parallel_tool_calls"}
# OpenAI fields accepted only at the value that means "off"; anything else is refused (not silently dropped).
_NEUTRAL_ONLY = {
    "frequency_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "presence_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or (_is_int(v) and v == 0),
    "logit_bias": lambda v: v is None or v == {},
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v in ("none", "auto"),
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v in ("none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": lambda v: v is None or v == ["text"],
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MESSAGE_KEYS = {"role", "content", "name", "refusal", "tool_calls", "annotations"}


class RequestError(ValueError):
    """A request the server refuses; `status` (400 unless said), an OpenAI error `kind` and the offending
    `param`. `body()` is the OpenAI error object ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 kind: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """The OpenAI error object ``{"error": {"message", "type", "param", "code"}}`` (`kind` is its ``type``)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets: the served model's generation config
    (temperature 0 = greedy when it does not sample)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_generation_config(cls, generation_config) -> "SamplingDefaults":
        if generation_config is None or not getattr(generation_config, "do_sample", False):
            return cls()
        temperature = getattr(generation_config, "temperature", None)
        top_p = getattr(generation_config, "top_p", None)
        top_k = getattr(generation_config, "top_k", None)
        return cls(temperature=1.0 if temperature is None else float(temperature),
                   top_p=1.0 if top_p is None else float(top_p), top_k=0 if top_k is None else int(top_k))


@dataclass
class ChatRequest:
    """A validated chat request.

    `messages` are ready for a chat template: string content for a text model; for a model that takes images a
    list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts, the images themselves in `images`
    (PIL, RGB, in order). `max_tokens` is None when the request did not say (the server picks a default).
    """

    messages: list
    images: list = field(default_factory=list)
    max_tokens: Optional[int] = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    stream: bool = False
    include_usage: bool = False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def _type_name(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if _is_number(value) else type(value).__name__)


def _number(body: dict, name: str, low: float, high: float, default, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise RequestError(f"'{name}' must be a number, got {_type_name(value)}", param=name)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(f"'{name}' must be in {bracket}{low:g}, {high:g}], got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: Optional[int] = None):
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise RequestError(f"'{name}' must be an integer, got {_type_name(value)}", param=name)
    if value < low or (high is not None and value > high):
        limit = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"'{name}' must be {limit}, got {value}", param=name)
    return value


def decode_data_url(url: str, param: str = "image_url", max_pixels: int = MAX_IMAGE_PIXELS):
    """A ``data:image/...;base64,...`` URL -> a PIL image (RGB). Only data URLs: the server fetches nothing.

    Bounded before anything large is decoded: a payload over `MAX_IMAGE_BYTES` is refused before its base64 is
    decoded, and an image over `max_pixels` pixels once its header is read (``Image.open`` reads the size only;
    the pixels are decoded after the check): both 413 naming the limit, never a decompression bomb."""
    if not isinstance(url, str):
        raise RequestError(f"'{param}' must be a string URL, got {_type_name(url)}", param=param)
    if not url.startswith("data:"):
        raise RequestError(f"'{param}': only data URLs (data:image/png;base64,...) are accepted; this server "
                           "fetches nothing from the network", param=param)
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise RequestError(f"'{param}': a data URL needs a comma before its payload", param=param)
    media_type, *attributes = header.split(";")
    if not media_type.lower().startswith("image/"):
        raise RequestError(f"'{param}': the data URL's media type must be image/..., got {media_type!r}",
                           param=param)
    if "base64" not in [a.strip().lower() for a in attributes]:
        raise RequestError(f"'{param}': the data URL must be base64 encoded (data:{media_type};base64,...)",
                           param=param)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise RequestError(f"'{param}': the image is larger than {MAX_IMAGE_BYTES} bytes", param=param,
                           status=413, code="image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise RequestError(f"'{param}': the data URL's payload is not valid base64 ({error})", param=param)
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is in the `serve` extra
        raise RequestError("images need Pillow on the server (pip install 'hf_adaptive_spec[serve]')",
                           param=param, status=500, kind="server_error")
    try:
        with Image.open(io.BytesIO(data)) as image:
            _check_pixels(image.size, max_pixels, param)
            return image.convert("RGB")
    except RequestError:
        raise
    except Image.DecompressionBombError as error:  # PIL's own bound (twice Image.MAX_IMAGE_PIXELS) came first
        raise RequestError(f"'{param}': the image has more than {max_pixels} pixels, the limit ({error})",
                           param=param, status=413, code="image_too_large")
    except Exception as error:  # PIL raises several kinds for data it cannot read
        raise RequestError(f"'{param}': the image cannot be decoded ({type(error).__name__}: {error})",
                           param=param)


def _check_pixels(size: tuple, max_pixels: int, param: str) -> None:
    width, height = size
    if width * height > max_pixels:
        raise RequestError(f"'{param}': the image is {width}x{height} = {width * height} pixels, over the limit of "
                           f"{max_pixels} pixels", param=param, status=413, code="image_too_large")


def _content_parts(content: list, where: str, role: str, accepts_images: bool, model_name: str,
                   images: list, max_pixels: int) -> list:
    """OpenAI content parts -> template parts (``{"type": "text", "text"}`` / ``{"type": "image"}``)."""
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"'{at}' must be an object, got {_type_name(part)}", param=at)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(f"'{at}.text' must be a string, got {_type_name(text)}", param=f"{at}.text")
            parts.append({"type": "text", "text": text})
        elif kind == "image_url":
            if not accepts_images:
                raise RequestError(f"model {model_name!r} takes no images (a text-only model); send text content",
                                   param=at)
            if role != "user":
                raise RequestError(f"'{at}': images are accepted in user messages only", param=at)
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            images.append(decode_data_url(url, param=f"{at}.image_url", max_pixels=max_pixels))
            parts.append({"type": "image"})
        else:
            raise RequestError(f"'{at}.type' must be 'text' or 'image_url', got {kind!r}", param=f"{at}.type")
    return parts


def _messages(raw, accepts_images: bool, model_name: str, max_pixels: int) -> tuple[list, list]:
    if raw is None:
        raise RequestError("'messages' is required", param="messages")
    if not isinstance(raw, list):
        raise RequestError(f"'messages' must be an array, got {_type_name(raw)}", param="messages")
    if not raw:
        raise RequestError("'messages' must not be empty", param="messages")
    messages, images = [], []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"'{where}' must be an object, got {_type_name(message)}", param=where)
        unknown = sorted(set(message) - _MESSAGE_KEYS)
        if unknown:
            raise RequestError(f"'{where}' has unknown fields: {', '.join(unknown)}", param=where)
        if message.get("tool_calls") not in (None, []):
            raise RequestError(f"'{where}.tool_calls': tool calls are not supported", param=f"{where}.tool_calls")
        role = message.get("role")
        if role not in _ROLES:
            allowed = ", ".join(sorted(_ROLES))
            raise RequestError(f"'{where}.role' must be one of {allowed}, got {role!r}", param=f"{where}.role")
        role = _ROLES[role]
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = _content_parts(content, where, role, accepts_images, model_name, images, max_pixels)
        else:
            raise RequestError(f"'{where}.content' must be a string or an array of content parts, got "
                               f"{_type_name(content)}", param=f"{where}.content")
        if accepts_images:  # processors' templates iterate over parts
            messages.append({"role": role, "content": parts})
        else:  # text templates take a string: text parts joined by newlines
            messages.append({"role": role, "content": "\n".join(p["text"] for p in parts)})
    return messages, images


def _stop(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise RequestError(f"'stop' must be a string or an array of strings, got {_type_name(stop)}", param="stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(strings)}", param="stop")
    if any(s == "" for s in strings):
        raise RequestError("'stop' strings must not be empty", param="stop")
    return tuple(dict.fromkeys(strings))


def _stop_token_ids(body: dict, vocab_size: Optional[int]) -> tuple:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        raise RequestError(f"'stop_token_ids' must be an array of integers, got {_type_name(ids)}",
                           param="stop_token_ids")
    bad = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if bad:
        raise RequestError(f"'stop_token_ids' must be token ids in [0, {vocab_size}), got {bad[0]}",
                           param="stop_token_ids")
    return tuple(dict.fromkeys(ids))


def parse_chat_request(body: Any, model_name: str, accepts_images: bool = False,
                       defaults: SamplingDefaults = SamplingDefaults(),
                       vocab_size: Optional[int] = None, max_image_pixels: int = MAX_IMAGE_PIXELS) -> ChatRequest:
    """Validate an OpenAI ``/v1/chat/completions`` body (already decoded from JSON) for the model served as
    `model_name`.

    Args:
        body: the decoded JSON.
        model_name: the only model name accepted (`model` may also be left out).
        accepts_images: whether ``image_url`` parts are accepted (a model with an image processor).
        defaults: sampling settings for fields the request leaves out.
        vocab_size: bound for `stop_token_ids`.
        max_image_pixels: images larger than this (width x height) are refused with 413.

    Returns:
        A `ChatRequest`. Raises `RequestError` (status 400) naming the field for anything malformed or
        unsupported: an unknown field, a wrong type, a number out of range, `n` other than 1, an image for a
        text-only model, a URL that is not a data URL, an OpenAI feature this server does not implement (tools,
        logprobs, penalties) set to anything but its neutral value; status 413 for an image over
        `MAX_IMAGE_BYTES` or `max_image_pixels`.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - _IMPLEMENTED - _IGNORED - set(_NEUTRAL_ONLY) - {"messages"})
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0])
    for name, is_neutral in _NEUTRAL_ONLY.items():
        if name in body and not is_neutral(body[name]):
            raise RequestError(f"'{name}' is not supported by this server (only its default is accepted)",
                               param=name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {_type_name(model)}", param="model")
    if model is not None and model != model_name:
        raise RequestError(f"The model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", param="n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"'stream' must be a boolean, got {_type_name(stream)}", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, got {_type_name(options)}", param="stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be a boolean", param="stream_options")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    legacy = _integer(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = legacy
    elif legacy is not None and legacy != max_tokens:
        raise RequestError("'max_tokens' and 'max_completion_tokens' disagree; send one of them",
                           param="max_tokens")
    messages, images = _messages(body.get("messages"), accepts_images, model_name, max_image_pixels)
    return ChatRequest(
        messages=messages,
        images=images,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0, defaults.temperature),
        top_p=_number(body, "top_p", 0.0, 1.0, defaults.top_p, low_open=True),
        top_k=_integer(body, "top_k", 0) if body.get("top_k") is not None else defaults.top_k,
        seed=_integer(body, "seed", -(2 ** 63), 2 ** 63 - 1),
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body, vocab_size),
        stream=bool(stream),
        include_usage=include_usage,
    )


class TextAssembler:
    """The text of an answer as its token ids arrive, in deltas safe to send.

    Each `feed` decodes all ids so far (one decode per engine round) and returns the new suffix, holding back
    a trailing U+FFFD (an incomplete UTF-8 sequence: byte-level tokens of one character arrive in different
    rounds) and any tail that could still grow into a stop string. The concatenated deltas plus `flush()`
    equal ``decode(ids)`` (cut before the first stop string, which is not included, as in the OpenAI API).

    Args:
        decode: token ids -> text (e.g. ``tokenizer.decode(ids, skip_special_tokens=True)``).
        stop: stop strings.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(stop)
        self.ids: list = []
        self.sent = ""  # text handed out so far
        self.stopped = False  # a stop string was found: the answer is complete
        self._stop_tokens: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        """Tokens the answer used: up to the one that completed a stop string, else every id fed."""
        return len(self.ids) if self._stop_tokens is None else self._stop_tokens

    def _find_stop(self, text: str, start: int) -> int:
        found = [p for p in (text.find(s, start) for s in self._stop) if p >= 0]
        return min(found) if found else -1

    def _held_back(self, text: str, start: int) -> int:
        """Length of the longest tail of `text[start:]` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text) - start), longest, -1):
                if stop.startswith(text[len(text) - size:]):
                    longest = size
                    break
        return longest

    def _delta(self, text: str) -> str:
        """The part of `text` not sent yet (what follows the longest common prefix, should a tokenizer's
        decode of more ids change text it already gave)."""
        if text.startswith(self.sent):
            return text[len(self.sent):]
        common = 0
        for a, b in zip(text, self.sent):
            if a != b:
                break
            common += 1
        return text[common:]

    def feed(self, token_ids: Sequence[int]) -> str:
        """Append a round's ids; the text that can be sent now ("" if none)."""
        if self.stopped:
            return ""
        start_ids = len(self.ids)
        self.ids.extend(int(i) for i in token_ids)
        text = self._decode(self.ids)
        if self._stop:
            position = self._find_stop(text, len(self.sent))
            if position >= 0:
                self.stopped = True
                self._stop_tokens = self._tokens_to_stop(start_ids)
                delta = self._delta(text[:position])
                self.sent += delta
                return delta
        end = len(text)
        if text.endswith("\ufffd"):
            end = len(text.rstrip("\ufffd"))
        end -= self._held_back(text[:end], len(self.sent))
        delta = self._delta(text[:end]) if end > len(self.sent) else ""
        self.sent += delta
        return delta

    def _tokens_to_stop(self, start_ids: int) -> int:
        """The fewest ids (at least `start_ids + 1`) whose text holds a stop string past what was sent."""
        for count in range(start_ids + 1, len(self.ids)):
            if self._find_stop(self._decode(self.ids[:count]), len(self.sent)) >= 0:
                return count
        return len(self.ids)

    def flush(self) -> str:
        """At the end of the answer: whatever was held back (nothing after a stop string)."""
        if self.stopped:
            return ""
        delta = self._delta(self._decode(self.ids))
        self.sent += delta
        return delta
