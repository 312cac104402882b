"""Resumable checkpoints of the training loops: ``out_dir/checkpoint-N/`` holds ``training_state.pt`` (what the
loop needs to go on: trained weights, optimizer, step, history, evaluations) and ``progress.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

__all__ = ["latest_checkpoint", "resume_state", "save_checkpoint"]

STATE_FILE = "training_state.pt"


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    """The ``checkpoint-N`` folder of `out_dir` with the largest N, or None."""
    checkpoints = sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return checkpoints[-1] if checkpoints else None


def resume_state(out_dir: Optional[Path], resume: bool, log=print) -> tuple:
    """`(state, step, history, evals)` to start from: the latest checkpoint's state when `resume` and `out_dir`
    has one (logged), else `(None, 0, [], [])`."""
    if not resume or out_dir is None or (checkpoint := latest_checkpoint(out_dir)) is None:
        return None, 0, [], []
    state = torch.load(checkpoint / STATE_FILE, weights_only=False)
    log(f"resumed from {checkpoint} at step {state['step']}")
    return state, state["step"], state["history"], state["evals"]


def save_checkpoint(out_dir: Path, step: int, state: dict, evals: list) -> Path:
    """Write ``out_dir/checkpoint-{step}/`` (`state` and the evaluations so far); returns the folder."""
    checkpoint = out_dir / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True, exist_ok=True)
    torch.save(state, checkpoint / STATE_FILE)
    (checkpoint / "progress.json").write_text(json.dumps({"step": step, "evals": evals}, indent=1) + "\n")
    return checkpoint
