"""A lean forward for Llama-style text decoders: transformers' operations, without its per-module Python.

Why: for a small model on a CPU, a sizeable share of a verification forward is transformers' Python around
the tensor operations (module calls, keyword plumbing and decorators per layer, output recording), measured by
running the same operations without it (docs/ops.md has the figures). Plain decoding pays that too; the
speculative loop runs one target forward per round, so it weighs on every round.

What: `lean_forward(model)` returns a callable that runs the model's own modules through the same torch
arithmetic in the same order as `model(...)` does: the embedding module, the rotary module, the RMSNorm
formula, each projection's own `forward` (so `ops.cpu_linear.fast_linears` still applies), rotary embedding
(`rotate_half(x) * sin` as `roll(x) * signed sin`: the same products, fewer operations), the cache's
`update`, the configured attention function with the same arguments, the MLP's activation, the final norm
and the LM head. Its logits, hidden states and cache contents are bitwise those of `model(...)` (tested for
every supported class, with and without the CPU kernels).

Only for what that has been checked on: `LlamaForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM` (dense,
full attention: queries and keys normalized per head before the rotary), and the VLMs whose
forward without pixels is embedding, language model, LM head (a round feeds text tokens only): Llava and
LLaVA-OneVision (a Llama or Qwen2 language model), Qwen2-VL and Qwen2.5-VL (the same layers with
multimodal rotary positions: the rotary module gets the position rows as their text model passes them) and
Qwen3-VL (dense; queries and keys normalized per head; its deepstack visual features enter only with pixels).
Full attention in every layer, eval mode, CPU tensors (the only device it has been measured on), "sdpa",
"eager", the tree sdpa or the query capture of visual selection, the model's own RMSNorm and gated MLP,
plain `nn.Linear` projections, and no hooks (but transformers' own output recorders) or replaced `forward`
on other modules. Anything else gets None (or `applies` False) and the caller runs the model as before;
`use_lean_forward(False)` forces that too.
"""

from __future__ import annotations

import contextvars
import sys

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import CAPTURE_ATTENTION, TREE_SDPA
from .target_states import is_thread_confined
from ..ops import scoped

__all__ = ["lean_forward", "use_lean_forward", "LeanForward"]

_ON = contextvars.ContextVar("hf_adaptive_spec_lean_forward", default=True)
# attention implementations it calls exactly as transformers would (the tree sdpa, and the LaSpec loop's
# query capture for visual selection, which records the query and runs the tree sdpa)
_ATTENTION = ("sdpa", "eager", TREE_SDPA, CAPTURE_ATTENTION)
# text model class -> (decoder layer, RMSNorm, MLP classes by name within its own transformers module, rows of
# multimodal rotary positions its forward makes from 2D ones (None: plain rotary; 4: text positions first),
# whether attention normalizes queries and keys per head)
_SUPPORTED = {
    "LlamaModel": ("LlamaDecoderLayer", "LlamaRMSNorm", "LlamaMLP", None, False),
    "Qwen2Model": ("Qwen2DecoderLayer", "Qwen2RMSNorm", "Qwen2MLP", None, False),
    "Qwen3Model": ("Qwen3DecoderLayer", "Qwen3RMSNorm", "Qwen3MLP", None, True),
    "Qwen2VLTextModel": ("Qwen2VLDecoderLayer", "Qwen2VLRMSNorm", "Qwen2MLP", 3, False),
    "Qwen2_5_VLTextModel": ("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLRMSNorm", "Qwen2MLP", 3, False),
    "Qwen3VLTextModel": ("Qwen3VLTextDecoderLayer", "Qwen3VLTextRMSNorm", "Qwen3VLTextMLP", 4, True),
}
# model classes whose forward, given only input ids (no pixels), is: embed, text model, LM head
_CAUSAL_LM = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")  # text model at `.model`
_VLM = ("LlavaForConditionalGeneration", "LlavaOnevisionForConditionalGeneration",  # at `.model.language_model`
        "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")


def _text_stack(model):
    """`(text model, LM head)` of a supported model class, else None."""
    name = type(model).__name__
    if not type(model).__module__.startswith("transformers.models."):
        return None
    if name in _CAUSAL_LM:
        return model.model, model.lm_head
    if name in _VLM:
        return model.model.language_model, model.lm_head
    return None


