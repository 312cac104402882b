"""Multi-object scenes with grounded descriptions, built from the pinned ``easy-vqa`` package's shape images.

A scene is a 2x2 grid of four 64x64 easy-vqa images (128x128 pixels, so a vision tower with 16-pixel patches
sees 8x8 = 64 visual tokens and each object fills a quarter of them), with a description that names every
object's colour and shape by position, and questions about single positions::

    from hf_adaptive_spec.scenes.dataset import make_scenes

    scene = make_scenes("test", 1)[0]
    scene.image                     # PIL.Image, 128x128 RGB
    scene.description               # "Top left: a red circle. Top right: a teal triangle. ..."
    scene.questions[0]              # ("What color is the shape at the bottom right?", "The shape at the bottom right is gray.")

Scenes are deterministic in (split, index, seed); ``"train"`` scenes use easy-vqa's train images only and
``"test"`` scenes its test images only, so no held-out scene shares a source image with training.

Labels: easy-vqa ships questions, not labels. Each image shows one shape in one colour; both are read from
the image's questions: open questions give them directly ("what color is the circle?" -> blue names colour
and shape), yes/no questions confirm or exclude a value (negated questions such as "does the image not contain
a circle?" flip the answer), and an attribute with one value left after exclusions is that value. Images whose
colour or shape stays undetermined (about 10%) are not used.
"""

from __future__ import annotations

import io
import json
import random
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional

__all__ = [
    "COLORS",
    "POSITIONS",
    "SHAPES",
    "Scene",
    "describe",
    "grounded_words",
    "image_labels",
    "make_scenes",
    "scene_messages",
]

EASY_VQA = ("easy-vqa", "1.0", "fcb51b309b78c7b00f97b64cdbcbcf5c105f94da1b39c0796cee5a787c4f650f")
COLORS = ("black", "blue", "brown", "gray", "green", "red", "teal", "yellow")
SHAPES = ("circle", "rectangle", "triangle")
#: Quadrants in reading order, as (name, column, row) of the 2x2 grid.
POSITIONS = (("top left", 0, 0), ("top right", 1, 0), ("bottom left", 0, 1), ("bottom right", 1, 1))
TILE = 64
DESCRIBE_REQUEST = "Describe the picture."
SPLITS = ("train", "test")


def _archive(cache_dir=None, downloader=None) -> Path:
    from ..registry.data import fetch_package

    package, version, sha256 = EASY_VQA
    return fetch_package(package, version, sha256, cache_dir=cache_dir, downloader=downloader)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")


def _negated(question: str) -> bool:
    padded = f" {question} "
    return " not " in padded or question.startswith("is no ")


def labels_from_questions(questions: list) -> dict:
    """``{image id: (colour, shape)}`` from easy-vqa ``[question, answer, image id]`` triples (see the module
    docstring); images whose colour or shape is not determined are left out.

    Raises:
        ValueError: the questions contradict each other about an image.
    """
    confirmed: dict = {}
    excluded: dict = {}
    for question, answer, image_id in questions:
        words = question.rstrip("?").split()
        named = [w for w in words if w in COLORS or w in SHAPES]
        if answer in COLORS or answer in SHAPES:
            facts, holds = named + [answer], True  # the answer and the words the question names both hold
        elif answer in ("yes", "no"):
            facts, holds = named, (answer == "yes") != _negated(question)
        else:
            continue
        target = confirmed if holds else excluded
        for word in facts:
            target.setdefault(image_id, set()).add(word)
    labels = {}
    for image_id in sorted(set(confirmed) | set(excluded)):
        yes, no = confirmed.get(image_id, set()), excluded.get(image_id, set())
        if yes & no:
            raise ValueError(f"easy-vqa image {image_id}: questions both confirm and exclude {sorted(yes & no)}.")
        values = []
        for options in (COLORS, SHAPES):
            known = [w for w in options if w in yes]
            left = [w for w in options if w not in no]
            if len(known) > 1:
                raise ValueError(f"easy-vqa image {image_id}: several values confirmed: {known}.")
            values.append(known[0] if known else (left[0] if len(left) == 1 else None))
        if None not in values:
            labels[image_id] = tuple(values)
    return labels


