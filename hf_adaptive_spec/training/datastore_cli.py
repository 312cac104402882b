"""`hf-adaptive-spec build-datastore`: the target's own answers to training prompts as a drafter's datastore.

    hf-adaptive-spec build-datastore --target smollm2-135m-instruct --data "sharegpt[:3000]" \\
        --out path/to/drafter_folder --generate-dtype bfloat16 --answers-cache answers.json

The target answers each prompt greedily (batched, left-padded); the answers become a
[`~hf_adaptive_spec.drafters.datastore.TokenDatastore`] written as `datastore.safetensors` into a LaSpec drafter folder
(which `from_pretrained` then loads with the weights) or to a `.safetensors` file. ANSWERED prompt sets
(`sharegpt_answers`, ...) contribute their own answers' tokens, nothing is generated. Keep the benchmark's
prompts out (`--data` slices as in `train-drafter`): a store that holds the answers being measured would
measure recall, not speed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--target", required=True, help="registry name or local HF folder of the target")
    parser.add_argument("--data", nargs="+", required=True,
                        help="prompt sets as DATASET[START:END], the names `train-drafter --data` takes")
    parser.add_argument("--out", required=True,
                        help="a LaSpec drafter folder (the store goes in as datastore.safetensors) or a "
                             ".safetensors file")
    parser.add_argument("--answers-cache", default=None, metavar="FILE.json",
                        help="reuse / store the answers ({prompt id: token ids}) in this file: prompts it holds "
                             "are not answered again (the file is updated as answers come); make it with the same "
                             "target and --max-new-tokens (longer cached answers are an error)")
    parser.add_argument("--cached-only", action="store_true",
                        help="generate nothing: of the prompts --data selects for answering, keep only those the "
                             "--answers-cache answers already (e.g. a store from an interrupted answering run)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer length per prompt")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts answered per generate call")
    parser.add_argument("--generate-dtype", choices=["same", "bfloat16"], default="same",
                        help="answer with a bfloat16 copy of the target (faster on CPUs with AMX)")
    parser.add_argument("--min-ngram", type=int, default=2, help="shortest suffix the store matches")
    parser.add_argument("--max-ngram", type=int, default=8, help="longest suffix the store matches")
    parser.add_argument("--max-occurrences", type=int, default=256, help="occurrences voted on per query")
    parser.add_argument("--seed", type=int, default=0, help="order of the generated prompt sets (as train-drafter)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _answered_tokens(tokenizer, prompt) -> list:
    """An answered prompt's own answer as token ids (the assistant message's text alone)."""
    return tokenizer(prompt.messages[-1]["content"], add_special_tokens=False)["input_ids"]


@torch.no_grad()
def answer_prompts(model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int, cache: dict | None = None,
                   save=None, progress: bool = True) -> dict:
    """`{prompt id: greedy answer token ids}` (cut after the first EOS) for chat `prompts`, answered in
    left-padded batches of similar length; ids already in `cache` are kept, not answered again. `save(answers)`
    is called after every batch (to keep a cache file current)."""
    from tqdm.auto import tqdm

    from ..chat_template import encode_chat
    from .data import cut_at_eos, left_padded

    answers = dict(cache or {})
    todo = [prompt for prompt in prompts if prompt.id not in answers]
    encoded = [encode_chat(tokenizer, prompt.messages)["input_ids"][0] for prompt in todo]
    order = sorted(range(len(todo)), key=lambda i: len(encoded[i]))  # similar lengths batch together
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bar = tqdm(total=len(todo), desc="answers", disable=not progress or not todo)
    for begin in range(0, len(order), batch_size):
        rows = order[begin : begin + batch_size]
        input_ids, attention_mask = left_padded([encoded[i] for i in rows], pad)
        out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        for r, i in enumerate(rows):
            answers[todo[i].id] = cut_at_eos(out[r, input_ids.shape[1]:].cpu(), tokenizer.eos_token_id).tolist()
        if save is not None:
            save(answers)
        bar.update(len(rows))
    bar.close()
    return answers


def run(args) -> int:
    from ..chat_template import text_tokenizer
    from ..loading import load_model, resolve_path as _resolve_path
    from ..drafters.datastore import DATASTORE_FILE, TokenDatastore
    from ..drafters.hub import describe_datastore, is_laspec_folder
    from .cli import prompts_by_spec
    from .data import is_answered

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out).expanduser()
    if out.is_dir():
        if not is_laspec_folder(out):
            raise SystemExit(f"--out {out} is a folder but not a LaSpec drafter folder (config.json model_type).")
        out_file = out / DATASTORE_FILE
    elif out.suffix == ".safetensors":
        out_file = out
    else:
        raise SystemExit(f"--out {out}: expected a LaSpec drafter folder or a .safetensors file.")
    if not 1 <= args.min_ngram <= args.max_ngram:
        raise SystemExit(f"--min-ngram / --max-ngram need 1 <= min <= max, got {args.min_ngram}, {args.max_ngram}.")
    by_spec = prompts_by_spec(args.data, args.seed)
    prompts = [prompt for _, selected in by_spec for prompt in selected]
    for answered_set in (False, True):  # a request may come both answered by the target and with its own answer
        ids = [prompt.id for prompt in prompts if is_answered(prompt) == answered_set]
        if len(set(ids)) != len(ids):
            raise SystemExit("--data selects some prompts twice (overlapping slices).")

    answered = [prompt for prompt in prompts if is_answered(prompt)]
    to_generate = [prompt for prompt in prompts if not is_answered(prompt)]
    cache_path = Path(args.answers_cache).expanduser() if args.answers_cache else None
    cache = json.loads(cache_path.read_text()) if cache_path is not None and cache_path.exists() else {}
    if args.cached_only and cache_path is None:
        raise SystemExit("--cached-only needs --answers-cache.")
    model, processor = load_model(str(_resolve_path(args.target)))
    tokenizer = text_tokenizer(processor)

    def save(answers):
        if cache_path is not None:
            tmp = cache_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(answers))
            tmp.replace(cache_path)

    if args.cached_only:
        to_generate = [prompt for prompt in to_generate if prompt.id in cache]
    too_long = [prompt.id for prompt in to_generate if len(cache.get(prompt.id, ())) > args.max_new_tokens]
    if too_long:
        raise SystemExit(f"--answers-cache {cache_path} holds answers longer than --max-new-tokens "
                         f"{args.max_new_tokens} (e.g. {too_long[:3]}): it was made with other settings.")
    start = time.perf_counter()
    generator = model
    if to_generate and args.generate_dtype == "bfloat16" and model.dtype != torch.bfloat16:
        import copy

        generator = copy.deepcopy(model).to(torch.bfloat16)
    answers = answer_prompts(generator, tokenizer, to_generate, args.max_new_tokens, args.batch_size,
                             cache=cache, save=save,
                             progress=not args.no_progress)
    sequences = [answers[prompt.id] for prompt in to_generate]
    sequences += [_answered_tokens(tokenizer, prompt) for prompt in answered]
    seconds = time.perf_counter() - start
    info = {"target": args.target, "data": list(args.data), "prompts": len(to_generate) + len(answered),
            "cached_only": bool(args.cached_only), "generated": len(to_generate),
            "answered": len(answered), "max_new_tokens": args.max_new_tokens, "generate_dtype": args.generate_dtype,
            "tokens": sum(len(sequence) for sequence in sequences)}
    store = TokenDatastore.from_sequences(sequences, min_ngram=args.min_ngram, max_ngram=args.max_ngram,
                                          max_occurrences=args.max_occurrences, info=info)
    store.save(out_file)
    if out_file.parent == out:  # a drafter folder: its model card says what the store holds
        describe_datastore(out)
    print(json.dumps({"out": str(out_file), "store": repr(store), "seconds": round(seconds, 1),
                      "bytes": out_file.stat().st_size, **info}))
    return 0
