"""LaSpec drafters as ordinary HF checkpoints: shipped ones by name, model cards, Hub upload.

    from hf_adaptive_spec.drafters.hub import load_drafter
    drafter = load_drafter("laspec-smollm2-135m-instruct", target)   # shipped in this package, offline
    drafter = load_drafter("path/to/folder", target)                 # any save_pretrained folder
    out = target.generate(**inputs, assistant_model=drafter, spec_strategy="laspec")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..adapters.compat import vocab_size
from .laspec import LaSpecDrafterConfig, LaSpecDrafterModel

__all__ = ["SHIPPED_DRAFTERS", "describe_datastore", "drafter_path", "is_laspec_folder", "list_drafters",
           "load_drafter", "push_drafter_to_hub", "write_model_card"]

_CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"

# name -> (folder inside the package, the registry name of the target it was trained for)
SHIPPED_DRAFTERS: dict[str, tuple[str, str]] = {
    "laspec-smollm2-135m-instruct": ("laspec-smollm2-135m-instruct", "smollm2-135m-instruct"),
    "laspec-scenes-vlm-135m": ("laspec-scenes-vlm-135m", "scenes-vlm-135m"),
    "laspec-qwen2.5-coder-1.5b-instruct": ("laspec-qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct"),
}


def list_drafters() -> list[str]:
    """Names of the drafters shipped with the package."""
    return sorted(SHIPPED_DRAFTERS)


def drafter_path(name: str) -> Path:
    """The folder of a shipped drafter."""
    if name not in SHIPPED_DRAFTERS:
        raise KeyError(f"Unknown drafter {name!r}; shipped drafters: {', '.join(list_drafters())}.")
    path = _CHECKPOINTS / SHIPPED_DRAFTERS[name][0]
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"The shipped drafter {name!r} is missing from {path} (a broken install?).")
    return path


def is_laspec_folder(path) -> bool:
    config = Path(path) / "config.json"
    if not config.exists():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") == LaSpecDrafterConfig.model_type
    except (OSError, ValueError):
        return False


def load_drafter(name_or_path, target, dtype=None) -> LaSpecDrafterModel:
    """A LaSpec drafter from a shipped name or a folder, attached to `target`, in eval mode on its device.

    Raises `ValueError` when the drafter was made for a different vocabulary or hidden size than `target`.
    """
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        path = drafter_path(str(name_or_path))
    if not is_laspec_folder(path):
        raise ValueError(f"{path} is not a LaSpec drafter folder (config.json model_type != 'laspec_drafter').")
    dtype = dtype or target.dtype
    model = LaSpecDrafterModel.from_pretrained(path, dtype=dtype)
    vocab = vocab_size(target)
    if model.config.vocab_size != vocab and model.config.vocab_size != target.get_output_embeddings().weight.shape[0]:
        raise ValueError(f"The drafter at {path} was trained for a {model.config.vocab_size}-token vocabulary; "
                         f"the target has {vocab}.")
    return model.attach_target(target).to(target.device).eval()


def write_model_card(folder, info: dict) -> Path:
    """README.md for a drafter folder: target, data, training settings, measured acceptance."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    train = info.get("train_config", {})
    evals = info.get("evals", [])
    last = evals[-1] if evals else {}
    lines = [
        "---",
        "library_name: hf_adaptive_spec",
        "tags: [speculative-decoding, laspec, drafter]",
        f"base_model: {info.get('target_hub_id') or info.get('target', '')}",
        "---",
        "",
        f"# LaSpec drafter for {info.get('target', 'its target')}",
        "",
        "A block-parallel LaSpec drafter (`hf_adaptive_spec.LaSpecDrafterModel`): one forward proposes "
        f"{config.get('block_size')} tokens from the target's own hidden states (layers "
        f"{config.get('target_layer_ids')}); the target's embedding and LM head are used at run time and are "
        "not stored here. Speculative decoding with it is exact: greedy output equals the target's own.",
        "",
        "```python",
        "import hf_adaptive_spec",
        "from hf_adaptive_spec.drafters.hub import load_drafter",
        "drafter = load_drafter(\"<this folder or shipped name>\", target)",
        "out = target.generate(**inputs, assistant_model=drafter, spec_strategy=\"laspec\")",
        "```",
        "",
        "## Training",
        f"- target: `{info.get('target', '')}`",
        f"- data: {info.get('data_description', '')}",
        f"- examples: {info.get('num_train_examples', '?')} training sequences ({info.get('num_train_tokens', '?')} "
        f"tokens), {info.get('num_eval_examples', '?')} held-out sequences",
        f"- loss: `{train.get('loss')}` (acceptance-aware = cross-entropy weighted by the chance each block "
        "position is reached; ce = plain cross-entropy)",
        f"- steps {train.get('steps_run', train.get('steps'))}, learning rate {train.get('learning_rate')}, "
        f"{train.get('batch_sequences')} "
        f"sequences x {train.get('anchors')} anchors per step, seed {train.get('seed')}",
        f"- drafter: {config.get('num_hidden_layers')} layer(s), hidden {config.get('hidden_size')}, "
        f"{info.get('num_parameters', '?')} parameters, block {config.get('block_size')}",
        f"- training time: {info.get('train_seconds', 0):.0f} s on {info.get('device', '?')}",
    ]
    if info.get("command"):
        lines.append(f"- command: `{info['command']}`")
    if info.get("init_from"):
        lines.append(f"- initialized from `{info['init_from']}` (fine-tuned with `--init-from`)")
    for number, stage in enumerate(info.get("stages", []), 1):  # the runs an `--init-from` chain continues
        lines.append(f"- stage {number} (what `--init-from` started from): `{stage['command']}`; "
                     f"{stage['train_seconds']:.0f} s of training, held-out tau_chain {stage['tau_chain']:.3f} "
                     "on its own held-out sequences")
    vocab = info.get("draft_vocab")
    if vocab:
        kept = vocab.get("kept_from_init")
        lines.append(f"- draft vocabulary: the {vocab['size']} tokens the target produced most often in the training "
                     f"answers ({100 * vocab['train_coverage']:.2f}% of them)"
                     + (f", of which {kept} places the answers left empty keep the initial drafter's tokens"
                        if kept else "")
                     + "; the drafter never proposes others, the target still verifies every token")
    lines += ["", "## Measured"]
    if last:
        lines.append(f"- held-out teacher-forced chain acceptance: {last['accepted']:.3f} tokens per block "
                     f"(tau_chain {last['tau_chain']:.3f}); per-position top-1 "
                     f"{[round(x, 3) for x in last['top1']]}")
    for row in info.get("bench", []):
        lines.append(f"- `hf-adaptive-spec bench` ({row['setting']}): {row['prompts']}: tau {row['tau']:.2f}, "
                     f"{row['speedup']:.2f}x over plain greedy decoding")
    for row in info.get("generate_eval", []):
        lines.append(f"- `generate(spec_strategy=\"laspec\")` on {row['prompt']}: tau {row['tau']:.2f}, "
                     f"{row['speedup']:.2f}x over plain greedy (same output: {row['same']})")
    lines.append("")
    path = folder / "README.md"
    path.write_text("\n".join(lines))
    describe_datastore(folder)
    return path


