"""sdpa for tree verification forwards of grouped-query-attention models, without `repeat_kv`.

A verification forward has several query tokens and an explicit 4D mask. For such calls transformers' sdpa
path (`sdpa_attention_forward`) copies every key/value head `num_key_value_groups` times (`repeat_kv`): for
SmolLM2-135M at 400 cached tokens that is ~110 MB written per forward, while a one-token decoding step
folds the query heads onto their key/value head instead (`pack_gqa`) and copies nothing. The same fold works
for Q > 1 tokens: the n_rep query heads of one key/value head become n_rep * Q query rows of that head and
the head-shared mask is repeated along those rows. It computes the same dot products and softmaxes as the
stock path (outputs measured bitwise equal on SmolLM2) and saves 4-5 ms per verification forward there.

`TREE_SDPA` is registered with transformers' `AttentionInterface` (and sdpa's mask function, which the model
needs to build the mask for a registered implementation); `tree_attention(model)` switches a model's text
attention from "sdpa" to it inside a `with` block. Every call it cannot fold (one token, no or per-head mask,
no grouped heads, dropout, softcap, sinks, position bias, and for now any device but the CPU, the only one
it has been measured on) is handed to transformers' own sdpa function.

The switch is a property of the model, shared by every thread, so what the registered function does is
decided by the calling context instead (`library_attention_forward`): it folds only inside this thread's
speculative call and is transformers' sdpa everywhere else; switches are reference-counted, so concurrent
speculative calls on one model do not undo each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..ops import tensor_version
from .model_config import text_config

__all__ = ["CAPTURE_ATTENTION", "TREE_SDPA", "library_attention_forward", "recording_queries", "register_tree_attention",
           "switched_attention", "text_attention", "tree_attention", "tree_sdpa_attention"]

TREE_SDPA = "hf_adaptive_spec_tree_sdpa"
# the implementation a model runs while its queries are captured (`drafters.vision.QueryCapture`): the tree sdpa
CAPTURE_ATTENTION = TREE_SDPA
# arguments that change what sdpa_attention_forward computes: calls with any of them set go to it unchanged
_SPECIAL_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "head_mask", "alibi")


def _foldable(module, query, key, value, attention_mask, dropout, kwargs) -> int:
    """n_rep when the call can run with query heads folded onto their key/value head, else 0."""
    n_rep = getattr(module, "num_key_value_groups", 1)
    if query.device.type != "cpu":  # measured on CPUs only so far
        return 0
    if not isinstance(n_rep, int) or n_rep <= 1 or query.shape[2] <= 1 or dropout:
        return 0
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return 0
    if key.shape[1] * n_rep != query.shape[1] or value.shape[1] != key.shape[1]:
        return 0
    if kwargs.get("output_attentions") or any(kwargs.get(name) is not None for name in _SPECIAL_KWARGS):
        return 0
    return n_rep


# per thread: (mask, its version, arguments, folded mask): every layer of one forward folds the same mask
_FOLDED = threading.local()
# this context's speculative forwards fold grouped-query heads; recorders of queries (`vision.QueryCapture`)
_FOLD: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_adaptive_spec_fold", default=False)
_RECORDERS: contextvars.ContextVar[tuple] = contextvars.ContextVar("hf_adaptive_spec_query_recorders", default=())


def _folded_mask(attention_mask, batch: int, n_rep: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The head-shared mask repeated for the n_rep folded query heads `(B, 1, n_rep * Q, K)`, made once per
    mask (the same tensor, unmodified: identity and version are checked) and shared by the layers."""
    arguments = (batch, n_rep, q_len, kv_len)
    version = tensor_version(attention_mask)
    cached = getattr(_FOLDED, "entry", None)
    if cached is not None and cached[0] is attention_mask and cached[1] == version and cached[2] == arguments:
        return cached[3]
    mask = attention_mask[..., :kv_len].expand(batch, 1, q_len, kv_len)
    mask = mask.unsqueeze(2).expand(batch, 1, n_rep, q_len, kv_len).reshape(batch, 1, n_rep * q_len, kv_len)
    _FOLDED.entry = (attention_mask, version, arguments, mask)
    return mask


def tree_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention function (transformers' signature): `(attn_output (B, Q, H, D), None)`."""
    n_rep = _foldable(module, query, key, value, attention_mask, dropout, kwargs)
    if not n_rep:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, **kwargs)
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    folded = query.reshape(batch, kv_heads, n_rep * q_len, head_dim)  # head h -> kv head h // n_rep, as repeat_kv
    mask = _folded_mask(attention_mask, batch, n_rep, q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, head_dim).transpose(1, 2).contiguous(), None


def library_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The attention function registered as `TREE_SDPA`: what it does is decided per context, never per model.

    Inside a speculative call of this thread (`tree_attention`, `QueryCapture`), it hands the query to the
    active recorders and runs `tree_sdpa_attention`; anywhere else (another thread's plain `generate` on the
    same model while a speculative call holds it switched) it is transformers' own sdpa, bitwise the stock call.
    """
    recorders = _RECORDERS.get()
    for record in reversed(recorders):
        if record(module, query, key):
            break
    if _FOLD.get() or recorders:
        return tree_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def register_tree_attention() -> str:
    """Register `TREE_SDPA` (attention and its sdpa mask); idempotent."""
    AttentionInterface.register(TREE_SDPA, library_attention_forward)
    AttentionMaskInterface.register(TREE_SDPA, sdpa_mask)
    return TREE_SDPA


def _text_config_key(config) -> str | None:
    """Name of the sub-config holding the text model (None for a plain LM)."""
    text = text_config(config)
    if text is config:
        return None
    for key in config.sub_configs:
        if getattr(config, key, None) is text:
            return key
    raise ValueError(f"Cannot find the text sub-config of {type(config).__name__} among {list(config.sub_configs)}.")


def text_attention(model) -> str | None:
    """The text attention implementation `model` runs outside speculative calls: "sdpa" while a speculative
    call (of any thread) holds it switched to `TREE_SDPA`."""
    name = getattr(text_config(model), "_attn_implementation", None)
    return "sdpa" if name == TREE_SDPA else name


# id(model) -> how many speculative calls hold its text attention switched to TREE_SDPA
_SWITCHED: dict[int, int] = {}
_SWITCH_LOCK = threading.Lock()


def _set_text_attention(model, name: str) -> None:
    config = model.config
    key = _text_config_key(config)
    if key is None:
        model.set_attn_implementation(name)
    else:
        current = {sub: getattr(config, sub)._attn_implementation
                   for sub in config.sub_configs if getattr(config, sub, None) is not None}
        model.set_attn_implementation({**current, key: name})


@contextlib.contextmanager
def switched_attention(model):
    """Hold `model`'s text attention on `TREE_SDPA` (registered here) inside the block; it must run "sdpa".

    Reference-counted across threads: the first call in switches, the last one out switches back to "sdpa".
    Switching is safe for every other caller because `TREE_SDPA` runs stock sdpa outside speculative contexts.
    """
    if text_attention(model) != "sdpa":
        raise ValueError(f"{type(model).__name__} runs attention {text_attention(model)!r}; switching needs sdpa.")
    register_tree_attention()
    with _SWITCH_LOCK:
        if _SWITCHED.get(id(model), 0) == 0:
            _set_text_attention(model, TREE_SDPA)
        _SWITCHED[id(model)] = _SWITCHED.get(id(model), 0) + 1
    try:
        yield model
    finally:
        with _SWITCH_LOCK:
            _SWITCHED[id(model)] -= 1
            if _SWITCHED[id(model)] == 0:
                del _SWITCHED[id(model)]
                _set_text_attention(model, "sdpa")


@contextlib.contextmanager
def recording_queries(record):
    """Inside the block, `record(module, query, key)` sees every query (and the keys it attends to) of a
    `TREE_SDPA` forward of this context (innermost recorder first; it returns True to stop the search)."""
    token = _RECORDERS.set(_RECORDERS.get() + (record,))
    try:
        yield
    finally:
        _RECORDERS.reset(token)


def tree_attention(model):
    """A context in which `model`'s text attention folds grouped-query heads in this thread's forwards, when
    it runs "sdpa" (else a no-op). Other threads keep running stock sdpa on the same model."""
    if model is None or not getattr(model, "_supports_attention_backend", False) or text_attention(model) != "sdpa":
        return contextlib.nullcontext()
    return _folding(model)


@contextlib.contextmanager
def _folding(model):
    """Switch `model`, fold in this context, then drop the folded mask kept for the last forward's layers."""
    token = _FOLD.set(True)
    try:
        with switched_attention(model):
            yield
    finally:
        _FOLD.reset(token)
        _FOLDED.entry = None
