"""Training data for a LaSpec drafter, made by the target itself (teacher forcing).

An example is one token sequence with, per position t:

* `hidden`: the target's hidden states after the drafter's `target_layer_ids`, concatenated (fp16 on disk);
* `labels`: the target's greedy next token after position t given the true prefix (its argmax);
* `on_policy`: True where the sequence's token at t + 1 IS that greedy token.

Sequences come from the target's own greedy generations on chat prompts (fully on-policy after the prompt:
what the drafter sees at decoding time), from conversations that already hold a real answer (teacher-forced in
the chat format, nothing generated), and optionally from plain real text (teacher-forced labels only).
A block anchored at p trains position k only while the tokens p+1..p+k are the target's own greedy tokens
(`on_policy`), because at decoding time the drafter's k-th guess continues an accepted, i.e. greedy, prefix.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from ..adapters.compat import cache_argument
from ..chat_template import encode_chat
from ..drafters.laspec import gather_target_hidden

__all__ = ["DrafterExample", "EncodedPrompt", "build_examples", "answer_token_counts", "frequent_tokens", "examples_from_sequences", "load_examples", "save_examples"]


@dataclass
class EncodedPrompt:
    """A prompt already encoded by the target's processor, batch of one: e.g. a VLM prompt with an image.

    `inputs` holds `input_ids` `(1, S)` and the model's other inputs (`attention_mask`, `pixel_values`,
    `image_grid_thw`, `mm_token_type_ids`, ...), as `processor.apply_chat_template(..., return_dict=True,
    return_tensors="pt")` returns them.
    """

    id: str
    inputs: dict


def left_padded(encoded: list, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` `(B, max S)` of `(S,)` id tensors, padded on the left with `pad`."""
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids):] = ids
        attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


def cut_at_eos(answer: torch.Tensor, eos) -> torch.Tensor:
    if eos is not None and bool((answer == eos).any()):
        return answer[: int((answer == eos).nonzero()[0]) + 1]
    return answer


@dataclass
class DrafterExample:
    """One training sequence (all tensors on the CPU; L = sequence length)."""

    input_ids: torch.Tensor  # (L,) long
    hidden: torch.Tensor  # (L, F) fp16
    labels: torch.Tensor  # (L,) long: target argmax after each position
    on_policy: torch.Tensor  # (L,) bool: input_ids[t + 1] == labels[t] (False at the last position)
    source: str = ""
    prompt_length: int = 0  # tokens before the answer (0 for plain text): blocks are anchored in the answer
    visual_embeds: torch.Tensor | None = None  # (T, H) fp16: the target's input embeddings at the image tokens
    visual_slots: torch.Tensor | None = None  # (L, M) long: indices into visual_embeds picked by the query at t
    image_positions: torch.Tensor | None = None  # (L,) bool: the image's placeholder positions

    def __len__(self) -> int:
        return self.input_ids.shape[0]


_TEXT_TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")  # per-token type ids: 0 on the generated text


def _example(ids: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, source: str, prompt_length: int,
             visual_embeds=None, visual_slots=None, image_positions=None) -> DrafterExample:
    """A [`DrafterExample`] from one sequence's `(L,)` ids, fused `(L, F)` hidden states and `(L,)` greedy
    labels (the target's argmax)."""
    labels = labels.cpu()
    ids = ids.cpu()
    on_policy = torch.zeros_like(ids, dtype=torch.bool)
    on_policy[:-1] = ids[1:] == labels[:-1]
    return DrafterExample(ids, hidden.to("cpu", torch.float16), labels, on_policy, source, int(prompt_length),
                          visual_embeds, visual_slots, image_positions)


