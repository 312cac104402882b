"""More training prompts than the benchmark sets hold, all available offline.

A drafter learns the target's own answers, so what matters is how many DIFFERENT prompts the target answers.
HumanEval (164) and MT-Bench (80) are small, and their first prompts are the benchmark's. Two more sources:

* `stdlib_code_prompts`: HumanEval-style tasks (same instruction, a signature and a docstring) made from the
  documented public functions of the Python standard library on this machine (parsed with `ast`, never
  imported). The set depends on the Python version; its order is fixed for one version.
* `template_prompts`: assistant requests in MT-Bench's eight categories from fixed templates, filled with
  topics, names and random numbers (the target's sampled self-written questions were tried first: a 135M
  model writes mostly incoherent ones).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path


from ..data import HUMANEVAL_INSTRUCTION, Prompt

__all__ = ["stdlib_code_prompts", "template_prompts", "PROMPT_SOURCES"]

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


def stdlib_code_prompts(seed: int = 0) -> list:
    """HumanEval-style prompts from the documented module-level functions of the standard library.

    Returns a list of [`~hf_adaptive_spec.data.Prompt`] (dataset `"stdlib"`, category `"code"`), shuffled
    with `seed` so that any slice mixes modules.
    """
    prompts, seen = [], set()
    for root, path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            text = _function_prompt(node)
            if text is None or text in seen:
                continue
            seen.add(text)
            content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{text}```"
            prompts.append(Prompt(f"stdlib/{module}.{node.name}", "stdlib", "code",
                                  [{"role": "user", "content": content}]))
    random.Random(seed).shuffle(prompts)
    return prompts


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


#: prompt sets the training CLI knows beyond `hf_adaptive_spec.data`'s benchmark sets
PROMPT_SOURCES = ("stdlib", "templates")