def use_lean_forward(on: bool):
    """Inside a `with` block, allow (True, the default) or forbid (False) the lean forward."""
    if not isinstance(on, bool):
        raise ValueError(f"use_lean_forward takes True or False, got {on!r}.")
    return scoped(_ON, on)


def _foreign(hook) -> bool:
    """False for transformers' own output-recording hooks (they record only inside its forward, which
    the lean forward replaces whole) and for this library's thread-confined recorders (another thread's call
    registered them: they never act in this one), True for any other hook."""
    return getattr(hook, "__module__", None) != "transformers.utils.output_capturing" and not is_thread_confined(hook)


def _own(function, modeling, cls) -> bool:
    """Whether `function` is `cls`'s own `forward` as its modeling file defines it (not a swapped-in kernel)."""
    return (cls is not None and getattr(function, "__module__", None) == modeling.__name__
            and getattr(function, "__qualname__", None) == f"{cls.__name__}.forward")


def _unsupported(model) -> str | None:
    """None when `model` can run the lean forward, else why not."""
    stack = _text_stack(model)
    if stack is None or type(stack[0]).__name__ not in _SUPPORTED:
        return f"{type(model).__name__} is not a supported class"
    if model.training:
        return "the model is in training mode"
    inner, lm_head = stack
    config = inner.config
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or ())):
        return "a layer is not full attention"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    modeling = sys.modules[type(inner).__module__]
    spec = _SUPPORTED[type(inner).__name__]
    layer_class, norm_class, mlp_class = (getattr(modeling, cls, None) for cls in spec[:3])
    norms = [inner.norm]
    if len(inner.layers) != config.num_hidden_layers:
        return "the model holds more or fewer layers than its config says"
    if not _own(type(inner).forward, modeling, type(inner)):
        return "the text model's forward is not its modeling file's"
    for layer in inner.layers:
        if type(layer) is not layer_class or not _own(type(layer).forward, modeling, layer_class):
            return f"a decoder layer is a {type(layer).__name__} or has another forward"
        attention, mlp = layer.self_attn, layer.mlp
        if not _own(type(attention).forward, modeling, type(attention)):
            return "an attention's forward is not its modeling file's"
        if getattr(attention, "sliding_window", None) is not None:
            return "a layer has a sliding window"
        if type(mlp) is not mlp_class or not _own(type(mlp).forward, modeling, mlp_class):
            return "an MLP is not the model's own gated MLP"
        projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                       mlp.up_proj, mlp.down_proj)
        if any(type(projection) is not nn.Linear for projection in projections):
            return "a projection is not a plain nn.Linear (adapter or quantized layer)"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if spec[4]:
            norms += [attention.q_norm, attention.k_norm]
        elif hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):
            return "an attention normalizes queries or keys"
    if any(type(norm) is not norm_class or not _own(type(norm).forward, modeling, norm_class) for norm in norms):
        return "a norm is not the model's own RMSNorm"
    if type(lm_head) is not nn.Linear:
        return "the LM head is not a plain nn.Linear"
    hooks = (torch.nn.modules.module._global_forward_hooks, torch.nn.modules.module._global_forward_pre_hooks)
    if any(hooks):
        return "global module hooks are registered"
    for module in model.modules():
        if any(_foreign(hook) for hook in (*module._forward_hooks.values(), *module._forward_pre_hooks.values())):
            return f"a {type(module).__name__} has forward hooks"
        if type(module) is not nn.Linear and "forward" in module.__dict__:
            return f"a {type(module).__name__} has a replaced forward"
        # the Hub `kernels` package (a dependency of transformers >= 5.25, imported with every modeling file)
        # keeps per-instance wrappers of functions such as apply_rotary_pos_emb in `_kernel_funcs`;
        # `kernelize` swaps a kernel in by giving a wrapper (or a norm, caught above) its own `forward`
        for name, function in (getattr(module, "_kernel_funcs", None) or {}).items():
            if "forward" in getattr(function, "__dict__", {}):
                return f"a Hub kernel replaced {name} in a {type(module).__name__}"
    return None