@torch.no_grad()
def _text_examples(target, items: list, layer_ids: list, batch_tokens: int) -> dict:
    """Teacher-force text-only sequences in right-padded batches of about `batch_tokens` tokens (sorted by
    length). `items` holds `(index, ids, source, prompt_length)`; returns `{index: DrafterExample}`. Right
    padding leaves every real position's causal prefix, hence its states, as in a forward of its own."""
    items = sorted(items, key=lambda item: len(item[1]))
    pad = 0
    examples = {}
    start = 0
    while start < len(items):
        stop = start + 1
        while stop < len(items) and (stop - start + 1) * len(items[stop][1]) <= batch_tokens:
            stop += 1
        chunk = items[start:stop]
        width = len(chunk[-1][1])
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long, device=target.device)
        attention_mask = torch.zeros_like(input_ids)
        for row, (_, ids, _, _) in enumerate(chunk):
            input_ids[row, : len(ids)] = ids.to(target.device)
            attention_mask[row, : len(ids)] = 1
        out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        # one device-to-host copy per batch, then per-row views
        hidden = gather_target_hidden(out.hidden_states, layer_ids).to("cpu", torch.float16)
        labels = out.logits.argmax(-1).cpu()
        for row, (index, ids, source, prompt_length) in enumerate(chunk):
            n = len(ids)
            examples[index] = _example(ids, hidden[row, :n].clone(), labels[row, :n], source, prompt_length)
        start = stop
    return examples


@torch.no_grad()
def examples_from_sequences(target, sequences: list, layer_ids: list, sources: list | None = None,
                            prompt_lengths: list | None = None, model_inputs: list | None = None,
                            num_visual_tokens: int = 8, batch_tokens: int = 0) -> list:
    """Teacher-force the target over each `(L,)` token sequence: its fused hidden states, greedy labels and
    on-policy flags ([`DrafterExample`]).

    Args:
        prompt_lengths: where each sequence's answer starts (0: plain text, blocks anchored anywhere).
        model_inputs: per sequence, the prompt's other model inputs (`pixel_values`, `image_grid_thw`, ...,
            batch of one) for a VLM prompt with an image, else None. Such a sequence also records what the
            decoding loop's visual selection would give a block anchored after each position t: the
            `num_visual_tokens` image tokens picked by the target's query at t (int8 keys, cross-layer vote;
            [`~hf_adaptive_spec.drafters.block.choose_visual_slots`]), and the image tokens' input embeddings.
        batch_tokens (`int`): when > 0, text-only sequences go through the target in right-padded batches of
            about this many tokens (fast on a GPU; equal up to float rounding, tested); 0: one at a time.
    """
    from transformers import DynamicCache

    from ..drafters.block import choose_visual_slots, image_token_mask
    from ..drafters.vision import QueryCapture, VisualKeyStore

    sources = sources if sources is not None else [""] * len(sequences)
    prompt_lengths = prompt_lengths if prompt_lengths is not None else [0] * len(sequences)
    model_inputs = model_inputs if model_inputs is not None else [None] * len(sequences)
    device = target.device
    batched = {}
    if batch_tokens > 0:
        text = [(i, ids, source, length) for i, (ids, source, length, extra)
                in enumerate(zip(sequences, sources, prompt_lengths, model_inputs)) if not extra]
        batched = _text_examples(target, text, list(layer_ids), batch_tokens)
    examples = []
    for index, (ids, source, prompt_length, extra) in enumerate(zip(sequences, sources, prompt_lengths,
                                                                     model_inputs)):
        if index in batched:
            examples.append(batched.pop(index))
            continue
        ids = ids.to(device)
        visual_embeds = visual_slots = None
        extra = {key: value.to(device) if torch.is_tensor(value) else value for key, value in (extra or {}).items()}
        for key in _TEXT_TYPE_KEYS:  # extend per-token type ids over the answer (text)
            if key in extra:
                extra[key] = torch.cat([extra[key], extra[key].new_zeros(1, len(ids) - extra[key].shape[1])], 1)
        mask = image_token_mask(target, ids[None]) if extra and num_visual_tokens > 0 else None
        if mask is None:  # text, or no visual tokens wanted: the image inputs still go in
            out = target(input_ids=ids[None], output_hidden_states=True, use_cache=False, **extra)
        else:
            cache = DynamicCache(config=target.config)
            with QueryCapture(target, layer_ids) as capture:
                out = target(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], use_cache=True,
                             output_hidden_states=True, **{cache_argument(target): cache}, **extra)
            store = VisualKeyStore.from_cache(cache, layer_ids, mask)
            queries = {layer: query[0].transpose(0, 1) for layer, query in capture.queries.items()}  # (L, H, D)
            slots = []
            for first in range(0, len(ids), 32):  # each position's query as its own row, against the same keys
                rows = min(32, len(ids) - first)
                per_position = VisualKeyStore(
                    {layer: q.expand(rows, *q.shape[1:]) for layer, q in store.quantized.items()},
                    {layer: c.expand(rows, *c.shape[1:]) for layer, c in store.scales.items()},
                    store.positions.expand(rows, -1), store.valid.expand(rows, -1), store.counts * rows)
                chunk = {layer: query[first : first + rows] for layer, query in queries.items()}
                slots.append(choose_visual_slots(chunk, per_position, num_visual_tokens))
            slots = torch.cat(slots)  # (L, M) sequence indices, -1: none
            image_positions = store.positions[0]  # (T,) ascending
            local = torch.searchsorted(image_positions, slots.clamp_min(0))
            visual_slots = local.masked_fill(slots < 0, -1).cpu()
            visual_embeds = out.hidden_states[0][0, image_positions].to("cpu", torch.float16)
        hidden = gather_target_hidden(out.hidden_states, layer_ids)[0]
        examples.append(_example(ids, hidden, out.logits[0].argmax(-1), source, prompt_length, visual_embeds,
                                 visual_slots, None if mask is None else mask[0].cpu()))
    return examples


