"""A tiny served model for the server and load-generator tests: the tiny random Llama of `tiny_models`, a word
tokenizer over its 128 ids with a chat template (built offline), and a uvicorn server on a free localhost port
in a background thread.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import tiny_models

# ids 0..7 as tiny_models' special ids; then the words the chat template uses; then plain words up to 128
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<image>", "<video>", "<vision_start>", "<vision_end>", "<unk>"]
TEMPLATE_WORDS = ["system", "user", "assistant", ":"]
WORDS = TEMPLATE_WORDS + ["hello", "world", "tell", "me", "a", "story", "about", "cats", "dogs", "the", "sky",
                          "is", "blue", "why", "what", "how"]
WORDS += [f"w{i}" for i in range(tiny_models.VOCAB_SIZE - len(SPECIAL_TOKENS) - len(WORDS))]

CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} :"
    "{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %} <image>{% else %} {{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant :{% endif %}"
)


def build_tokenizer():
    """A `PreTrainedTokenizerFast` over the tiny vocabulary: one id per whitespace-separated word, unknown words
    -> <unk> (7), decode joins words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}
    assert len(vocab) == tiny_models.VOCAB_SIZE
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<image>", "<video>", "<vision_start>", "<vision_end>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_models(strategy: str = "plain"):
    """(target, drafter or None) for `strategy`: the tiny Llama (seed 0, 2 layers) and, to draft, a 1-layer Llama
    with other weights and the same vocabulary."""
    target = tiny_models.build_model("llama", seed=0)
    drafter = None if strategy == "plain" else tiny_models.build_drafter("llama", target, "small")
    return target, drafter


def build_engine(strategy: str = "plain", max_batch: int = 4, max_queue: int = 8, models=None):
    from hf_adaptive_spec.serving.engine import Engine

    target, drafter = models if models is not None else build_models(strategy)
    return Engine(target, drafter, strategy=strategy, max_batch=max_batch, max_queue=max_queue)


def save_tiny_pair(folder, max_position_embeddings: int) -> tuple:
    """(target folder, drafter folder): the tiny target and drafter of `build_models("chain")` saved as HF folders
    with the tokenizer, their context `max_position_embeddings`."""
    target, drafter = build_models("chain")
    tokenizer = build_tokenizer()
    paths = []
    for name, model in (("target", target), ("drafter", drafter)):
        model.config.max_position_embeddings = max_position_embeddings
        path = folder / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return tuple(paths)


def wait_for(condition, what: str, timeout: float = 120.0, interval: float = 0.02, show=None):
    """`condition()`'s first true value, polled every `interval` seconds; an AssertionError naming `what` (and
    `show()`, the last state seen) after `timeout` seconds: a bound on a wait, never a performance threshold."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"; last seen: {show()}" if show else ""))
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(app, timeout: float = 60.0):
    """Serve `app` with uvicorn on a free 127.0.0.1 port in a background thread; yields the base URL. The
    server (and with it the app's lifespan: the engine) stops when the block ends."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