@lru_cache(maxsize=4)
def _labels_and_archive(split: str, archive: Path) -> dict:
    with zipfile.ZipFile(archive) as wheel:
        questions = json.loads(wheel.read(f"easy_vqa/data/{split}/questions.json"))
    return labels_from_questions(questions)


def image_labels(split: str, cache_dir=None, downloader=None) -> dict:
    """``{image id: (colour, shape)}`` of the easy-vqa images of `split` (``"train"`` or ``"test"``) whose
    labels the questions determine."""
    _check_split(split)
    return dict(_labels_and_archive(split, _archive(cache_dir, downloader)))


def describe(objects: tuple) -> str:
    """The grounded description of four ``(colour, shape)`` objects in :data:`POSITIONS` order."""
    parts = [f"{name.capitalize()}: a {color} {shape}." for (name, _, _), (color, shape) in zip(POSITIONS, objects)]
    return " ".join(parts)


def grounded_words() -> frozenset:
    """The words a scene's image decides: colours and shapes."""
    return frozenset(COLORS + SHAPES)


@dataclass
class Scene:
    """One 2x2 scene: its id, source easy-vqa images, objects, image, description and questions."""

    id: str
    split: str
    image_ids: tuple  # (4,) easy-vqa image ids in POSITIONS order
    objects: tuple  # (4,) (colour, shape) in POSITIONS order
    image: object = field(repr=False)  # PIL.Image.Image, 128x128 RGB
    description: str = ""
    questions: list = field(default_factory=list)  # [(question, answer)]

    def to_dict(self) -> dict:
        return {"id": self.id, "split": self.split, "image_ids": list(self.image_ids),
                "objects": [list(o) for o in self.objects], "description": self.description,
                "questions": [list(q) for q in self.questions]}


def _questions(objects: tuple, rng: random.Random) -> list:
    out = []
    for (name, _, _), (color, shape) in zip(POSITIONS, objects):
        out.append((f"What color is the shape at the {name}?", f"The shape at the {name} is {color}."))
        out.append((f"What shape is at the {name}?", f"A {shape}."))
    rng.shuffle(out)
    return out


def _compose(wheel: zipfile.ZipFile, split: str, image_ids: tuple):
    from PIL import Image

    canvas = Image.new("RGB", (2 * TILE, 2 * TILE))
    for (_, column, row), image_id in zip(POSITIONS, image_ids):
        tile = Image.open(io.BytesIO(wheel.read(f"easy_vqa/data/{split}/images/{image_id}.png"))).convert("RGB")
        if tile.size != (TILE, TILE):
            raise ValueError(f"easy-vqa image {split}/{image_id} is {tile.size}, expected {TILE}x{TILE}.")
        canvas.paste(tile, (column * TILE, row * TILE))
    return canvas


def make_scenes(split: str, count: int, seed: int = 0, start: int = 0, cache_dir=None,
                downloader=None) -> list:
    """Scenes ``start .. start + count - 1`` of `split`, deterministic in (split, index, seed).

    Args:
        split: ``"train"`` (easy-vqa's train images) or ``"test"`` (its test images: held out).
        count: number of scenes.
        seed: selects another sequence of scenes.
        start: index of the first scene (scene `i` is the same whatever `start` and `count` are).
        cache_dir, downloader: the data cache and downloader of :func:`hf_adaptive_spec.registry.data.fetch_package`.

    Returns:
        list of :class:`Scene`; the four images of one scene are distinct.
    """
    _check_split(split)
    if count < 0 or start < 0:
        raise ValueError(f"count and start must be >= 0, got count={count}, start={start}.")
    archive = _archive(cache_dir, downloader)
    labels = _labels_and_archive(split, archive)
    ids = sorted(labels)
    scenes = []
    with zipfile.ZipFile(archive) as wheel:
        for index in range(start, start + count):
            rng = random.Random(f"scenes/{split}/{seed}/{index}")
            image_ids = tuple(rng.sample(ids, len(POSITIONS)))
            objects = tuple(labels[i] for i in image_ids)
            scenes.append(Scene(
                id=f"scenes/{split}/{seed}/{index}", split=split, image_ids=image_ids, objects=objects,
                image=_compose(wheel, split, image_ids), description=describe(objects),
                questions=_questions(objects, rng),
            ))
    return scenes


def scene_messages(request: str, answer: Optional[str] = None) -> list:
    """Chat messages asking `request` about one image (and the assistant's `answer`, when given)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": request}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages
