"""The text part of a model's config, and its vocabulary size.

A vision-language model nests its text decoder's settings (layers, width, vocabulary) in a sub-config;
a plain LM keeps them at the top. `text_config` finds them either way, for a model or a config, and hands
back any other object unchanged (a stand-in config without `get_text_config`, or None). `compat` hands both
functions on to the rest of the package.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

__all__ = ["text_config", "vocab_size"]


def text_config(model_or_config, decoder: bool = False):
    """The config holding the text model's settings.

    Args:
        model_or_config: a model (anything with a `config`) or a config.
        decoder (`bool`): look among the decoder's sub-config names only (`get_text_config(decoder=True)`),
            for a model whose text input and output sides differ.

    Returns:
        `get_text_config(...)` of the config where it has one, else the config itself (None for None).
    """
    config = model_or_config
    if not isinstance(config, PreTrainedConfig):
        config = getattr(config, "config", config)
    if not hasattr(config, "get_text_config"):
        return config
    return config.get_text_config(decoder=True) if decoder else config.get_text_config()


def vocab_size(model_or_config) -> int | None:
    """The text vocabulary size of a model or a config, or None where its text config names none."""
    return getattr(text_config(model_or_config), "vocab_size", None)
