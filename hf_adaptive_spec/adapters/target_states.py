"""The few hidden states of the target a drafter reads, recorded without asking the model for all of them.

`output_hidden_states=True` keeps every layer's output at every position until the forward returns: for a
long prompt that is `(num_layers + 1) x B x S x hidden` at once, where a LaSpec drafter reads three layers.
`StateCapture` records only the entries it is asked for, numbered as `outputs.hidden_states` numbers them
(0: the first decoder layer's input, l + 1: layer l's output, the last entry after the final norm), through
forward hooks on the decoder's layers that record in the capturing thread only.

Every hook this library puts on a model that a user may share between threads (the target) is
`thread_confined`: it records only the forwards of the thread that registered it and returns None (it changes
nothing), and the lean forward of another thread's call does not count it as a foreign hook.
"""

from __future__ import annotations

import functools
import threading

from torch import nn

from .model_config import text_config

__all__ = ["StateCapture", "decoder_layers", "is_thread_confined", "thread_confined"]

_CONFINED = "_hf_adaptive_spec_thread_confined"


def thread_confined(hook):
    """`hook` (a module hook that records and returns None) acting in the calling thread only: the forwards that
    other threads run on the same module meanwhile neither reach it nor see it (`is_thread_confined`)."""
    owner = threading.get_ident()

    @functools.wraps(hook)
    def confined(*args, **kwargs):
        if threading.get_ident() == owner:
            hook(*args, **kwargs)

    setattr(confined, _CONFINED, True)
    return confined


def is_thread_confined(hook) -> bool:
    """Whether `hook` was made by `thread_confined`."""
    return getattr(hook, _CONFINED, False) is True


def decoder_layers(model):
    """`(layers, final norm or None)` of `model`'s text decoder, or None when they cannot be told apart: the
    `nn.ModuleList` of the decoder (`get_decoder()`) with one entry per decoder layer of its config."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        return None
    count = getattr(text_config(model, decoder=True), "num_hidden_layers", None)
    lists = [child for child in decoder.children() if isinstance(child, nn.ModuleList) and len(child) == count]
    if len(lists) != 1:
        return None
    norms = [getattr(decoder, name, None) for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm")]
    norms = [norm for norm in norms if isinstance(norm, nn.Module)]
    return lists[0], norms[0] if len(norms) == 1 else None


class StateCapture:
    """Records hidden-state entries `indices` of the forwards run inside its `with` block (in this thread).

    Args:
        layers (`nn.ModuleList`): the decoder layers (`decoder_layers`).
        norm (`nn.Module` or None): the final norm, whose output is the last entry.
        indices (iterable of `int`): entries to record, `0..len(layers)`.

        consume (callable, *optional*): `consume(index, tensor)` gets each entry as soon as it is computed,
            instead of `states` keeping it (a drafter that fuses layers as they come).

    After the block, `states` maps each index to its `(B, S, hidden)` tensor (a dict indexed like
    `outputs.hidden_states`), unless `consume` took them.
    """

    def __init__(self, layers, norm, indices, consume=None):
        self.layers, self.norm, self.consume = layers, norm, consume
        self.indices = sorted(set(indices))
        self.states = {}
        self._handles = []

    @classmethod
    def for_model(cls, model, indices, consume=None) -> "StateCapture | None":
        """A capture of `indices` for `model`, or None when its layers (or, for the last entry, its final norm)
        cannot be located: the caller then asks the forward for all hidden states."""
        found = decoder_layers(model)
        if found is None:
            return None
        layers, norm = found
        indices = set(indices)
        if not indices <= set(range(len(layers) + 1)) or (len(layers) in indices and norm is None):
            return None
        return cls(layers, norm, indices, consume)

    def _record(self, index: int, value) -> None:
        value = value[0] if isinstance(value, tuple) else value
        if self.consume is not None:
            self.consume(index, value)
        else:
            self.states[index] = value

    def __enter__(self) -> "StateCapture":
        self.states = {}
        last = len(self.layers)
        for index in self.indices:
            if index == 0:
                def first_input(module, args, kwargs):
                    self._record(0, args[0] if args else kwargs["hidden_states"])
                self._handles.append(self.layers[0].register_forward_pre_hook(thread_confined(first_input),
                                                                              with_kwargs=True))
            else:
                module = self.norm if index == last else self.layers[index - 1]

                def output(module, args, result, index=index):
                    self._record(index, result)
                self._handles.append(module.register_forward_hook(thread_confined(output)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