def describe_datastore(folder) -> Path | None:
    """Give the folder's model card (`README.md`) a `## Datastore` section describing its `datastore.safetensors`
    (replacing an earlier one), or drop that section when the folder has no datastore. Returns the card's path
    (None without a card)."""
    from .datastore import DATASTORE_FILE, TokenDatastore

    folder = Path(folder)
    card = folder / "README.md"
    if not card.exists():
        return None
    text = card.read_text()
    start = text.find("\n## Datastore\n")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + text[end:] if end >= 0 else text[:start].rstrip("\n") + "\n"
    if (folder / DATASTORE_FILE).exists():
        store = TokenDatastore.load(folder / DATASTORE_FILE)
        info = store.info
        lines = ["", "## Datastore", "",
                 f"`{DATASTORE_FILE}`: {store!r}; under greedy decoding `laspec` adds the continuation its "
                 "occurrences share for the sequence's longest matching suffix as one more branch of each tree "
                 "(`spec_config={\"datastore\": False}` turns it off; outputs never change)."]
        if info:
            lines.append(f"- made by `hf-adaptive-spec build-datastore` from {', '.join(info.get('data', []))}: "
                         f"{info.get('generated', 0)} answers by the target ({info.get('max_new_tokens')} tokens "
                         f"max), {info.get('answered', 0)} answers of answered sets, {info.get('tokens', 0)} tokens")
        text = text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    card.write_text(text)
    return card


def push_drafter_to_hub(folder, repo_id: str, token: str | None = None, private: bool = False) -> str:
    """Upload a drafter folder (weights, config, model card) to the Hub; returns the repo URL."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    if not is_laspec_folder(folder):
        raise ValueError(f"{folder} is not a LaSpec drafter folder.")
    api = HfApi(token=token)
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, allow_patterns=["*.json", "*.safetensors", "*.md"])
    return str(url)
