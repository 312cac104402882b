"""The target's cache as `generate(return_dict_in_generate=True)` returns it.

Plain `generate` returns a cache with one slot per token of `sequences` but the last: slot j of row b holds
`sequences[b, j]`, left padding included. The decoding loop keeps rows rectangular with masked holes and ends
with the last round's tree still in the cache, uncommitted; `returned_cache` commits what that round emitted
and lays the slots out like plain generate, so the cache continues generation as plain generate's would.

Differences from plain generate's cache: the values come from tree verification (the same math, fp rounding
may differ), and a row that ended before the longest one (EOS, a stopping criterion) has zeros in the slots
from its last token on, where plain generate, which keeps stepping finished rows, holds the pad tokens it fed.
Sliding-window and chunked layers come back as plain generate's `DynamicSlidingWindowLayer`s, holding the
same `size - 1` last slots (`windows.to_plain_layers`; slots of left padding hold zeros there).
"""

from __future__ import annotations

from dataclasses import fields

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

# the output field that carries the cache: transformers 5.24 renamed `past_key_values` to `cache`
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(GenerateDecoderOnlyOutput)} else "past_key_values"


def commit_last_round(target, last_round=None) -> None:
    """Commit the path slots of all tokens but the last that a final, uncommitted round emitted (`last_round` as
    in `returned_cache`; None: nothing to commit)."""
    if last_round is not None:
        path_index, counts = last_round
        keep = max(int(counts.max()), 1)
        target.commit(path_index[:, :keep], torch.arange(keep, device=counts.device)[None, :] < counts[:, None])


def returned_cache(target, buffer, last_round=None):
    """`target`'s cache (a `ModelRunner`'s), laid out for `buffer.sequences()`; the cache object is updated in place.

    Args:
        target (`ModelRunner`): the target and its cache.
        buffer (`SequenceBuffer`): the committed tokens of every row.
        last_round (`tuple`, *optional*): `(path_index, counts)` of a round whose tree is still in the cache
            uncommitted: each row's accepted path `(B, 1 + D)` (the root first) and how many tokens it emitted
            `(B,)`. The path slots of all emitted tokens but the last are kept.
    """
    cache = target.cache
    commit_last_round(target, last_round)
    prompt_length = buffer.prompt_length
    lengths = buffer.lengths
    width = int(lengths.max()) - 1  # plain generate's cache length
    pads = (~target.slot_valid[:, :prompt_length]).sum(-1)
    target.plain_windowed_layers(width, pads)
    generated = target.slot_valid[:, prompt_length:]
    if target.committed_length == width and bool(generated.all()):
        return cache  # every row committed the same tokens without holes: already plain generate's layout
    batch = generated.shape[0]
    device = generated.device
    # each row's committed slots past the prompt, in order (holes last), cut to the longest row's count
    order = torch.argsort((~generated).to(torch.int8), dim=1, stable=True)[:, : max(width - prompt_length, 0)]
    index = torch.cat([torch.arange(prompt_length, device=device).expand(batch, -1), order + prompt_length], dim=1)
    index = index[:, :width]
    real = (torch.arange(width, device=device)[None, :] < (lengths - 1)[:, None])[:, None, :, None]  # (B, 1, W, 1)
    for layer in (cache.layers[i] for i in target.full_layers):  # (each on its own device where the model is split)
        layer.keys, layer.values = (
            torch.where(real.to(t.device),
                        t.gather(2, index.to(t.device)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])), 0)
            for t in (layer.keys, layer.values)
        )
    return cache
