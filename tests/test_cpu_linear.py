"""The CPU small-batch linear kernel: equal to `F.linear`, used where it should be, and only there."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel
from hf_adaptive_spec.ops import cpu_linear
from tiny_models import build_drafter, build_model, make_inputs

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason="the CPU kernel needs AVX-512 and a compiler")


@pytest.fixture
def calls():
    """Calls that ran the compiled kernel since the test started (its own counter, in C++)."""
    start = cpu_linear.kernel_calls()
    return lambda: cpu_linear.kernel_calls() - start


@needs_kernel
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 7, 8, 12])
@pytest.mark.parametrize("in_features", [1, 5, 16, 37, 576])
def test_kernel_equals_torch_linear(rows, in_features, calls):
    torch.manual_seed(rows * 1000 + in_features)
    for out_features in (1, 3, 4, 9, 130):
        x = torch.randn(rows, in_features)
        weight = torch.randn(out_features, in_features)
        bias = torch.randn(out_features)
        with cpu_linear.fast_linears():
            got, got_nobias = cpu_linear.linear(x, weight, bias), cpu_linear.linear(x, weight)
        tolerance = dict(rtol=1e-5, atol=1e-6 * in_features)  # sums of in_features float products, reordered
        torch.testing.assert_close(got, F.linear(x, weight, bias), **tolerance)
        torch.testing.assert_close(got_nobias, F.linear(x, weight), **tolerance)
    assert calls() == 10


@needs_kernel
def test_kernel_takes_batched_inputs_and_only_small_row_counts(calls):
    torch.manual_seed(0)
    weight, bias = torch.randn(24, 40), torch.randn(24)
    with cpu_linear.fast_linears():
        x = torch.randn(2, 3, 40)  # 6 rows
        torch.testing.assert_close(cpu_linear.linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        assert calls() == 1
        over = cpu_linear.max_rows() + 1  # one row (a plain step) and more than max_rows() rows: torch
        for shape in [(1, 40), (1, 1, 40), (over, 40), (2, over // 2 + 1, 40)]:
            x = torch.randn(*shape)
            assert torch.equal(cpu_linear.linear(x, weight, bias), F.linear(x, weight, bias))
        assert calls() == 1
        x = torch.randn(4, 40, dtype=torch.float64)  # not fp32: torch
        assert torch.equal(cpu_linear.linear(x, weight.double()), F.linear(x, weight.double()))
        strided = torch.randn(40, 24).t()  # a non-contiguous weight: torch
        x = torch.randn(4, 40)
        assert torch.equal(cpu_linear.linear(x, strided), F.linear(x, strided))
        x = torch.randn(4, 40, requires_grad=True)  # autograd: torch (the kernel has no backward)
        cpu_linear.linear(x, weight).sum().backward()
        assert x.grad is not None
        assert calls() == 1
    x = torch.randn(4, 40)  # outside fast_linears: torch
    assert torch.equal(cpu_linear.linear(x, weight), F.linear(x, weight))
    assert calls() == 1


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """A tree node's logits must not change with the tree around it: same row, bitwise the same output."""
    torch.manual_seed(0)
    weight = torch.randn(70, 200)
    most = cpu_linear.max_rows()  # every call below runs the kernel (more rows go to torch: another rounding)
    x = torch.randn(most, 200)
    with cpu_linear.fast_linears():
        full = cpu_linear.linear(x, weight)
        for rows in sorted({2, 3, 5, 8, 11, most} & set(range(2, most + 1))):
            assert torch.equal(cpu_linear.linear(x[:rows], weight), full[:rows])
        assert torch.equal(cpu_linear.linear(x[5:9], weight), full[5:9])


