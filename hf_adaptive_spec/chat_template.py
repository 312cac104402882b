"""Chat messages -> model inputs: the conversation in the model's chat template, with the generation prompt.

The one encoding behind the command line (`loading.chat_inputs`), the benchmark's prompts, the server's
requests and the training data. A tokenizer encodes its template's ids; a VLM's processor renders its own
template as text and encodes that text together with the images.
"""

from __future__ import annotations

__all__ = ["chat_text", "encode_chat", "text_tokenizer"]


def text_tokenizer(processor):
    """The tokenizer inside a processor (a VLM's), or the tokenizer itself."""
    return getattr(processor, "tokenizer", processor)


def chat_text(processor, messages: list) -> str:
    """`messages` rendered by the chat template of `processor` (a tokenizer or a processor), with the
    generation prompt, as text."""
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_chat(processor, messages: list, images: list | None = None) -> dict:
    """The model inputs of one conversation, batch of one (`input_ids` `(1, S)`, ...), as PyTorch tensors.

    Args:
        processor: a tokenizer, or a VLM's processor.
        messages (`list`): the conversation, `[{"role": ..., "content": ...}, ...]`.
        images (`list`, *optional*): the conversation's images, in order. Given (even empty), the processor
            encodes `chat_text` of the messages with them and every input it makes is returned (`pixel_values`,
            ...); `processor` must then take images.

    Returns:
        What the tokenizer or processor returns. Without images, the text tokenizer encodes its chat template,
        or, having none, the last message's content alone.
    """
    if images is not None:
        if getattr(processor, "image_processor", None) is None:
            raise ValueError(f"{len(images)} image(s) given, but {type(processor).__name__} takes no images "
                             "(a text model?).")
        return processor(text=[chat_text(processor, messages)], images=images or None, return_tensors="pt")
    tokenizer = text_tokenizer(processor)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
    return tokenizer(messages[-1]["content"], return_tensors="pt")