#: tokens kept of a plain text or of an answered prompt's real answer (teacher-forced, never generated)
MAX_TEXT_TOKENS = 256


def prompt_source(prompt) -> str:
    """The `DrafterExample.source` of `prompt`'s examples: its id (`"prompt"` for a bare message list)."""
    return getattr(prompt, "id", "prompt")


def is_answered(prompt) -> bool:
    """Whether `prompt` (a `Prompt` or a message list) ends with an assistant message: its real answer is
    teacher-forced, never generated. An `EncodedPrompt` (a VLM prompt with its image) is always answered by the
    target."""
    if isinstance(prompt, EncodedPrompt):
        return False
    return getattr(prompt, "messages", prompt)[-1]["role"] == "assistant"


@torch.no_grad()
def build_examples(target, tokenizer, layer_ids: list[int], prompts=(), texts=(), max_new_tokens: int = 128,
                   batch_size: int = 8, max_text_tokens: int = MAX_TEXT_TOKENS, progress: bool = True,
                   samples_per_prompt: int = 1, temperature: float = 0.7, generate_dtype=None,
                   num_visual_tokens: int = 8, batch_tokens: int = 0, teacher_dtype=None) -> list:
    """Examples from the target's greedy answers to `prompts` and from plain `texts`.

    Args:
        target: the verifier (causal LM; eval mode).
        tokenizer: its tokenizer (a chat template is used when it has one).
        layer_ids (`list[int]`): target layers the drafter reads (`config.target_layer_ids`).
        prompts: chat prompts (`hf_adaptive_spec.registry.data.Prompt` or a list of messages); the target answers each
            greedily with up to `max_new_tokens` tokens, `batch_size` prompts at a time. A VLM prompt with an
            image comes as an [`EncodedPrompt`] (the processor's output), answered on its own. A prompt whose
            last message is the assistant's is ANSWERED already: that answer (cut to `max_text_tokens` tokens)
            is teacher-forced, nothing is generated (real text in the target's chat format: blocks train
            across it wherever the target would have chosen the same tokens).
        texts: plain strings, cut to `max_text_tokens` tokens, teacher-forced only.
        samples_per_prompt (`int`): answers per prompt: the greedy one, plus `samples_per_prompt - 1` sampled at
            `temperature` (more varied prefixes; their labels are still the target's greedy choices, and a block
            trains only across positions where the sample agreed with them).
        generate_dtype (`torch.dtype`, *optional*): answer with a copy of the target in this dtype (e.g.
            `torch.bfloat16`: about 1.7x faster on a CPU with AMX). Labels and hidden states still come from
            `target` itself, and a block trains only across the answer's tokens that `target` would choose
            greedily, so a token where the copy disagrees is simply not trained across.
        num_visual_tokens (`int`): M, visual tokens recorded per position for prompts with images (the drafter's
            `config.num_visual_tokens`).
        batch_tokens (`int`): teacher-force text sequences in batches of about this many tokens (0: one by one).
        teacher_dtype (`torch.dtype`, *optional*): teacher-force with a copy of the target in this dtype (e.g.
            `torch.bfloat16`: about 4x faster on a CPU with AMX). Its hidden states and greedy labels then stand
            in for the target's: on SmolLM2-135M the bf16 argmax agrees with the fp32 one at 97.5% of the
            positions of real code and the states differ by ~1% (relative norm). Default: the target itself.

    Returns:
        list of [`DrafterExample`].
    """
    from tqdm.auto import tqdm

    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}.")
    sequences, sources, prompt_lengths, extras = [], [], [], []
    encoded_prompts = [prompt for prompt in prompts if isinstance(prompt, EncodedPrompt)]
    prompts = [prompt for prompt in prompts if not isinstance(prompt, EncodedPrompt)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answered = [prompt for prompt in prompts if is_answered(prompt)]
    prompts = [prompt for prompt in prompts if not is_answered(prompt)]
    answerer = target if generate_dtype is None or generate_dtype == target.dtype or not (prompts or encoded_prompts) \
        else copy.deepcopy(target).to(generate_dtype)  # no copy when nothing is generated
    all_encoded = [(prompt, encode_chat(tokenizer, getattr(prompt, "messages", prompt))["input_ids"][0])
                   for prompt in prompts]
    all_encoded.sort(key=lambda pair: len(pair[1]))  # similar lengths batch together: less padding
    bar = tqdm(total=len(all_encoded) + len(encoded_prompts) + len(texts) + len(answered), desc="target data",
               disable=not progress)
    for prompt in answered:
        ids, prompt_length = _answered_ids(tokenizer, getattr(prompt, "messages", prompt), max_text_tokens)
        sequences.append(ids)
        sources.append(prompt_source(prompt))
        prompt_lengths.append(prompt_length)
        extras.append(None)
        bar.update(1)
    for start in range(0, len(all_encoded), batch_size):
        chunk = [prompt for prompt, _ in all_encoded[start : start + batch_size]]
        encoded = [ids for _, ids in all_encoded[start : start + batch_size]]
        input_ids, attention_mask = left_padded(encoded, pad)
        width = input_ids.shape[1]
        for sample in range(samples_per_prompt):
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if sample else {"do_sample": False}
            out = answerer.generate(input_ids=input_ids.to(target.device),
                                     attention_mask=attention_mask.to(target.device), max_new_tokens=max_new_tokens,
                                     pad_token_id=pad, **sampling)
            for row, (prompt, ids) in enumerate(zip(chunk, encoded)):
                answer = cut_at_eos(out[row, width:].cpu(), tokenizer.eos_token_id)
                sequences.append(torch.cat([ids, answer]))
                sources.append(prompt_source(prompt))
                prompt_lengths.append(len(ids))
                extras.append(None)
        bar.update(len(chunk))
    for prompt in encoded_prompts:  # one at a time: each has its own image(s)
        inputs = {key: value.to(target.device) if torch.is_tensor(value) else value
                  for key, value in prompt.inputs.items()}
        if inputs["input_ids"].shape[0] != 1:
            raise ValueError(f"EncodedPrompt {prompt.id!r} must hold a batch of one; got input_ids "
                             f"{tuple(inputs['input_ids'].shape)}.")
        ids = inputs["input_ids"][0].cpu()
        others = {key: value for key, value in prompt.inputs.items() if key not in ("input_ids", "attention_mask")}
        for sample in range(samples_per_prompt):
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if sample else {"do_sample": False}
            out = answerer.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling)
            answer = cut_at_eos(out[0, len(ids):].cpu(), tokenizer.eos_token_id)
            sequences.append(torch.cat([ids, answer]))
            sources.append(prompt.id)
            prompt_lengths.append(len(ids))
            extras.append(others)
        bar.update(1)
    for i, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][:max_text_tokens]
        if len(ids) >= 8:
            sequences.append(torch.tensor(ids, dtype=torch.long))
            sources.append(f"text/{i}")
            prompt_lengths.append(0)
            extras.append(None)
        bar.update(1)
    bar.close()
    if teacher_dtype is None or teacher_dtype == target.dtype:
        teacher = target
    elif answerer is not target and answerer.dtype == teacher_dtype:
        teacher = answerer
    else:
        teacher = copy.deepcopy(target).to(teacher_dtype)
    del answerer
    return examples_from_sequences(teacher, sequences, list(layer_ids), sources, prompt_lengths, extras,
                                   num_visual_tokens=num_visual_tokens, batch_tokens=batch_tokens)