@needs_kernel
def test_a_built_kernel_loads_as_it_is_past_a_lock_a_killed_build_left(tmp_path):
    """A process finds the library built: it imports it, even with a `lock` file in its folder (what a build
    killed midway leaves; torch's `load` waits on one forever) and a build file written for another checkout's
    source path (on which `load` rebuilds), and rebuilds nothing."""
    import shutil
    import subprocess
    import sys

    isa = cpu_linear._isa()
    name, build, _ = cpu_linear._location(isa)
    cpu_linear._build(isa)  # built in this process's cache
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy2(build / f"{name}.so", folder / f"{name}.so")
    (folder / "lock").touch()
    (folder / "build.ninja").write_text("# written for /another/checkout/small_linear.cpp\n")
    before = sorted((path.name, path.stat().st_mtime_ns) for path in folder.iterdir())
    code = (f"import torch; from hf_adaptive_spec.ops import cpu_linear; e = cpu_linear._build({isa!r}); "
            "x, w = torch.randn(3, 8), torch.randn(5, 8); "
            "torch.testing.assert_close(e.small_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)")
    env = {**__import__("os").environ, "HF_ADAPTIVE_SPEC_KERNEL_CACHE": str(tmp_path)}
    # the bound only ends a process that waits on the lock (it never finishes then); a load takes a moment
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted((path.name, path.stat().st_mtime_ns) for path in folder.iterdir()) == before  # nothing rebuilt


@needs_kernel
@pytest.mark.skipif(cpu_linear._isa() != "avx512", reason="this CPU runs the AVX2 build already")
def test_the_avx2_build_equals_torch_linear_too():
    """The build for CPUs without AVX-512 (8 lanes, 2 input rows per pass), compiled and run here too."""
    extension = cpu_linear._build("avx2")
    torch.manual_seed(0)
    for rows, in_features, out_features in [(2, 5, 3), (3, 8, 4), (5, 37, 9), (8, 576, 130), (24, 100, 7)]:
        x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
        bias = torch.randn(out_features)
        tolerance = dict(rtol=1e-5, atol=1e-6 * in_features)
        torch.testing.assert_close(extension.small_linear(x, weight), F.linear(x, weight), **tolerance)
        torch.testing.assert_close(extension.linear(x, weight, bias, 2, 24), F.linear(x, weight, bias), **tolerance)
        full = extension.small_linear(x, weight)
        assert torch.equal(extension.small_linear(x[:2].contiguous(), weight), full[:2])
    assert extension.kernel_calls() >= 15


@needs_kernel
def test_fast_linears_patches_plain_fp32_linears_and_restores_them(calls):
    class Wrapped(nn.Linear):
        pass

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Wrapped(8, 8), nn.Linear(8, 8).double(), nn.Linear(8, 8))
    hooked = model[3]
    hooked.forward = lambda x: x  # e.g. accelerate's offload hook: left alone
    x = torch.randn(3, 8)
    with cpu_linear.fast_linears(model, None) as on:
        assert on
        assert "forward" in model[0].__dict__
        assert "forward" not in model[1].__dict__ and "forward" not in model[2].__dict__
        assert hooked.forward(x) is x
        model[0](x).sum().backward()  # autograd on: torch's linear (a training step inside still works)
        assert model[0].weight.grad is not None and calls() == 0
        with torch.no_grad():
            got = model[0](x)
        torch.testing.assert_close(got, F.linear(x, model[0].weight, model[0].bias).detach(), rtol=1e-5, atol=1e-5)
    assert calls() == 1
    assert "forward" not in model[0].__dict__
    with pytest.raises(KeyError), cpu_linear.fast_linears(model):
        raise KeyError("boom")
    assert "forward" not in model[0].__dict__ and not cpu_linear.active()


def test_switches(monkeypatch):
    with cpu_linear.use_cpu_kernels(False), cpu_linear.fast_linears(nn.Linear(4, 4)) as on:
        assert not on and not cpu_linear.active()
    with pytest.raises(ValueError, match="True, False or 'auto'"), cpu_linear.use_cpu_kernels("sometimes"):
        pass
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_CPU_KERNELS", "maybe")
    with pytest.raises(ValueError, match="HF_ADAPTIVE_SPEC_CPU_KERNELS"):
        cpu_linear.enabled()
    monkeypatch.setenv("HF_ADAPTIVE_SPEC_CPU_KERNELS", "0")
    assert not cpu_linear.enabled()
    monkeypatch.delenv("HF_ADAPTIVE_SPEC_CPU_KERNELS")
    monkeypatch.setattr(cpu_linear, "_cpu_supported", lambda: "the CPU capability torch reports is AVX2")
    assert not cpu_linear.enabled()  # auto: off, silently (an ordinary CPU)
    with cpu_linear.use_cpu_kernels(True), pytest.raises(RuntimeError, match="AVX2"):
        cpu_linear.enabled()


def _laspec_drafter(target):
    torch.manual_seed(0)
    return LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, block_size=4)).eval()


@needs_kernel
@pytest.mark.parametrize("arch,strategy", [("llama", "laspec"), ("qwen2_vl", "laspec"), ("llama", "sage")])
def test_speculative_output_with_the_kernel_equals_plain(arch, strategy, calls):
    target = build_model(arch, hidden_size=64)
    inputs = make_inputs(arch, batch_size=2)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    drafter = _laspec_drafter(target) if strategy == "laspec" else build_drafter(arch, target, "small")
    for mode in (True, False):
        before = calls()
        with cpu_linear.use_cpu_kernels(mode):
            out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                                  spec_strategy=strategy, spec_config={"verify_cost": False},
                                  return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert (calls() > before) == mode  # the rounds ran through the kernel only when it was on
    assert not any("forward" in m.__dict__ for m in target.modules())
    assert not any("forward" in m.__dict__ for m in drafter.modules())


@needs_kernel
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_bf16_weights_give_the_fp32_kernels_result_for_bf16_exact_values(build):
    """Each bf16 weight is widened to fp32 in registers and summed in the same order: a weight that is a bf16
    value gives bitwise the fp32 kernel's output (from half the bytes), ragged tails included."""
    if build == "avx2" and cpu_linear._isa() != "avx512":
        pytest.skip("this CPU runs the AVX2 build already")
    extension = cpu_linear._extension() if build == "native" else cpu_linear._build("avx2")
    torch.manual_seed(1)
    for rows, in_features, out_features in [(1, 5, 3), (2, 16, 4), (3, 37, 9), (4, 576, 130), (5, 100, 7),
                                            (24, 33, 6)]:
        x = torch.randn(rows, in_features)
        weight = torch.randn(out_features, in_features).bfloat16()
        exact = weight.float()
        got = extension.small_linear(x, weight)
        assert got.dtype == torch.float32
        assert torch.equal(got, extension.small_linear(x, exact))
        torch.testing.assert_close(got, F.linear(x, exact), rtol=1e-5, atol=1e-6 * in_features)
        bias = torch.randn(out_features)
        with_compact = extension.linear(x, exact, bias, 1, 24, weight)
        assert torch.equal(with_compact, extension.linear(x, exact, bias, 1, 24))
        wrong_shape = torch.randn(out_features + 1, in_features).bfloat16()  # not a copy of w: w is read
        assert torch.equal(extension.linear(x, exact, bias, 1, 24, wrong_shape), extension.linear(x, exact, bias, 1, 24))


@needs_kernel
def test_compact_drafter_layers_read_bf16_copies_and_only_there(calls):
    """`fast_linears(..., compact=[drafter])`: the drafter's layers read bf16 copies for 1..max_rows rows
    (bitwise the fp32 result when the weights are bf16 values, rounded otherwise); other models keep the
    fp32 weights and send one row to torch; nothing outlives the block, the copies included."""
    torch.manual_seed(0)
    target, drafter = nn.Linear(16, 8), nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    with torch.no_grad():
        drafter[0].weight.copy_(drafter[0].weight.bfloat16().float())  # bf16-exact, like a bf16 checkpoint
    for rows in (1, 3):
        x = torch.randn(rows, 16)
        with torch.no_grad():
            with cpu_linear.fast_linears(target, compact=[drafter]):
                before = calls()
                got_target, got_first, got_drafter = target(x), drafter[0](x), drafter(x)
                ran = calls() - before
                with cpu_linear.use_compact_weights(False):  # read at entry: this block still compacts
                    assert torch.equal(drafter[0](x), got_first)
            with cpu_linear.use_compact_weights(False), cpu_linear.fast_linears(target, compact=[drafter]):
                fp32_first, fp32_drafter = drafter[0](x), drafter(x)
        assert ran == (3 if rows == 1 else 4)  # one row: the target's layer goes to torch, the drafter's do not
        if rows == 1:  # a target's one-row call is torch's own linear, bit for bit
            assert torch.equal(got_target, F.linear(x, target.weight, target.bias))
        torch.testing.assert_close(got_target, F.linear(x, target.weight, target.bias), rtol=1e-5, atol=1e-5)
        if rows > 1:
            assert torch.equal(got_first, fp32_first)  # bf16-exact weights: bitwise the fp32 kernel
        torch.testing.assert_close(got_first, F.linear(x, drafter[0].weight, drafter[0].bias), rtol=1e-5, atol=1e-5)
        # the second layer's weights are not bf16 values: rounded, so close but not the fp32 result
        torch.testing.assert_close(got_drafter, fp32_drafter, rtol=2e-2, atol=2e-2)
        assert not torch.equal(got_drafter, fp32_drafter)
    assert not any("forward" in m.__dict__ for m in [target, *drafter.modules()])
    assert not any(cpu_linear._COMPACT_KEY in m.__dict__ for m in [target, *drafter.modules()])
    x = torch.randn(2, 8)
    with torch.no_grad(), cpu_linear.fast_linears(compact=[drafter]):
        first = drafter[1](x)
        torch.testing.assert_close(first, F.linear(x, drafter[1].weight.bfloat16().float(), drafter[1].bias))
        drafter[1].weight.mul_(2)  # a changed weight gets a new copy within the block
        second = drafter[1](x)
        torch.testing.assert_close(second, F.linear(x, drafter[1].weight.bfloat16().float(), drafter[1].bias))
        assert not torch.allclose(first, second)
    with pytest.raises(ValueError, match="True or False"):
        cpu_linear.use_compact_weights("yes")


@needs_kernel
def test_the_laspec_draft_head_reads_a_bf16_copy_inside_the_loop_only(calls):
    target = build_model("llama", hidden_size=64)
    drafter = _laspec_drafter(target).attach_target(target)
    drafter.set_draft_vocabulary(torch.arange(0, target.config.vocab_size, 3))
    hidden = torch.randn(4, 64)
    with torch.no_grad():
        reference = drafter.draft_vocab_logits(hidden)  # outside the loop: F.linear over the fp32 rows
        rows = target.lm_head.weight[drafter.draft_vocab]
        assert torch.equal(reference, F.linear(hidden, rows))
        with cpu_linear.fast_linears(target, drafter):  # not compact: the fp32 rows
            assert torch.equal(drafter.draft_vocab_logits(hidden), cpu_linear.linear(hidden, rows))
        before = calls()
        with cpu_linear.fast_linears(target, compact=[drafter]):
            compact = drafter.draft_vocab_logits(hidden)
        assert calls() - before == 1
        torch.testing.assert_close(compact, F.linear(hidden, rows.bfloat16().float()), rtol=1e-5, atol=1e-5)
        assert not torch.equal(compact, reference)  # the rows were rounded to bf16 for drafting


@needs_kernel
def test_generate_compacts_a_laspec_drafter_and_still_equals_plain(monkeypatch):
    target = build_model("llama", hidden_size=64)
    inputs = make_inputs("llama", batch_size=1)
    expected = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    drafter = _laspec_drafter(target)
    copies = []
    original = cpu_linear._compact_copy
    monkeypatch.setattr(cpu_linear, "_compact_copy", lambda w, holder: copies.append(w) or original(w, holder))
    for compact in (True, False):
        copies.clear()
        with cpu_linear.use_compact_weights(compact):
            out = target.generate(**inputs, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                                  spec_strategy="laspec", return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert bool(copies) == compact
        # copies of the drafter's own layers (and of the draft head's rows), never of one of the target's layers;
        # none outlives the call
        target_weights = {id(p) for p in target.parameters()}
        drafter_weights = {id(p) for p in drafter.parameters()}
        assert not any(id(w) in target_weights for w in copies)
        assert any(id(w) in drafter_weights for w in copies) == compact
        assert not any(cpu_linear._COMPACT_KEY in m.__dict__ for m in (*drafter.modules(), *target.modules()))


@needs_kernel
def test_single_row_steps_reach_the_kernel_only_inside_single_row_kernel(calls):
    """The plain mode's one-row steps run on the kernel inside `single_row_kernel`; elsewhere one row goes to torch
    (bitwise plain decoding), and the setting ends with its block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    x = torch.randn(1, 64)
    with torch.no_grad(), cpu_linear.fast_linears(model):
        assert torch.equal(model(x), F.linear(x, model[0].weight, model[0].bias)) and calls() == 0
        with cpu_linear.single_row_kernel():
            got = model(x)
        assert calls() == 1
        torch.testing.assert_close(got, F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)
        model(x)
        assert calls() == 1
    with pytest.raises(ValueError, match="True or False"):
        cpu_linear.single_row_kernel("yes")
