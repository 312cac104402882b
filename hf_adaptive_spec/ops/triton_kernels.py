"""Triton kernels for the per-round ops; `reference.py` is their specification.

Every public function here has exactly the signature of the torch reference of
the same name and returns the same values: bitwise for integer and bool
outputs (and for the blocked value of the mask, `finfo(dtype).min`), allclose
for float outputs. The dispatcher in `hf_adaptive_spec.ops` imports this
module lazily, only when a Triton kernel is about to run, so `import triton`
here never happens on a CPU-only install.

Kernels (one per op, or a fused pair):

* `ancestor_matrix`, `tree_attention_mask`, `greedy_accept`: one program per
  tree row. The ancestor-or-self relation of a tree of up to
  `MAX_TREE_NODES` nodes is built in registers as a `(BLOCK_N, BLOCK_N)` tile
  by walking every node's parent chain in lockstep (the loop ends at the
  deepest root), so no `(B, N, N)` intermediate ever reaches global memory.
  The mask kernel also tiles the committed-slot part of the key axis over a
  second grid axis.
* `compact_kv_`: one launch for all layers that share a shape/stride/dtype
  (normally all of them): a device table holds every layer's data pointer;
  one program owns one `(layer, row, head, D-block)` slab, loads all kept
  slots, waits on a CTA barrier, then stores, so the in-place gather is
  race-free for any `keep_index` (unsorted, duplicated).
* `sage_confidence`: a fused pair. Stage 1 splits the vocabulary into blocks
  and keeps each block's top-`k` logits (a bitonic `tl.topk`); stage 2 merges
  the candidates, takes the exact top-`k`, and computes the normalised entropy.
* `quantize_int8`: one program per `(row, head, token block)`, IEEE division
  and round-half-to-even exactly like `torch.round`, so the int8 values are
  bitwise equal to the reference.
* `visual_scores`: a fused pair. Stage 1 (per row, KV head, token block)
  dequantises the int8 keys once for all query heads of the GQA group, writes
  the logits and per-block softmax partials; stage 2 (per row, token block)
  combines the partials and averages the probabilities over heads.
* `visual_vote` stays torch: it is two `topk` calls and a scatter over at most
  `(L, B, T)` scores, already a handful of library kernels, and a Triton
  top-k would have to reproduce torch's tie order to return the same indices.
  The dispatcher falls back to the reference for it.

Trees larger than `MAX_TREE_NODES` and top-k larger than `MAX_SAGE_TOP_K`
fall back to the reference (same results, torch speed).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import reference

__all__ = [
    "ancestor_matrix",
    "tree_attention_mask",
    "compact_kv_",
    "sage_confidence",
    "greedy_accept",
    "quantize_int8",
    "visual_scores",
    "MAX_TREE_NODES",
    "MAX_SAGE_TOP_K",
]

MAX_TREE_NODES = 128  # the (BLOCK_N, BLOCK_N) ancestor tile lives in registers
MAX_SAGE_TOP_K = 64
SAGE_BLOCK_V = 4096  # vocabulary block of the SAGE stage-1 kernel (tests shrink it to cover the merge)
_MASK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # finfo.min is exact in fp32


def _next_pow2(value: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(max(1, value)))


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when its last dim is unit-stride (other strides are passed to the kernel), else a copy."""
    return tensor if tensor.stride(-1) == 1 or tensor.shape[-1] <= 1 else tensor.contiguous()