def _answered_ids(tokenizer, messages: list, max_answer_tokens: int) -> tuple[torch.Tensor, int]:
    """`(ids, prompt_length)` of a conversation that ends with the assistant's answer: the prompt as the target
    sees it before answering (generation prompt added), then the answer's tokens up to the end of its turn, at
    most `max_answer_tokens`."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("An answered prompt (last message from the assistant) needs a tokenizer with a chat "
                         "template.")
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=True)["input_ids"]
    full = tokenizer.apply_chat_template(messages, return_dict=True)["input_ids"]
    if list(full[: len(prompt)]) != list(prompt) or len(full) <= len(prompt):
        raise ValueError("The chat template does not render the conversation's answer after its generation "
                         "prompt; cannot tell where the answer starts.")
    answer = cut_at_eos(torch.tensor(full[len(prompt):], dtype=torch.long), tokenizer.eos_token_id)
    return torch.cat([torch.tensor(prompt, dtype=torch.long), answer[:max_answer_tokens]]), len(prompt)


def answer_token_counts(examples: list) -> torch.Tensor:
    """How often the target chooses each token id over the answers of `examples` (its greedy labels from the
    answer's first position on; all positions of plain text): a `bincount`, as long as the largest id + 1."""
    answers = [example.labels[max(example.prompt_length - 1, 0):] for example in examples]
    return torch.bincount(torch.cat(answers)) if answers else torch.zeros(0, dtype=torch.long)


def frequent_tokens(examples: list, size: int, fill=None) -> tuple[torch.Tensor, float]:
    """The `size` tokens the target produces most often in `examples` ([`answer_token_counts`]), most frequent
    first, and the share of those choices they cover.

    For [`~hf_adaptive_spec.LaSpecDrafterModel.set_draft_vocabulary`]: a drafter that scores only these tokens
    misses the rest (coverage < 1) but runs a much smaller LM head.

    `fill` (token ids in priority order, e.g. the draft vocabulary of the drafter being fine-tuned): when the
    examples produce fewer than `size` distinct tokens, the remaining places go to `fill`'s tokens not chosen
    yet, in `fill`'s order (instead of tokens the examples never produce, taken by id)."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}.")
    counts = answer_token_counts(examples)
    if int(counts.sum()) == 0:
        raise ValueError("frequent_tokens needs examples with at least one label.")
    ranked = torch.sort(counts, descending=True, stable=True).indices
    order = ranked[:size]
    coverage = float(counts[order].sum()) / float(counts.sum())
    if fill is not None:
        produced = order[counts[order] > 0]
        fill = torch.as_tensor(fill, dtype=torch.long).flatten().cpu()
        fresh = list(dict.fromkeys(fill[~torch.isin(fill, produced)].tolist()))  # fill's order, no repeats
        order = torch.cat([produced, torch.tensor(fresh[: size - produced.numel()], dtype=torch.long)])
        if order.numel() < size:  # still short: tokens neither produces, by id, as without fill
            order = torch.cat([order, ranked[~torch.isin(ranked, order)][: size - order.numel()]])
    return order, coverage


def save_examples(examples: list, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([vars(example) for example in examples], path)


def load_examples(path) -> list:
    return [DrafterExample(**fields) for fields in torch.load(Path(path), weights_only=True)]
