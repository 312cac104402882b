"""Triton kernels of `hf_adaptive_spec.ops` against their torch references, and the backend dispatch.

The kernels run on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1,
set below before anything imports the kernels). With TRITON_INTERPRET=0 in the
environment and a CUDA device, the same tests run compiled kernels on the GPU.
Without triton installed, the kernel tests skip and the dispatch / CPU-only
tests still run.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels module

import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_adaptive_spec import ops  # noqa: E402
from hf_adaptive_spec.ops import reference  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() not in ("", "0", "false", "off", "no")
DEVICE = "cpu" if INTERPRET else "cuda"

kernels = None
_SKIP_REASON = ""
if importlib.util.find_spec("triton") is None:
    _SKIP_REASON = "triton is not installed (pip install 'hf_adaptive_spec[triton]')"
elif not INTERPRET and not torch.cuda.is_available():
    _SKIP_REASON = "TRITON_INTERPRET=0 needs a CUDA device; unset it to run the kernels in the CPU interpreter"
else:
    try:
        from hf_adaptive_spec.ops import triton_kernels as kernels  # noqa: E402
    except Exception as error:  # a broken triton install: report it, do not crash collection
        _SKIP_REASON = f"hf_adaptive_spec.ops.triton_kernels failed to import: {error!r}"

requires_triton = pytest.mark.skipif(kernels is None, reason=_SKIP_REASON or "triton kernels unavailable")


@pytest.fixture(scope="module", autouse=True)
def _interpret_preimported_triton_language():
    """Let the interpreter run even when triton was imported before TRITON_INTERPRET=1 was set.

    `import hf_adaptive_spec` (tests/conftest.py) imports transformers -> torch._dynamo -> triton, so in a
    whole-suite run triton.language's own @jit helpers (tl.max, tl.sum, tl.topk, ...) were created as
    compiled-mode JITFunctions, which the interpreter refuses to call. Our kernels are fine (the kernels
    module is imported after the variable is set); swap those helpers for interpreted ones for this
    module's tests and put them back afterwards. Not needed when TRITON_INTERPRET=1 is set before pytest
    starts (e.g. in CI's environment or at the top of tests/conftest.py).
    """
    swapped = []
    if kernels is not None and INTERPRET:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        interpreted = {}
        for owner in (tl.standard, tl.random, tl, tl.core.tensor):
            for name, value in list(vars(owner).items()):
                if isinstance(value, JITFunction):
                    replacement = interpreted.setdefault(id(value), InterpretedFunction(value.fn))
                    swapped.append((owner, name, value))
                    setattr(owner, name, replacement)
    yield
    for owner, name, value in reversed(swapped):
        setattr(owner, name, value)

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def case_id(value):
    return DTYPE_NAMES.get(value, str(value)) if isinstance(value, torch.dtype) else str(value)


def make_trees(batch, nodes, kind, seed):
    """Padded trees: row 0 is full, later rows end with padding nodes (parent -1, valid False)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, nodes), -1, dtype=torch.long)
    valid = torch.ones(batch, nodes, dtype=torch.bool)
    for b in range(batch):
        real = nodes if b == 0 else max(1, nodes - int(torch.randint(0, nodes // 3 + 1, (1,), generator=gen)))
        for i in range(1, real):
            if kind == "chain":
                parents[b, i] = i - 1
            elif kind == "deep":  # parent among the last few nodes: long, narrow branches
                parents[b, i] = int(torch.randint(max(0, i - 3), i, (1,), generator=gen))
            else:  # uniform over earlier nodes: wide, shallow
                parents[b, i] = int(torch.randint(0, i, (1,), generator=gen))
        valid[b, real:] = False
    return parents.to(DEVICE), valid.to(DEVICE)


def assert_same(actual, expected):
    """Bitwise for integer / bool tensors and the mask, recursively over tuples and lists."""
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
        return
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.device == expected.device
    assert torch.equal(actual, expected), (actual, expected)


# --------------------------------------------------------------------------- trees

TREE_CASES = [
    (1, 1, "random"), (3, 13, "random"), (2, 21, "chain"), (4, 33, "deep"), (2, 64, "random"), (2, 100, "deep"),
]


@requires_triton
@pytest.mark.parametrize("batch,nodes,kind", TREE_CASES, ids=[f"B{b}-N{n}-{k}" for b, n, k in TREE_CASES])
def test_ancestor_matrix(batch, nodes, kind):
    parents, _ = make_trees(batch, nodes, kind, seed=nodes)
    assert_same(kernels.ancestor_matrix(parents), reference.ancestor_matrix(parents))


MASK_CASES = [
    (1, 1, 0, None, torch.float32),
    (3, 13, 7, None, torch.bfloat16),
    (2, 21, 33, 5, torch.float32),
    (3, 17, 150, 1, torch.float16),
    (2, 64, 45, None, torch.bfloat16),
    (2, 9, 3, 0, torch.float32),
]


@requires_triton
@pytest.mark.parametrize(
    "batch,nodes,slots,num_query,dtype",
    MASK_CASES,
    ids=[f"B{b}-N{n}-S{s}-Q{'all' if q is None else q}-{case_id(d)}" for b, n, s, q, d in MASK_CASES],
)
def test_tree_attention_mask(batch, nodes, slots, num_query, dtype):
    parents, valid = make_trees(batch, nodes, "deep", seed=slots)
    slot_valid = torch.rand(batch, slots, generator=torch.Generator().manual_seed(1)).to(DEVICE) > 0.3
    expected = reference.tree_attention_mask(parents, valid, slot_valid, dtype, num_query)
    actual = kernels.tree_attention_mask(parents, valid, slot_valid, dtype, num_query)
    assert_same(actual, expected)
    blocked = actual[0] != 0
    assert bool((actual[0][blocked] == torch.finfo(dtype).min).all())  # exactly finfo.min, never -inf


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=case_id)
def test_tree_attention_mask_into_strided_out_buffer(dtype):
    batch, nodes, slots, num_query = 3, 11, 6, 4
    parents, valid = make_trees(batch, nodes, "random", seed=3)
    slot_valid = torch.ones(batch, slots, dtype=torch.bool, device=DEVICE)
    slot_valid[1, 2] = False
    storage = torch.full((batch, 1, num_query + 2, slots + nodes + 5), 7.0, dtype=dtype, device=DEVICE)
    out = storage[:, :, 1 : 1 + num_query, 2 : 2 + slots + nodes]  # a non-contiguous window
    mask, depths = kernels.tree_attention_mask(parents, valid, slot_valid, dtype, num_query, out=out)
    assert mask.data_ptr() == out.data_ptr()
    assert_same((mask, depths), reference.tree_attention_mask(parents, valid, slot_valid, dtype, num_query))
    storage[:, :, 1 : 1 + num_query, 2 : 2 + slots + nodes] = 7.0
    assert bool((storage == 7.0).all())  # nothing outside the window was written


GREEDY_CASES = [(1, 1, 2), (5, 17, 3), (3, 29, 2), (2, 64, 4), (2, 90, 2)]


@requires_triton
@pytest.mark.parametrize("kind", ["random", "deep"])
@pytest.mark.parametrize(
    "batch,nodes,vocab", GREEDY_CASES, ids=[f"B{b}-N{n}-V{v}" for b, n, v in GREEDY_CASES]
)
def test_greedy_accept(batch, nodes, vocab, kind):
    # a tiny vocabulary makes long accepted paths, equal siblings (ties) and matching padding nodes likely
    parents, valid = make_trees(batch, nodes, kind, seed=nodes + vocab)
    gen = torch.Generator().manual_seed(nodes)
    tokens = torch.randint(0, vocab, (batch, nodes), generator=gen).to(DEVICE)
    choice = torch.randint(0, vocab, (batch, nodes), generator=gen).to(DEVICE)
    max_depth = int(reference.ancestor_matrix(parents)[1].max()) + 1  # one level more than needed
    expected = reference.greedy_accept(tokens, parents, valid, choice, max_depth)
    assert_same(kernels.greedy_accept(tokens, parents, valid, choice, max_depth), expected)


@requires_triton
def test_greedy_accept_tie_breaks_to_lowest_index_and_int32_choice():
    parents = torch.tensor([[-1, 0, 0, 0, 1, 2, 3]], device=DEVICE).expand(2, -1)  # stride-0 batch
    tokens = torch.tensor([[9, 5, 5, 5, 6, 6, 6], [9, 5, 4, 5, 6, 6, 6]], device=DEVICE)
    valid = torch.ones(2, 7, dtype=torch.bool, device=DEVICE)
    choice = torch.tensor([[5, 6, 6, 6, 1, 2, 3], [5, 7, 0, 6, 1, 2, 3]], dtype=torch.int32, device=DEVICE)
    expected = reference.greedy_accept(tokens, parents, valid, choice.long(), max_depth=2)
    actual = kernels.greedy_accept(tokens, parents, valid, choice, max_depth=2)
    assert actual[0].tolist() == expected[0].tolist() == [[0, 1, 4], [0, 3, 6]]
    assert actual[1].tolist() == expected[1].tolist() == [2, 2]
    assert actual[2].dtype == torch.int32 and actual[2].tolist() == expected[2].tolist() == [1, 3]


# --------------------------------------------------------------------------- KV compaction

COMPACT_CASES = [
    (1, 1, 1, 5, 3, 0, 1, "sorted", torch.float32),
    (3, 2, 3, 19, 7, 6, 5, "sorted", torch.bfloat16),
    (5, 3, 2, 23, 16, 9, 7, "shuffled", torch.float32),
    (2, 4, 1, 41, 33, 3, 38, "duplicates", torch.bfloat16),
    (4, 2, 3, 12, 5, 11, 0, "sorted", torch.float16),
]


def _keep_index(batch, tail, kept, kind, gen):
    rows = []
    for _ in range(batch):
        if kind == "duplicates":
            rows.append(torch.randint(0, tail, (kept,), generator=gen))
        else:
            chosen = torch.randperm(tail, generator=gen)[:kept]
            rows.append(chosen if kind == "shuffled" else chosen.sort().values)
    return torch.stack(rows).to(DEVICE)


@requires_triton
@pytest.mark.parametrize(
    "layers,batch,heads,length,dim,start,kept,kind,dtype",
    COMPACT_CASES,
    ids=[f"L{n}-B{b}-H{h}-T{t}-D{d}-s{s}-K{k}-{kind}-{case_id(x)}" for n, b, h, t, d, s, k, kind, x in COMPACT_CASES],
)
def test_compact_kv_in_place(layers, batch, heads, length, dim, start, kept, kind, dtype):
    gen = torch.Generator().manual_seed(length)
    tensors = [torch.randn(batch, heads, length, dim, generator=gen).to(dtype).to(DEVICE) for _ in range(layers)]
    expected_tensors = [t.clone() for t in tensors]
    keep = _keep_index(batch, length - start, kept, kind, gen)
    expected = reference.compact_kv_(expected_tensors, keep, start)
    actual = kernels.compact_kv_(tensors, keep, start)
    assert_same(actual, expected)
    assert_same(tensors, expected_tensors)  # identical in-place side effects, past start + K too
    for view, tensor in zip(actual, tensors):
        assert view.data_ptr() == tensor.data_ptr()


@requires_triton
def test_compact_kv_mixed_layer_shapes_and_strides():
    """Keys and values of different head dims, a transposed-storage layer: several launch groups, same result."""
    gen = torch.Generator().manual_seed(0)
    batch, length, start = 3, 17, 8
    keys = [torch.randn(batch, 2, length, 12, generator=gen).to(DEVICE) for _ in range(2)]
    values = [torch.randn(batch, 2, length, 5, generator=gen).to(DEVICE) for _ in range(2)]
    odd = torch.randn(batch, length, 2, 12, generator=gen).to(DEVICE).transpose(1, 2)  # (B, H, L, D), strided
    tensors = keys + values + [odd]
    expected_tensors = [t.clone() for t in tensors]
    keep = torch.tensor([[0, 2, 5], [8, 1, 1], [3, 4, 6]], device=DEVICE)
    expected = reference.compact_kv_(expected_tensors, keep, start)
    assert_same(kernels.compact_kv_(tensors, keep, start), expected)
    assert_same(tensors, expected_tensors)
    assert kernels.compact_kv_([], keep, start) == []


# --------------------------------------------------------------------------- SAGE confidence

SAGE_CASES = [
    (1, 7, 10, torch.float32),  # top_k clipped to the vocabulary
    (3, 301, 10, torch.float32),
    (2, 1001, 10, torch.bfloat16),
    (5, 97, 33, torch.float32),
    (3, 50, 2, torch.float16),
    (2, 50, 1, torch.float32),  # k <= 1: all ones
]


@requires_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: -inf - -inf in that row
@pytest.mark.parametrize(
    "batch,vocab,top_k,dtype", SAGE_CASES, ids=[f"B{b}-V{v}-k{k}-{case_id(d)}" for b, v, k, d in SAGE_CASES]
)
def test_sage_confidence(batch, vocab, top_k, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(batch, vocab, generator=gen) * torch.linspace(0.1, 8.0, batch)[:, None]).to(dtype)
    logits[-1, : vocab // 2] = float("-inf")  # a processor-filtered row
    if batch > 2:
        logits[1] = float("-inf")  # no finite logit at all: NaN in the reference, NaN here
    logits = logits.to(DEVICE)
    expected = reference.sage_confidence(logits, top_k)
    actual = kernels.sage_confidence(logits, top_k)
    assert actual.dtype == torch.float32 and actual.shape == (batch,)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=case_id)
def test_sage_confidence_multi_block_merge(dtype, monkeypatch):
    """Small vocabulary blocks force the two-stage merge (several blocks, ties across blocks)."""
    monkeypatch.setattr(kernels, "SAGE_BLOCK_V", 64)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 777, generator=gen).to(dtype)
    logits[1] = 0.0  # all tied: alpha = 0
    logits[2, 5::100] = 9.0  # equal maxima spread over blocks
    logits = logits.to(DEVICE)
    torch.testing.assert_close(kernels.sage_confidence(logits, 10), reference.sage_confidence(logits, 10),
                               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- visual token selection

QUANT_CASES = [(1, 1, 1, 1, torch.float32), (3, 2, 13, 24, torch.float32), (2, 3, 37, 128, torch.bfloat16),
               (2, 2, 9, 80, torch.float16)]


@requires_triton
@pytest.mark.parametrize(
    "batch,heads,tokens,dim,dtype",
    QUANT_CASES,
    ids=[f"B{b}-H{h}-T{t}-D{d}-{case_id(x)}" for b, h, t, d, x in QUANT_CASES],
)
def test_quantize_int8_bitwise(batch, heads, tokens, dim, dtype):
    gen = torch.Generator().manual_seed(tokens)
    keys = (torch.randn(batch, heads, tokens, dim, generator=gen) * 3).to(dtype)
    keys[0, 0, 0] = 0.0  # an all-zero token: scale clamps to 1e-12 / 127
    keys = keys.to(DEVICE)
    assert_same(kernels.quantize_int8(keys), reference.quantize_int8(keys))


@requires_triton
def test_quantize_int8_ties_round_to_even_on_strided_input():
    base = torch.zeros(2, 5, 3, 8)  # (B, T, H, D): transposed below, so the T stride is not D
    base[..., 0] = 127.0  # scale == 1 exactly, so the halves below are exact ties
    base[..., 1:7] = torch.tensor([2.5, 3.5, -2.5, -0.5, 126.5, 0.5])
    keys = base.transpose(1, 2).to(DEVICE)
    quantized, scale = kernels.quantize_int8(keys)
    assert_same((quantized, scale), reference.quantize_int8(keys))
    assert quantized[0, 0, 0, :7].tolist() == [127, 2, 4, -2, 0, 126, 0]


VISUAL_CASES = [
    (1, 1, 1, 1, 16, torch.float32),
    (3, 6, 2, 37, 24, torch.float32),
    (2, 4, 4, 300, 64, torch.bfloat16),
    (1, 28, 4, 577, 128, torch.bfloat16),
]


@requires_triton
@pytest.mark.parametrize(
    "batch,heads,kv_heads,tokens,dim,dtype",
    VISUAL_CASES,
    ids=[f"B{b}-H{h}-KV{k}-T{t}-D{d}-{case_id(x)}" for b, h, k, t, d, x in VISUAL_CASES],
)
def test_visual_scores(batch, heads, kv_heads, tokens, dim, dtype):
    gen = torch.Generator().manual_seed(tokens)
    keys = (torch.randn(batch, kv_heads, tokens, dim, generator=gen) * 2).to(dtype).to(DEVICE)
    query = (torch.randn(batch, heads, dim, generator=gen) * 2).to(dtype).to(DEVICE)
    quantized, scale = reference.quantize_int8(keys)
    expected = reference.visual_scores(query, quantized, scale)
    actual = kernels.visual_scores(query, quantized, scale)
    assert actual.dtype == torch.float32 and actual.shape == (batch, tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(actual.sum(-1), torch.ones(batch, device=DEVICE))


# --------------------------------------------------------------------------- dispatch


def _op_inputs(device="cpu"):
    """One small call per op: name -> (args, kwargs)."""
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, -1, -1, -1]], device=device)
    valid = torch.tensor([[True] * 7, [True] * 4 + [False] * 3], device=device)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 9, 8, generator=gen).to(device)
    quantized, scale = reference.quantize_int8(keys)
    return {
        "ancestor_matrix": ((parents,), {}),
        "tree_attention_mask": ((parents, valid, torch.ones(2, 3, dtype=torch.bool, device=device), torch.bfloat16),
                                {}),
        "compact_kv_": (([torch.randn(2, 2, 12, 4, generator=gen).to(device)],
                         torch.tensor([[0, 2], [1, 1]], device=device), 9), {}),
        "sage_confidence": ((torch.randn(2, 50, generator=gen).to(device),), {"top_k": 5}),
        "greedy_accept": ((torch.randint(0, 2, (2, 7), generator=gen).to(device), parents, valid,
                           torch.randint(0, 2, (2, 7), generator=gen).to(device), 3), {}),
        "quantize_int8": ((keys,), {}),
        "visual_scores": ((torch.randn(2, 4, 8, generator=gen).to(device), quantized, scale), {}),
        "visual_vote": ((torch.rand(3, 2, 9, generator=gen).to(device), 3, 4), {}),
    }


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def test_every_op_is_dispatched():
    assert set(_op_inputs()) == set(reference.__all__) == set(ops.__all__) - {"use_backend", "triton_available"}


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_dispatch_keeps_cpu_tensors_on_torch(backend, monkeypatch):
    def no_triton():
        raise AssertionError("CPU tensors must never import triton or the kernels module")

    monkeypatch.setattr(ops, "_triton_module", no_triton)
    for name, (args, kwargs) in _op_inputs().items():
        with ops.use_backend(backend):
            actual = getattr(ops, name)(*_clone(args), **kwargs)
        assert_same_or_close(actual, getattr(reference, name)(*_clone(args), **kwargs))