def _bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor viewed as uint8, so kernels load plain bytes."""
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _tree_warps(num_nodes: int) -> int:
    return 8 if num_nodes > 64 else 4  # a 128x128 ancestor tile spills with 4 warps


def _check_tree(parents: torch.Tensor, *others: torch.Tensor) -> None:
    assert parents.dim() == 2, f"parents must be (B, N), got {tuple(parents.shape)}"
    assert not parents.is_floating_point(), f"parents must be an integer tensor, got {parents.dtype}"
    for other in others:
        assert other.shape == parents.shape, f"expected {tuple(parents.shape)}, got {tuple(other.shape)}"
        assert other.device == parents.device, "all tree tensors must live on one device"


# --------------------------------------------------------------------------- trees


@triton.jit
def _ancestor_tile(parents_row_ptr, N, BLOCK_N: tl.constexpr):
    """`anc[i, j]`: j is i or an ancestor of i (i, j < N); `depth[i]`: number of ancestors of i.

    Every node walks up its parent chain in lockstep; the loop stops when all
    walks reached a root (at most N steps, so a malformed cyclic input ends too).
    """
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    in_tree = rows < N
    anc = (rows[:, None] == cols[None, :]) & in_tree[:, None]
    cur = tl.load(parents_row_ptr + rows, mask=in_tree, other=-1).to(tl.int32)
    cur = tl.where((cur >= 0) & (cur < N), cur, -1)
    steps = 0
    while (tl.max(cur, axis=0) >= 0) & (steps < N):
        anc = anc | (cols[None, :] == cur[:, None])
        up = cur >= 0
        cur = tl.load(parents_row_ptr + cur, mask=up, other=-1).to(tl.int32)
        cur = tl.where(up & (cur >= 0) & (cur < N), cur, -1)
        steps += 1
    depth = tl.sum(anc.to(tl.int32), axis=1) - 1
    return anc, depth


@triton.jit
def _ancestor_matrix_kernel(
    parents_ptr, anc_ptr, depth_ptr, N,
    stride_pb, stride_ab, stride_ai, stride_db,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    anc, depth = _ancestor_tile(parents_ptr + b * stride_pb, N, BLOCK_N)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    tile_mask = (rows[:, None] < N) & (cols[None, :] < N)
    tl.store(anc_ptr + b * stride_ab + rows[:, None] * stride_ai + cols[None, :], anc.to(tl.uint8), mask=tile_mask)
    tl.store(depth_ptr + b * stride_db + rows, depth.to(tl.int64), mask=rows < N)


def ancestor_matrix(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `reference.ancestor_matrix`: one program per tree."""
    _check_tree(parents)
    batch, num_nodes = parents.shape
    if batch == 0 or num_nodes == 0 or num_nodes > MAX_TREE_NODES:
        return reference.ancestor_matrix(parents)
    parents = _unit_stride(parents)
    ancestors = torch.empty(batch, num_nodes, num_nodes, dtype=torch.bool, device=parents.device)
    depths = torch.empty(batch, num_nodes, dtype=torch.int64, device=parents.device)
    anc_bytes = ancestors.view(torch.uint8)
    _ancestor_matrix_kernel[(batch,)](
        parents, anc_bytes, depths, num_nodes,
        parents.stride(0), anc_bytes.stride(0), anc_bytes.stride(1), depths.stride(0),
        BLOCK_N=_next_pow2(num_nodes, 16), num_warps=_tree_warps(num_nodes),
    )
    return ancestors, depths


