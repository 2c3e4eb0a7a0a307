"""Sharded construction: build a model without any rank holding all of it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zeroshard.loading.hf import streaming_from_pretrained
from zeroshard.zero.stage3.pending import recording


@contextmanager
def zero_init() -> Iterator[None]:
    """Construct modules on the meta device; `initialize` (stage 3) materialises them unit by unit,
    each rank keeping only its shards. No torch constructor or nn.Module is patched: this is
    `torch.device("meta")` as a context, plus torch's global module registration hooks, which record who owns each
    parameter while it is active. A Hugging Face `from_pretrained(folder)` inside it builds the model
    on the meta device too, and `initialize` reads the folder's safetensors straight into each rank's shards
    (stage 3) or parameters (stages 0-2): [Note: from_pretrained under zero_init]. Before `initialize`,
    `GatheredParameters` gives its parameters values to read or change ([Note: GatheredParameters before initialize]).

    Example:
        >>> with zeroshard.zero_init():  # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_pretrained("path/to/llama")  # or MyModel(config): random init
        >>> cfg = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        >>> engine, *_ = zeroshard.initialize(model=model, config=cfg)  # doctest: +SKIP
    """
    with torch.device("meta"), streaming_from_pretrained(), recording():  # [Note: GatheredParameters before
        yield  # initialize] in pending.py
