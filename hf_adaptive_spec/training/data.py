"""Training data for a LaSpec drafter, made by the target itself (teacher forcing).

An example is one token sequence with, per position t:

* `hidden`: the target's hidden states after the drafter's `target_layer_ids`, concatenated (fp16 on disk);
* `labels`: the target's greedy next token after position t given the true prefix (its argmax);
* `on_policy`: True where the sequence's token at t + 1 IS that greedy token.

Sequences come from the target's own greedy generations on chat prompts (fully on-policy after the prompt:
what the drafter sees at decoding time), and optionally from plain real text (teacher-forced labels only).
A block anchored at p trains position k only while the tokens p+1..p+k are the target's own greedy tokens
(`on_policy`), because at decoding time the drafter's k-th guess continues an accepted, i.e. greedy, prefix.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from ..drafters.laspec import gather_target_hidden

__all__ = ["DrafterExample", "build_examples", "examples_from_sequences", "load_examples", "save_examples"]


@dataclass
class DrafterExample:
    """One training sequence (all tensors on the CPU; L = sequence length)."""

    input_ids: torch.Tensor  # (L,) long
    hidden: torch.Tensor  # (L, F) fp16
    labels: torch.Tensor  # (L,) long: target argmax after each position
    on_policy: torch.Tensor  # (L,) bool: input_ids[t + 1] == labels[t] (False at the last position)
    source: str = ""
    prompt_length: int = 0  # tokens before the answer (0 for plain text): blocks are anchored in the answer

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@torch.no_grad()
def examples_from_sequences(target, sequences: list, layer_ids: list, sources: list | None = None,
                            prompt_lengths: list | None = None) -> list:
    """Teacher-force the target over each `(L,)` token sequence: its fused hidden states, greedy labels and
    on-policy flags ([`DrafterExample`]). `prompt_lengths[i]` is where sequence i's answer starts (0: plain text)."""
    sources = sources if sources is not None else [""] * len(sequences)
    prompt_lengths = prompt_lengths if prompt_lengths is not None else [0] * len(sequences)
    device = target.device
    examples = []
    for ids, source, prompt_length in zip(sequences, sources, prompt_lengths):
        out = target(input_ids=ids[None].to(device), output_hidden_states=True, use_cache=False)
        hidden = gather_target_hidden(out.hidden_states, layer_ids)[0].to("cpu", torch.float16)
        labels = out.logits[0].argmax(-1).cpu()
        ids = ids.cpu()
        on_policy = torch.zeros_like(ids, dtype=torch.bool)
        on_policy[:-1] = ids[1:] == labels[:-1]
        examples.append(DrafterExample(ids, hidden, labels, on_policy, source, int(prompt_length)))
    return examples


@torch.no_grad()
def build_examples(target, tokenizer, layer_ids: list[int], prompts=(), texts=(), max_new_tokens: int = 128,
                   batch_size: int = 8, max_text_tokens: int = 256, progress: bool = True,
                   samples_per_prompt: int = 1, temperature: float = 0.7, generate_dtype=None) -> list:
    """Examples from the target's greedy answers to `prompts` and from plain `texts`.

    Args:
        target: the verifier (causal LM; eval mode).
        tokenizer: its tokenizer (a chat template is used when it has one).
        layer_ids (`list[int]`): target layers the drafter reads (`config.target_layer_ids`).
        prompts: chat prompts (`hf_adaptive_spec.data.Prompt` or a list of messages); the target answers each
            greedily with up to `max_new_tokens` tokens, `batch_size` prompts at a time.
        texts: plain strings, cut to `max_text_tokens` tokens, teacher-forced only.
        samples_per_prompt (`int`): answers per prompt: the greedy one, plus `samples_per_prompt - 1` sampled at
            `temperature` (more varied prefixes; their labels are still the target's greedy choices, and a block
            trains only across positions where the sample agreed with them).
        generate_dtype (`torch.dtype`, *optional*): answer with a copy of the target in this dtype (e.g.
            `torch.bfloat16`: about 1.7x faster on a CPU with AMX). Labels and hidden states still come from
            `target` itself, and a block trains only across the answer's tokens that `target` would choose
            greedily, so a token where the copy disagrees is simply not trained across.

    Returns:
        list of [`DrafterExample`].
    """
    from tqdm.auto import tqdm

    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}.")
    sequences, sources, prompt_lengths = [], [], []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generator = target if generate_dtype is None or generate_dtype == target.dtype else (
        copy.deepcopy(target).to(generate_dtype))
    all_encoded = []
    for prompt in prompts:
        messages = getattr(prompt, "messages", prompt)
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer(messages[-1]["content"])["input_ids"]
        all_encoded.append((prompt, torch.tensor(ids, dtype=torch.long)))
    all_encoded.sort(key=lambda pair: len(pair[1]))  # similar lengths batch together: less padding
    bar = tqdm(total=len(all_encoded) + len(texts), desc="target data", disable=not progress)
    for start in range(0, len(all_encoded), batch_size):
        chunk = [prompt for prompt, _ in all_encoded[start : start + batch_size]]
        encoded = [ids for _, ids in all_encoded[start : start + batch_size]]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(encoded):  # left padding
            input_ids[row, width - len(ids):] = ids
            attention_mask[row, width - len(ids):] = 1
        for sample in range(samples_per_prompt):
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if sample else {"do_sample": False}
            out = generator.generate(input_ids=input_ids.to(target.device),
                                     attention_mask=attention_mask.to(target.device), max_new_tokens=max_new_tokens,
                                     pad_token_id=pad, **sampling)
            for row, (prompt, ids) in enumerate(zip(chunk, encoded)):
                answer = out[row, width:].cpu()
                eos = tokenizer.eos_token_id
                if eos is not None and (answer == eos).any():
                    answer = answer[: int((answer == eos).nonzero()[0]) + 1]
                sequences.append(torch.cat([ids, answer]))
                sources.append(getattr(prompt, "id", "prompt"))
                prompt_lengths.append(len(ids))
        bar.update(len(chunk))
    for i, text in enumerate(texts):
        ids = tokenizer(text)["input_ids"][:max_text_tokens]
        if len(ids) >= 8:
            sequences.append(torch.tensor(ids, dtype=torch.long))
            sources.append(f"text/{i}")
            prompt_lengths.append(0)
        bar.update(1)
    bar.close()
    del generator
    return examples_from_sequences(target, sequences, list(layer_ids), sources, prompt_lengths)


def save_examples(examples: list, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([vars(example) for example in examples], path)


def load_examples(path) -> list:
    return [DrafterExample(**fields) for fields in torch.load(Path(path), weights_only=True)]