@triton.jit
def _tree_mask_kernel(
    parents_ptr, valid_ptr, slot_valid_ptr, mask_ptr, depth_ptr,
    N, S, M,
    stride_pb, stride_vb, stride_sb, stride_mb, stride_mq, stride_mk, stride_db,
    MIN_VALUE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Grid (B, cdiv(S, BLOCK_S) + 1): slot-column blocks first, the last program per row does the tree block."""
    b = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    mask_row = mask_ptr + b * stride_mb
    if block < tl.cdiv(S, BLOCK_S):
        # committed slots: the same allowed/blocked value for every query row
        # (names differ from the tree branch: Triton wants one type per name across branches)
        slot_cols = block * BLOCK_S + tl.arange(0, BLOCK_S)
        slot_ok = tl.load(slot_valid_ptr + b * stride_sb + slot_cols, mask=slot_cols < S, other=0) != 0
        slot_values = tl.where(slot_ok, 0.0, MIN_VALUE)
        queries = tl.arange(0, BLOCK_M)
        slot_tile = tl.broadcast_to(slot_values[None, :], (BLOCK_M, BLOCK_S))
        tl.store(
            mask_row + queries[:, None] * stride_mq + slot_cols[None, :] * stride_mk,
            slot_tile.to(mask_ptr.dtype.element_ty),
            mask=(queries[:, None] < M) & (slot_cols[None, :] < S),
        )
    else:
        anc, depth = _ancestor_tile(parents_ptr + b * stride_pb, N, BLOCK_N)
        rows = tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_N)
        valid_rows = tl.load(valid_ptr + b * stride_vb + rows, mask=rows < N, other=0) != 0
        valid_cols = tl.load(valid_ptr + b * stride_vb + cols, mask=cols < N, other=0) != 0
        allowed = (anc & valid_rows[:, None] & valid_cols[None, :]) | (rows[:, None] == cols[None, :])
        values = tl.where(allowed, 0.0, MIN_VALUE)
        query = rows - (N - M)  # node i is query row i - (N - M); earlier nodes are not queries
        tl.store(
            mask_row + query[:, None] * stride_mq + (S + cols[None, :]) * stride_mk,
            values.to(mask_ptr.dtype.element_ty),
            mask=(query[:, None] >= 0) & (rows[:, None] < N) & (cols[None, :] < N),
        )
        tl.store(depth_ptr + b * stride_db + rows, depth.to(tl.int64), mask=rows < N)


def tree_attention_mask(
    parents: torch.Tensor,
    valid: torch.Tensor,
    slot_valid: torch.Tensor,
    dtype: torch.dtype,
    num_query: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `reference.tree_attention_mask`.

    `out`, optional: a preallocated `(B, 1, num_query, S + N)` buffer of `dtype`
    (any strides) the mask is written into and returned.
    """
    _check_tree(parents, valid)
    batch, num_nodes = parents.shape
    assert slot_valid.dim() == 2 and slot_valid.shape[0] == batch, "slot_valid must be (B, S)"
    num_slots = slot_valid.shape[1]
    num_query = num_nodes if num_query is None else num_query
    assert 0 <= num_query <= num_nodes, f"num_query must be in [0, {num_nodes}], got {num_query}"
    shape = (batch, 1, num_query, num_slots + num_nodes)
    if out is not None:
        assert tuple(out.shape) == shape, f"out must have shape {shape}, got {tuple(out.shape)}"
        assert out.dtype == dtype and out.device == parents.device, "out must have the mask's dtype and device"
    if batch == 0 or num_nodes == 0 or num_nodes > MAX_TREE_NODES or dtype not in _MASK_DTYPES:
        mask, depths = reference.tree_attention_mask(parents, valid, slot_valid, dtype, num_query)
        if out is None:
            return mask, depths
        out.copy_(mask)
        return out, depths
    parents, valid, slot_valid = _unit_stride(parents), _unit_stride(_bytes(valid)), _unit_stride(_bytes(slot_valid))
    mask = torch.empty(shape, dtype=dtype, device=parents.device) if out is None else out
    depths = torch.empty(batch, num_nodes, dtype=torch.int64, device=parents.device)
    block_n = _next_pow2(num_nodes, 16)
    block_m = _next_pow2(num_query, 1)
    block_s = min(_next_pow2(num_slots, 16), max(16, 8192 // block_m))
    grid = (batch, triton.cdiv(num_slots, block_s) + 1)
    _tree_mask_kernel[grid](
        parents, valid, slot_valid, mask, depths,
        num_nodes, num_slots, num_query,
        parents.stride(0), valid.stride(0), slot_valid.stride(0),
        mask.stride(0), mask.stride(2), mask.stride(3), depths.stride(0),
        MIN_VALUE=torch.finfo(dtype).min,
        BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_S=block_s, num_warps=_tree_warps(num_nodes),
    )
    return mask, depths


@triton.jit
def _greedy_accept_kernel(
    tokens_ptr, parents_ptr, valid_ptr, choice_ptr, path_ptr, length_ptr, bonus_ptr,
    N, L,
    stride_tb, stride_pb, stride_vb, stride_cb, stride_ob,
    BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    parents_row = parents_ptr + b * stride_pb
    choice_row = choice_ptr + b * stride_cb
    anc, depth = _ancestor_tile(parents_row, N, BLOCK_N)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    in_tree = rows < N
    parent = tl.maximum(tl.load(parents_row + rows, mask=in_tree, other=0), 0)
    parent_choice = tl.load(choice_row + parent, mask=in_tree, other=0)
    token = tl.load(tokens_ptr + b * stride_tb + rows, mask=in_tree, other=0)
    valid = tl.load(valid_ptr + b * stride_vb + rows, mask=in_tree, other=0) != 0
    correct = (valid & (token == parent_choice)) | (rows == 0)  # the root is already committed
    # reachable: every ancestor-or-self is correct
    broken = anc & (correct == 0)[None, :]
    reachable = (tl.max(broken.to(tl.int32), axis=1) == 0) & in_tree
    score = tl.where(reachable, depth * N + (N - 1 - rows), -1)
    best = tl.argmax(score, axis=0, tie_break_left=True)
    length = tl.sum(tl.where(rows == best, depth, 0), axis=0)
    tl.store(length_ptr + b, length.to(tl.int64))
    tl.store(bonus_ptr + b, tl.load(choice_row + best))
    # the best node's ancestors, one per level (lowest index first, like the reference's argmax)
    best_anc = tl.max(tl.where(rows[:, None] == best, anc.to(tl.int32), 0), axis=0) != 0
    for level0 in range(0, L, BLOCK_L):
        levels = level0 + tl.arange(0, BLOCK_L)
        on_level = best_anc[None, :] & (depth[None, :] == levels[:, None]) & (cols[None, :] < N)
        first = tl.min(tl.where(on_level, cols[None, :], BLOCK_N), axis=1)
        node = tl.where(first < BLOCK_N, first, best)
        tl.store(path_ptr + b * stride_ob + levels, node.to(tl.int64), mask=levels < L)


def greedy_accept(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    target_choice: torch.Tensor,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `reference.greedy_accept`: one program per tree."""
    _check_tree(parents, tokens, valid, target_choice)
    batch, num_nodes = tokens.shape
    if batch == 0 or num_nodes == 0 or num_nodes > MAX_TREE_NODES or max_depth < 0:
        return reference.greedy_accept(tokens, parents, valid, target_choice, max_depth)
    tokens, parents = _unit_stride(tokens), _unit_stride(parents)
    valid, target_choice = _unit_stride(_bytes(valid)), _unit_stride(target_choice)
    levels = max_depth + 1
    path = torch.empty(batch, levels, dtype=torch.int64, device=tokens.device)
    length = torch.empty(batch, dtype=torch.int64, device=tokens.device)
    bonus = torch.empty(batch, dtype=target_choice.dtype, device=tokens.device)
    _greedy_accept_kernel[(batch,)](
        tokens, parents, valid, target_choice, path, length, bonus,
        num_nodes, levels,
        tokens.stride(0), parents.stride(0), valid.stride(0), target_choice.stride(0), path.stride(0),
        BLOCK_N=_next_pow2(num_nodes, 16), BLOCK_L=min(_next_pow2(levels, 16), 64), num_warps=_tree_warps(num_nodes),
    )
    return path, length, bonus


# --------------------------------------------------------------------------- KV-cache compaction


@triton.jit
def _compact_kv_kernel(
    table_ptr, like_ptr, keep_ptr,
    start, K, B, H, D,
    stride_b, stride_h, stride_l, stride_d, stride_kb,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (layers * B * H, cdiv(D, BLOCK_D)); `table_ptr[layer]` is that layer's data pointer."""
    pid = tl.program_id(0)
    head = pid % H
    row = (pid // H) % B
    layer = pid // (H * B)
    base = tl.load(table_ptr + layer).to(like_ptr.dtype)  # int64 address -> typed pointer
    base += row.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h
    k = tl.arange(0, BLOCK_K)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tile_mask = (k[:, None] < K) & (d[None, :] < D)
    source = start + tl.load(keep_ptr + row.to(tl.int64) * stride_kb + k, mask=k < K, other=0)
    values = tl.load(base + source[:, None] * stride_l + d[None, :] * stride_d, mask=tile_mask)
    # every thread of the program has read its slots before any slot is overwritten
    tl.debug_barrier()
    tl.store(base + (start + k)[:, None] * stride_l + d[None, :] * stride_d, values, mask=tile_mask)


_POINTER_TABLES: dict[tuple, torch.Tensor] = {}
_POINTER_TABLES_MAX = 16


def _pointer_table(group: list[torch.Tensor]) -> torch.Tensor:
    """Device int64 tensor of the tensors' data pointers, cached by address (a table only holds addresses).

    A miss costs one small pinned, non-blocking host-to-device copy on the current stream (no sync);
    a static cache (stable addresses) always hits.
    """
    device = group[0].device
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, tuple(t.data_ptr() for t in group))
    table = _POINTER_TABLES.get(key)
    if table is None:
        host = torch.tensor(key[2], dtype=torch.int64)
        if device.type == "cuda":
            table = host.pin_memory().to(device, non_blocking=True)
        else:
            table = host.to(device)
        if len(_POINTER_TABLES) >= _POINTER_TABLES_MAX:
            _POINTER_TABLES.pop(next(iter(_POINTER_TABLES)))
        _POINTER_TABLES[key] = table
    return table


def compact_kv_(tensors: list[torch.Tensor], keep_index: torch.Tensor, start: int) -> list[torch.Tensor]:
    """Triton `reference.compact_kv_`, in place.

    All layers with the same shape, strides and dtype (normally all of them) go
    in ONE launch through a device table of data pointers; layers that differ
    form further groups, one launch each.
    """
    tensors = list(tensors)
    if not tensors:
        return []
    assert keep_index.dim() == 2, f"keep_index must be (B, K), got {tuple(keep_index.shape)}"
    assert not keep_index.is_floating_point(), "keep_index must be an integer tensor"
    batch, kept = keep_index.shape
    assert start >= 0, f"start must be >= 0, got {start}"
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        assert tensor.dim() == 4, f"KV tensors must be (B, H, L, D), got {tuple(tensor.shape)}"
        assert tensor.shape[0] == batch, f"KV batch {tensor.shape[0]} != keep_index batch {batch}"
        assert start + kept <= tensor.shape[2], f"start + K = {start + kept} exceeds the cache length {tensor.shape[2]}"
        assert tensor.device == keep_index.device, "KV tensors and keep_index must live on one device"
        groups.setdefault((tuple(tensor.shape), tensor.stride(), tensor.dtype), []).append(tensor)
    if kept > 0 and batch > 0:
        keep_index = _unit_stride(keep_index)
        for (shape, strides, _), group in groups.items():
            _, heads, _, dim = shape
            if heads == 0 or dim == 0:
                continue
            block_k = _next_pow2(kept, 1)
            block_d = min(_next_pow2(dim, 16), max(16, 4096 // block_k))  # <= 32 values per thread
            grid = (len(group) * batch * heads, triton.cdiv(dim, block_d))
            _compact_kv_kernel[grid](
                _pointer_table(group), group[0], keep_index,
                start, kept, batch, heads, dim,
                strides[0], strides[1], strides[2], strides[3], keep_index.stride(0),
                BLOCK_K=block_k, BLOCK_D=block_d,
            )
    return [tensor[:, :, : start + kept] for tensor in tensors]


# --------------------------------------------------------------------------- SAGE confidence


@triton.jit
def _sage_block_topk_kernel(
    logits_ptr, cand_ptr, V, stride_lb, stride_cb,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (B, cdiv(V, BLOCK_V)): the BLOCK_K largest logits of one vocabulary block."""
    b = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(logits_ptr + b * stride_lb + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    top = tl.topk(x, BLOCK_K)
    tl.store(cand_ptr + b * stride_cb + block * BLOCK_K + tl.arange(0, BLOCK_K), top)


@triton.jit
def _sage_entropy_kernel(
    cand_ptr, out_ptr, num_cand, top_k, inv_log_k, stride_cb,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (B,): exact top-k of the candidates, softmax over them, 1 - H / log k."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    cand = tl.load(cand_ptr + b * stride_cb + offs, mask=offs < num_cand, other=float("-inf"))
    top = tl.topk(cand, BLOCK_K)  # sorted, largest first
    in_k = tl.arange(0, BLOCK_K) < top_k
    peak = tl.max(top, axis=0)
    weights = tl.where(in_k, tl.exp(top - peak), 0.0)
    probs = weights / tl.sum(weights, axis=0)
    entropy = -tl.sum(tl.where(in_k, probs * tl.log(tl.maximum(probs, 1e-30)), 0.0), axis=0)
    # NaN-propagating clamp like torch's: a row without a finite logit gives NaN, as in the reference
    alpha = tl.maximum(1.0 - entropy * inv_log_k, 0.0, propagate_nan=tl.PropagateNan.ALL)
    alpha = tl.minimum(alpha, 1.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + b, alpha)


def sage_confidence(logits: torch.Tensor, top_k: int = 10) -> torch.Tensor:
    """Triton `reference.sage_confidence`: block top-k, then merge + entropy (two launches)."""
    assert logits.dim() == 2, f"logits must be (B, V), got {tuple(logits.shape)}"
    assert logits.is_floating_point(), f"logits must be floating point, got {logits.dtype}"
    batch, vocab = logits.shape
    top_k = min(top_k, vocab)
    if top_k <= 1:
        return torch.ones(batch, dtype=torch.float32, device=logits.device)
    if batch == 0 or top_k > MAX_SAGE_TOP_K:
        return reference.sage_confidence(logits, top_k)
    logits = _unit_stride(logits)
    block_k = _next_pow2(top_k, 2)
    # at most 128 vocabulary blocks per row, so the merge stage loads <= 128 * BLOCK_K candidates
    block_v = max(block_k, min(SAGE_BLOCK_V, _next_pow2(vocab)), _next_pow2(triton.cdiv(vocab, 128)))
    num_blocks = triton.cdiv(vocab, block_v)
    candidates = torch.empty(batch, num_blocks * block_k, dtype=torch.float32, device=logits.device)
    _sage_block_topk_kernel[(batch, num_blocks)](
        logits, candidates, vocab, logits.stride(0), candidates.stride(0),
        BLOCK_V=block_v, BLOCK_K=block_k,
    )
    out = torch.empty(batch, dtype=torch.float32, device=logits.device)
    _sage_entropy_kernel[(batch,)](
        candidates, out, num_blocks * block_k, top_k, 1.0 / math.log(top_k), candidates.stride(0),
        BLOCK_C=_next_pow2(num_blocks * block_k), BLOCK_K=block_k,
    )
    return out


# --------------------------------------------------------------------------- visual token selection


@triton.jit
def _round_half_even(x):
    """`torch.round` (ties to even) for |x| < 2**22, from floor only."""
    floor = tl.floor(x)
    frac = x - floor
    odd = floor - 2.0 * tl.floor(floor * 0.5)  # 1.0 when floor is odd
    return tl.where(frac > 0.5, floor + 1.0, tl.where(frac < 0.5, floor, floor + odd))


@triton.jit
def _quantize_int8_kernel(
    keys_ptr, q_ptr, scale_ptr, H, T, D,
    stride_kb, stride_kh, stride_kt, stride_kd,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (B * H, cdiv(T, BLOCK_T)); outputs are contiguous (B, H, T, D) and (B, H, T, 1)."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    tile_mask = (t[:, None] < T) & (d[None, :] < D)
    x = tl.load(
        keys_ptr + b * stride_kb + h * stride_kh + t[:, None] * stride_kt + d[None, :] * stride_kd,
        mask=tile_mask, other=0.0,
    ).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full(amax.shape, 127.0, tl.float32))
    q = _round_half_even(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    row = bh.to(tl.int64) * T + t
    tl.store(q_ptr + row[:, None] * D + d[None, :], q.to(tl.int8), mask=tile_mask)
    tl.store(scale_ptr + row, scale, mask=t < T)


def quantize_int8(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `reference.quantize_int8` (bitwise equal int8 values and scales)."""
    assert keys.dim() == 4, f"keys must be (B, H, T, D), got {tuple(keys.shape)}"
    assert keys.is_floating_point(), f"keys must be floating point, got {keys.dtype}"
    batch, heads, tokens, dim = keys.shape
    if keys.numel() == 0 or dim > 1024 or keys.dtype == torch.float64:
        return reference.quantize_int8(keys)
    quantized = torch.empty(batch, heads, tokens, dim, dtype=torch.int8, device=keys.device)
    scale = torch.empty(batch, heads, tokens, 1, dtype=torch.float32, device=keys.device)
    block_d = _next_pow2(dim, 16)
    block_t = max(1, min(_next_pow2(tokens), 4096 // block_d))
    _quantize_int8_kernel[(batch * heads, triton.cdiv(tokens, block_t))](
        keys, quantized, scale, heads, tokens, dim, *keys.stride(),
        BLOCK_T=block_t, BLOCK_D=block_d,
    )
    return quantized, scale


@triton.jit
def _visual_logits_kernel(
    query_ptr, kq_ptr, scale_ptr, logits_ptr, pmax_ptr, psum_ptr,
    H_KV, T, D, GROUP, NUM_TB, sm_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_sb, stride_sh, stride_st,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (B * H_kv, cdiv(T, BLOCK_T)): logits of the GROUP query heads sharing one KV head, plus
    each head's (max, sum exp) over this token block. Scratch layouts: logits (B, H, T), partials (B, H, NUM_TB)."""
    pid = tl.program_id(0)
    b = (pid // H_KV).to(tl.int64)
    kv_head = (pid % H_KV).to(tl.int64)
    tb = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < T
    keys = tl.load(
        kq_ptr + b * stride_kb + kv_head * stride_kh + t[:, None] * stride_kt + d[None, :] * stride_kd,
        mask=t_ok[:, None] & (d[None, :] < D), other=0,
    ).to(tl.float32)
    token_scale = tl.load(scale_ptr + b * stride_sb + kv_head * stride_sh + t * stride_st, mask=t_ok, other=0.0)
    token_scale = token_scale * sm_scale
    heads = H_KV * GROUP
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q = tl.load(query_ptr + b * stride_qb + head * stride_qh + d * stride_qd, mask=d < D, other=0.0).to(tl.float32)
        logit = tl.sum(keys * q[None, :], axis=1) * token_scale
        logit = tl.where(t_ok, logit, float("-inf"))
        block_max = tl.max(logit, axis=0)
        block_sum = tl.sum(tl.exp(logit - block_max), axis=0)
        row = b * heads + head
        tl.store(logits_ptr + row * T + t, logit, mask=t_ok)
        tl.store(pmax_ptr + row * NUM_TB + tb, block_max)
        tl.store(psum_ptr + row * NUM_TB + tb, block_sum)


@triton.jit
def _visual_softmax_mean_kernel(
    logits_ptr, pmax_ptr, psum_ptr, out_ptr,
    H, T, NUM_TB, stride_ob,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    """Grid (B, cdiv(T, BLOCK_T)): combine each head's partials, then mean over heads of the probabilities."""
    b = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    h_ok = hh < H
    rows = b * H + hh
    run_max = tl.full((BLOCK_H,), -3.0e38, tl.float32)
    run_sum = tl.zeros((BLOCK_H,), tl.float32)
    for nb0 in range(0, NUM_TB, BLOCK_NB):
        nb = nb0 + tl.arange(0, BLOCK_NB)
        part_mask = h_ok[:, None] & (nb[None, :] < NUM_TB)
        part_max = tl.load(pmax_ptr + rows[:, None] * NUM_TB + nb[None, :], mask=part_mask, other=float("-inf"))
        part_sum = tl.load(psum_ptr + rows[:, None] * NUM_TB + nb[None, :], mask=part_mask, other=0.0)
        new_max = tl.maximum(run_max, tl.max(part_max, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(part_sum * tl.exp(part_max - new_max[:, None]), axis=1)
        run_max = new_max
    run_sum = tl.where(h_ok, run_sum, 1.0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tile_mask = h_ok[:, None] & (t[None, :] < T)
    logit = tl.load(logits_ptr + rows[:, None] * T + t[None, :], mask=tile_mask, other=float("-inf"))
    probs = tl.exp(logit - run_max[:, None]) / run_sum[:, None]
    probs = tl.where(tile_mask, probs, 0.0)
    tl.store(out_ptr + b * stride_ob + t, tl.sum(probs, axis=0) / H, mask=t < T)


def visual_scores(query: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Triton `reference.visual_scores`: per-KV-head logits + partial softmax, then combine + head mean."""
    assert query.dim() == 3, f"query must be (B, H, D), got {tuple(query.shape)}"
    assert quantized.dim() == 4 and quantized.dtype == torch.int8, "quantized must be int8 (B, H_kv, T, D)"
    batch, heads, dim = query.shape
    _, kv_heads, tokens, kv_dim = quantized.shape
    assert quantized.shape[0] == batch and kv_dim == dim, "query and keys disagree on batch or head dim"
    assert kv_heads > 0 and heads % kv_heads == 0, f"{heads} query heads are not a multiple of {kv_heads} KV heads"
    assert tuple(scale.shape) == (batch, kv_heads, tokens, 1), f"scale must be {(batch, kv_heads, tokens, 1)}"
    if batch == 0 or tokens == 0 or dim > 1024 or query.dtype == torch.float64:
        return reference.visual_scores(query, quantized, scale)
    scale = scale.float()
    device = query.device
    block_d = _next_pow2(dim, 16)
    block_t = max(16, min(_next_pow2(tokens), 4096 // block_d, 128))
    num_tb = triton.cdiv(tokens, block_t)
    logits = torch.empty(batch, heads, tokens, dtype=torch.float32, device=device)
    part_max = torch.empty(batch, heads, num_tb, dtype=torch.float32, device=device)
    part_sum = torch.empty(batch, heads, num_tb, dtype=torch.float32, device=device)
    _visual_logits_kernel[(batch * kv_heads, num_tb)](
        query, quantized, scale, logits, part_max, part_sum,
        kv_heads, tokens, dim, heads // kv_heads, num_tb, 1.0 / math.sqrt(dim),
        *query.stride(), *quantized.stride(), scale.stride(0), scale.stride(1), scale.stride(2),
        BLOCK_T=block_t, BLOCK_D=block_d,
    )
    out = torch.empty(batch, tokens, dtype=torch.float32, device=device)
    block_h = _next_pow2(heads, 1)
    block_t2 = max(16, min(_next_pow2(tokens), 8192 // block_h, 256))
    _visual_softmax_mean_kernel[(batch, triton.cdiv(tokens, block_t2))](
        logits, part_max, part_sum, out, heads, tokens, num_tb, out.stride(0),
        BLOCK_H=block_h, BLOCK_T=block_t2, BLOCK_NB=min(_next_pow2(num_tb), max(1, 4096 // block_h)),
    )
    return out