def assert_same_or_close(actual, expected):
    if isinstance(expected, (tuple, list)):
        for a, e in zip(actual, expected, strict=True):
            assert_same_or_close(a, e)
    elif expected.is_floating_point():
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        assert_same(actual, expected)


def test_forced_triton_backend_routes_to_kernels_and_falls_back(monkeypatch):
    """`use_backend("triton")` calls the kernel of the same name; ops without one use the reference."""
    calls = []
    fake = types.SimpleNamespace(sage_confidence=lambda *a, **k: calls.append("sage") or "kernel")
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    monkeypatch.setattr(ops, "_triton_module", lambda: fake)
    logits = torch.randn(2, 9)
    with ops.use_backend("triton"):
        assert ops.sage_confidence(logits, 3) == "kernel"
        torch.testing.assert_close(ops.quantize_int8(torch.ones(1, 1, 2, 3))[1], torch.full((1, 1, 2, 1), 1 / 127))
    assert calls == ["sage"]
    assert ops.sage_confidence(logits, 3).shape == (2,)  # back on "auto": CPU tensor, reference
    assert ops._kernel_for("sage_confidence", types.SimpleNamespace(is_cuda=True)) is fake.sage_confidence
    assert ops._kernel_for("sage_confidence", types.SimpleNamespace(is_cuda=False)) is None