def lean_forward(model) -> LeanForward | None:
    """A `LeanForward` for `model`, or None when it does not apply (see the module docstring)."""
    if not _ON.get() or _unsupported(model) is not None:
        return None
    return LeanForward(model)


def _rms_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    # the RMSNorm classes' formula, same operations in the same order
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


class LeanForward:
    """`model(input_ids=..., attention_mask=mask, position_ids=..., cache=..., use_cache=True, ...)` for one
    supported model (see the module docstring), returning `logits` and optionally `hidden_states`."""

    def __init__(self, model):
        self.model = model
        self.inner, self.lm_head = _text_stack(model)
        _, _, _, self.rope_rows, qk_norm = _SUPPORTED[type(self.inner).__name__]
        self.eager = sys.modules[type(self.inner).__module__].eager_attention_forward
        # the submodules each layer uses, looked up once (nn.Module attribute lookups cost ~1 us each); the
        # projections' `forward` is still read per call, so `fast_linears` patches made later apply
        self.layers = [(layer.input_layernorm, layer.self_attn, layer.self_attn.q_proj, layer.self_attn.k_proj,
                        layer.self_attn.v_proj, layer.self_attn.o_proj, layer.post_attention_layernorm,
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, layer.mlp.act_fn,
                        layer.self_attn.q_norm if qk_norm else None, layer.self_attn.k_norm if qk_norm else None)
                       for layer in self.inner.layers]

    def applies(self, inputs: torch.Tensor) -> bool:
        """Whether a call on `inputs` (any tensor of the call) may run lean: CPU tensors, an attention
        implementation it runs, the switch on."""
        return (_ON.get() and inputs.device.type == "cpu"
                and self.inner.config._attn_implementation in _ATTENTION)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache,
                 logits_to_keep: int = 0, output_hidden_states: bool = False,
                 token_valid: torch.Tensor | None = None, state_indices=None) -> CausalLMOutputWithPast:
        """`token_valid` (`(B, M)` bool, optional; with `logits_to_keep` 0): the real tokens of a padded block.
        Given, the per-token work (embedding, norms, projections, MLP, LM head) runs on the real tokens only,
        packed into one `(m, hidden)` matrix, and only attention and the cache see the padded `(B, M)` layout
        (padding positions get zero queries, keys and values, and zero logits and states). A batch whose rows
        verify trees of different sizes then costs what its real tokens cost, not B times its widest row.
        `state_indices` (iterable of `int`, optional): keep only these hidden-state entries (numbered like
        `hidden_states`), returned as a dict; implies `output_hidden_states`."""
        implementation = self.inner.config._attn_implementation
        if implementation not in _ATTENTION:
            raise RuntimeError(f"the lean forward does not run attention {implementation!r}")
        if token_valid is not None and logits_to_keep:
            raise ValueError("the lean forward packs real tokens only with logits_to_keep=0")
        attention_function = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, self.eager)
        hidden, spread, index = self._embed(input_ids, token_valid)
        rotary, text_positions = self._rotary(hidden, position_ids)
        keep = None if state_indices is None else set(state_indices)
        states = [hidden if keep is None or 0 in keep else None] if (output_hidden_states or keep) else None
        hidden = self._layers(hidden, input_ids.shape, spread, index, rotary, attention_function, attention_mask,
                              text_positions, cache, states, keep)
        return self._head(hidden, spread, logits_to_keep, states, keep)

    def _embed(self, input_ids: torch.Tensor, token_valid: torch.Tensor | None):
        """`(hidden, spread, index)`: the embedded tokens, `(B, M, hidden)`, or with `token_valid` the real
        tokens packed `(m, hidden)` with `spread` (`(m, F)` -> `(B, M, F)`, zeros at padding) and their indices
        `(m,)` in the flattened block; without `token_valid` `spread` and `index` are None."""
        if token_valid is None:
            return self.inner.embed_tokens(input_ids), None, None
        shape = input_ids.shape
        index = token_valid.reshape(-1).nonzero().squeeze(1)  # (m,) real tokens in the flattened block
        hidden = self.inner.embed_tokens(input_ids.reshape(-1).index_select(0, index))

        def spread(packed: torch.Tensor) -> torch.Tensor:  # (m, F) -> (B, M, F), zeros at padding
            full = packed.new_zeros(shape[0] * shape[1], packed.shape[-1])
            return full.index_copy_(0, index, packed).view(*shape, -1)
        return hidden, spread, index

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        """`((cos, signed_sin, half), text_positions)`: the rotary factors `(B, 1, M, head_dim)`, with
        `rotate_half(x) * sin` rewritten as `x.roll(half, -1) * signed_sin`, and the positions attention gets."""
        text_positions = position_ids
        if self.rope_rows:  # as the Qwen-VL text models do: rows for the rotary, text positions for attention
            if position_ids.ndim == 2:
                position_ids = position_ids[None, ...].expand(self.rope_rows, position_ids.shape[0], -1)
            if position_ids.ndim == 3 and position_ids.shape[0] == 4:
                text_positions, position_ids = position_ids[0], position_ids[1:]
            else:
                text_positions = None
        cos, sin = self.inner.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2] exactly ((-a) * b == a * (-b) in IEEE floats):
        # 2 operations per tensor instead of 5
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return (cos, signed_sin, half), text_positions

    def _layers(self, hidden, shape, spread, index, rotary, attention_function, attention_mask, text_positions,
                cache, states, keep) -> torch.Tensor:
        """Every decoder layer over `hidden` (packed when `spread` is given), appending each layer's output to
        `states` (None: none kept; an entry outside `keep` is None). Returns the last layer's output."""
        cos, signed_sin, half = rotary
        for (norm_in, attention, q_proj, k_proj, v_proj, o_proj, norm_post, gate_proj, up_proj, down_proj,
             act_fn, q_norm, k_norm) in self.layers:
            residual = hidden
            hidden = _rms_norm(norm_in, hidden)
            head_shape = (*shape, -1, attention.head_dim)
            query, key, value = q_proj.forward(hidden), k_proj.forward(hidden), v_proj.forward(hidden)
            if spread is not None:
                query, key, value = spread(query), spread(key), spread(value)
            query, key, value = query.view(head_shape), key.view(head_shape), value.view(head_shape)
            if q_norm is not None:  # per head, before the rotary (Qwen3)
                query, key = _rms_norm(q_norm, query), _rms_norm(k_norm, key)
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            query = (query * cos) + (query.roll(half, -1) * signed_sin)
            key = (key * cos) + (key.roll(half, -1) * signed_sin)
            key, value = cache.update(key, value, attention.layer_idx)
            output, _ = attention_function(attention, query, key, value, attention_mask, dropout=0.0,
                                           scaling=attention.scaling, position_ids=text_positions, use_cache=True)
            if spread is None:
                output = output.reshape(*shape, -1).contiguous()
            else:
                output = output.reshape(shape[0] * shape[1], -1).index_select(0, index)
            output = o_proj.forward(output)
            hidden = residual + output
            residual = hidden
            hidden = _rms_norm(norm_post, hidden)
            hidden = down_proj.forward(act_fn(gate_proj.forward(hidden)) * up_proj.forward(hidden))
            hidden = residual + hidden
            if states is not None:
                states.append(hidden if keep is None or len(states) in keep else None)
        return hidden

    def _head(self, hidden, spread, logits_to_keep, states, keep) -> CausalLMOutputWithPast:
        """The final norm and the LM head over the last layer's output, and the kept hidden states (a tuple,
        or a dict by entry with `keep`), spread back to `(B, M, F)` when the tokens were packed."""
        hidden = _rms_norm(self.inner.norm, hidden)
        if states is not None:
            # transformers records the last layer's output after the final norm
            states[-1] = hidden if keep is None or len(self.layers) in keep else None
        if spread is not None:
            logits = spread(self.lm_head.forward(hidden))
            states = [spread(s) if s is not None else None for s in states] if states is not None else None
        else:
            logits = self.lm_head.forward(hidden[:, slice(-logits_to_keep, None), :])
        if states is not None and keep is not None:
            states = {index: state for index, state in enumerate(states) if index in keep}
        elif states is not None:
            states = tuple(states)
        return CausalLMOutputWithPast(logits=logits, hidden_states=states)
