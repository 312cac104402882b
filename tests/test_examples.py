"""Every script in examples/ and the quickstart notebook run end to end on tiny random-weight models
(``HF_ADAPTIVE_SPEC_EXAMPLES=tiny``, `hf_adaptive_spec.examples_support`): each in its own process as a user
runs it, the notebook in a real Jupyter kernel, and every speculative output they compare equals plain
`generate`'s."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_adaptive_spec import examples_support

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOK = EXAMPLES / "colab_quickstart.ipynb"
TIMEOUT = 300  # seconds for one example: a hung run fails instead of blocking the suite
ALL_STRATEGIES = ("plain", "chain", "static_tree", "sage", "laspec")


@pytest.fixture
def tiny_env(monkeypatch):
    monkeypatch.setenv(examples_support.EXAMPLES_ENV, "tiny")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models: more threads only add overhead on a busy machine
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # bench_ops_gpu.py on a machine without a GPU


def run_example(script: str, *args: str, cwd: Path) -> str:
    """The stdout of ``python examples/SCRIPT ARGS`` (cwd `cwd`), which must exit with 0."""
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, f"{script} exited with {result.returncode}:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-3000:]}"
    return result.stdout


def test_every_example_is_run_here():
    covered = {"text_pair.py", "custom_strategy_settings.py", "laspec_drafter.py", "vlm_with_image.py",
               "train_drafter_timed.py", "bench_ops_gpu.py", NOTEBOOK.name}
    assert {path.name for path in EXAMPLES.iterdir() if path.suffix in (".py", ".ipynb")} == covered


def test_tiny_mode_reads_the_variable(monkeypatch):
    monkeypatch.delenv(examples_support.EXAMPLES_ENV, raising=False)
    assert not examples_support.tiny_mode()
    monkeypatch.setenv(examples_support.EXAMPLES_ENV, "tiny")
    assert examples_support.tiny_mode()
    monkeypatch.setenv(examples_support.EXAMPLES_ENV, "small")
    with pytest.raises(ValueError, match="expected 'tiny'"):
        examples_support.tiny_mode()


def test_text_pair(tiny_env, tmp_path):
    out = run_example("text_pair.py", "--max-new-tokens", "16", cwd=tmp_path)
    assert "identical to plain greedy: True" in out and "tau (tokens per target forward)" in out


def test_custom_strategy_settings(tiny_env, tmp_path):
    out = run_example("custom_strategy_settings.py", "--max-new-tokens", "16", cwd=tmp_path)
    assert "rejected: SageConfig.d_min" in out
    assert out.count("identical to plain: True") == 6 and "identical to plain: False" not in out


def test_laspec_drafter_shipped_then_trained(tiny_env, tmp_path):
    out = run_example("laspec_drafter.py", "--max-new-tokens", "16", "--train-steps", "2", cwd=tmp_path)
    assert out.count("same as plain greedy: True") == 2  # the given drafter, then the one trained and reloaded


def test_vlm_with_image(tiny_env, tmp_path):
    out = run_example("vlm_with_image.py", "--max-new-tokens", "16", "--save-image", "scene.png", cwd=tmp_path)
    assert "4 of them image tokens" in out and (tmp_path / "scene.png").is_file()
    verdicts = re.findall(r"^(.*): .*identical to plain: (\w+)$", out, flags=re.MULTILINE)
    assert [same for _, same in verdicts] == ["True"] * 3
    assert "image-aware" in verdicts[0][0] and verdicts[1][0].startswith("laspec")


def test_train_drafter_timed(tiny_env, tmp_path):
    out = run_example("train_drafter_timed.py", "--budget", "60", "--out", "drafter", "--specs", "templates",
                      "--max-prompts", "6", "--max-new-tokens", "12", "--steps", "3", "--eval-fraction", "0.2",
                      cwd=tmp_path)
    assert "done" in out
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["model_type"] == "laspec_drafter" and (tmp_path / "drafter" / "model.safetensors").is_file()


def test_bench_ops_gpu_checks_every_op(tiny_env, tmp_path):
    pytest.importorskip("triton")
    run_example("bench_ops_gpu.py", "--out", "ops.json", cwd=tmp_path)
    report = json.loads((tmp_path / "ops.json").read_text())
    assert report["all_equal"]
    assert {row["op"] for row in report["results"]} == {
        "ancestor_matrix", "tree_attention_mask", "greedy_accept", "compact_kv_", "sage_confidence", "quantize_int8",
        "visual_scores", "visual_vote"}


def _strategy_lines(notebook) -> dict:
    """{strategy: its printed line} from the outputs of the notebook's every-strategy cell."""
    text = "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for output in cell.get("outputs", []))
    return {match.group(1): match.group(0) for match in re.finditer(r"^(\w+) +same as plain generate: .*$", text,
                                                                        flags=re.MULTILINE)}


def test_stored_notebook_shows_every_strategy_equal_to_plain():
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    intro = notebook.cells[0].source
    assert all(f'"{strategy}"' in intro for strategy in ALL_STRATEGIES) and "2026-12-06" in intro
    lines = _strategy_lines(notebook)
    assert sorted(lines) == sorted(ALL_STRATEGIES)
    assert all("same as plain generate: True" in line for line in lines.values())


def test_notebook_executes_on_tiny_models(tiny_env, monkeypatch, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("MAX_NEW_TOKENS", "16")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    lines = _strategy_lines(notebook)
    assert sorted(lines) == sorted(ALL_STRATEGIES)
    assert all("same as plain generate: True" in line for line in lines.values())
    printed = "".join(output.get("text", "") for output in notebook.cells[-2].outputs)
    assert "sage with the image-aware drafter: identical to plain greedy: True" in printed