@requires_triton
@pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
def test_forced_triton_backend_runs_real_kernels_on_cpu():
    inputs = _op_inputs()
    for name, (args, kwargs) in inputs.items():
        with ops.use_backend("triton"):
            actual = getattr(ops, name)(*_clone(args), **kwargs)
        assert_same_or_close(actual, getattr(reference, name)(*_clone(args), **kwargs))
    assert not hasattr(kernels, "visual_vote")  # stays torch by design (see the kernels module docstring)


NO_TRITON_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["triton"] = None  # what a CPU-only install without triton looks like to importlib
    import torch
    import hf_adaptive_spec
    from hf_adaptive_spec import ops
    from hf_adaptive_spec.ops import reference
    sys.path.insert(0, sys.argv[1])
    from test_ops_triton import _op_inputs, _clone, assert_same_or_close

    report = {"triton_available": ops.triton_available(), "ops": []}
    for name, (args, kwargs) in _op_inputs().items():
        expected = getattr(reference, name)(*_clone(args), **kwargs)
        assert_same_or_close(getattr(ops, name)(*_clone(args), **kwargs), expected)
        report["ops"].append(name)
    try:
        with ops.use_backend("triton"):
            ops.sage_confidence(torch.zeros(1, 4))
    except RuntimeError as error:
        report["forced_error"] = str(error)
    report["kernels_imported"] = "hf_adaptive_spec.ops.triton_kernels" in sys.modules
    report["triton_module"] = repr(sys.modules.get("triton"))
    print("REPORT" + json.dumps(report))
    """
)


def test_cpu_only_install_without_triton(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    script = tmp_path / "no_triton.py"
    script.write_text(NO_TRITON_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT"))
    report = json.loads(line[len("REPORT"):])
    assert report["triton_available"] is False
    assert report["ops"] == list(_op_inputs())
    assert "not installed" in report["forced_error"]
    assert report["kernels_imported"] is False and report["triton_module"] == "None"


# --------------------------------------------------------------------------- GPU code generation, without a GPU

COMPILE_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends import backends
    if "nvidia" not in backends:
        print("SKIP: triton has no nvidia backend"); sys.exit(0)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hf_adaptive_spec.ops import triton_kernels as K

    JOBS = [
        (K._ancestor_matrix_kernel, {"parents_ptr": "*i64", "anc_ptr": "*u8", "depth_ptr": "*i64"},
         {"BLOCK_N": 64}, 4),
        (K._ancestor_matrix_kernel, {"parents_ptr": "*i32", "anc_ptr": "*u8", "depth_ptr": "*i64"},
         {"BLOCK_N": 128}, 8),
        (K._tree_mask_kernel, {"parents_ptr": "*i64", "valid_ptr": "*u8", "slot_valid_ptr": "*u8", "mask_ptr": "*bf16",
                               "depth_ptr": "*i64"},
         {"MIN_VALUE": -3.3895313892515355e38, "BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_S": 128}, 4),
        (K._tree_mask_kernel, {"parents_ptr": "*i64", "valid_ptr": "*u8", "slot_valid_ptr": "*u8", "mask_ptr": "*fp32",
                               "depth_ptr": "*i64"},
         {"MIN_VALUE": -3.4028234663852886e38, "BLOCK_N": 16, "BLOCK_M": 1, "BLOCK_S": 8192}, 4),
        (K._greedy_accept_kernel, {"tokens_ptr": "*i64", "parents_ptr": "*i64", "valid_ptr": "*u8",
                                   "choice_ptr": "*i64", "path_ptr": "*i64", "length_ptr": "*i64",
                                   "bonus_ptr": "*i64"},
         {"BLOCK_N": 64, "BLOCK_L": 16}, 4),
        (K._compact_kv_kernel, {"table_ptr": "*i64", "like_ptr": "*bf16", "keep_ptr": "*i64"},
         {"BLOCK_K": 64, "BLOCK_D": 64}, 4),
        (K._sage_block_topk_kernel, {"logits_ptr": "*bf16", "cand_ptr": "*fp32"}, {"BLOCK_V": 4096, "BLOCK_K": 16}, 4),
        (K._sage_entropy_kernel, {"cand_ptr": "*fp32", "out_ptr": "*fp32", "inv_log_k": "fp32"},
         {"BLOCK_C": 1024, "BLOCK_K": 16}, 4),
        (K._quantize_int8_kernel, {"keys_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32"},
         {"BLOCK_T": 32, "BLOCK_D": 128}, 4),
        (K._visual_logits_kernel, {"query_ptr": "*bf16", "kq_ptr": "*i8", "scale_ptr": "*fp32", "logits_ptr": "*fp32",
                                   "pmax_ptr": "*fp32", "psum_ptr": "*fp32", "sm_scale": "fp32"},
         {"BLOCK_T": 32, "BLOCK_D": 128}, 4),
        (K._visual_softmax_mean_kernel, {"logits_ptr": "*fp32", "pmax_ptr": "*fp32", "psum_ptr": "*fp32",
                                         "out_ptr": "*fp32"}, {"BLOCK_H": 32, "BLOCK_T": 256, "BLOCK_NB": 64}, 4),
    ]
    compiled = set()
    for fn, pointer_types, constexprs, warps in JOBS:
        signature = {n: "constexpr" if n in constexprs else pointer_types.get(n, "i32") for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps})
        assert ".entry" in kernel.asm["ptx"], fn.__name__
        compiled.add(fn.__name__)
    print("COMPILED " + " ".join(sorted(compiled)))
    """
)


@requires_triton
def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The interpreter accepts code the GPU compiler rejects (e.g. one name bound to two types in an if/else):
    compile every kernel for an H100/H200 target (no device needed) so CI catches that too."""
    script = tmp_path / "compile_kernels.py"
    script.write_text(COMPILE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stderr[-6000:]
    compiled = set(result.stdout.split("COMPILED ")[1].split())
    expected = {name for name in dir(kernels) if name.endswith("_kernel") and not name.startswith("__")}
    assert compiled == expected


# --------------------------------------------------------------------------- the GPU benchmark script


@requires_triton
@pytest.mark.skipif(not INTERPRET, reason="the smoke run uses the CPU interpreter")
def test_gpu_benchmark_script_smoke_on_cpu(tmp_path):
    """examples/bench_ops_gpu.py end to end on tiny CPU sizes (--smoke-cpu): its checks and its JSON."""
    out = tmp_path / "bench.json"
    command = [
        sys.executable, str(REPO_ROOT / "examples" / "bench_ops_gpu.py"), "--smoke-cpu", "--out", str(out),
        "--ops", "tree_attention_mask,compact_kv_,quantize_int8,visual_vote", "--batches", "2", "--nodes", "9",
        "--cache-len", "5", "--layers", "3", "--kv-heads", "2", "--head-dim", "16", "--accepted", "3",
        "--visual-tokens", "33", "--query-heads", "4", "--visual-kv-heads", "2", "--vote-layers", "3",
        "--warmup", "0", "--iters", "1",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["all_equal"] is True
    assert {row["op"] for row in report["results"]} == {"tree_attention_mask", "compact_kv_", "quantize_int8",
                                                         "visual_vote"}
