"""`deepspeed.zero.Init`, `register_external_parameter` and `unwrap_model_for_generation` over zeroshard's stage 3.

`Init` is `zero_init()` (modules built on the meta device, sharded by `initialize`) under DeepSpeed's
signature. Its placement and dtype arguments are decided by the ds_config given to `initialize` instead:
`zero_optimization.offload_param` (DeepSpeed's `remote_device`, `pin_memory`) and `bf16`/`fp16` (`dtype`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger
from zeroshard.zero.stage3.meta import zero_init

if TYPE_CHECKING:
    from zeroshard.engine import Engine

logger = get_logger(__name__)


class Init:
    """Build the model inside `with zeroshard.zero.Init(...):` to shard it at `initialize` (stage 3) without
    ever materialising it whole. DeepSpeed's keyword arguments are accepted:

    - `enabled=False`: an ordinary construction.
    - `module=`: a module built already; a no-op, since `initialize` shards any module at stage 3.
    - `remote_device`, `pin_memory`, `dtype`, `config_dict_or_path`, `config`, `mem_efficient_linear`,
      `data_parallel_group`: accepted and unused; the ds_config passed to `initialize` decides placement
      (`offload_param`) and dtype (`bf16`/`fp16`).
    - `mpu=`: refused (ZeRO-3 does not compose with model parallelism here; `initialize(mpu=...)` does at stages 0-2).

    As DeepSpeed's, it starts the process group when the script has not (`init_distributed()`: from the launcher's
    environment, or a one-process group), whether enabled or not.

    Example:
        >>> import torch, zeroshard
        >>> with zeroshard.zero.Init(remote_device="cpu", dtype=torch.bfloat16):
        ...     model = torch.nn.Linear(4, 4)
        >>> model.weight.device.type
        'meta'
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **unused: Any,
    ) -> None:
        if mpu is not None:
            raise ConfigError("zero.Init(mpu=...): ZeRO-3 with model parallelism is not supported; pass mpu=None")
        if not dist.is_initialized():  # as DeepSpeed's: the script may ask for its rank from here on
            from zeroshard.comm.topology import init_distributed
            from zeroshard.config.features import collective_timeout
            from zeroshard.config.parse import load_source

            given = config_dict_or_path if config_dict_or_path is not None else config
            raw = load_source(given, logger) if given is not None else None
            init_distributed(timeout_s=collective_timeout(raw))  # the config's deadline, as initialize would
        if unused:
            logger.debug("zero.Init: ignoring %s", ", ".join(sorted(unused)))
        # A built module needs nothing here: initialize() shards whatever module it is given at stage 3.
        self._context: AbstractContextManager[None] = zero_init() if enabled and module is None else nullcontext()

    def __enter__(self) -> Init:
        self._context.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._context.__exit__(exc_type, exc, tb)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's hint that `module`'s forward uses `parameter`, which another module owns.

    A parameter registered on `module` (directly or below it) needs no hint: stage 3 gathers it with
    `module`'s unit or, when shared by several units, with their closest common ancestor ([Note: units] in
    zero/stage3/plan.py), so this is a no-op. Our units do not gather a parameter used by a module that does
    not own it, so that case is refused rather than computing with an unsharded placeholder.
    """
    if any(p is parameter for p in module.parameters()):
        return
    raise NotImplementedError(
        "register_external_parameter: zeroshard's stage 3 gathers a parameter only with the modules that own it. "
        "Register it on the module that uses it (e.g. `module.shared = other.weight`; tied weights are gathered "
        "with the closest common unit), or wrap the use in `zeroshard.zero.GatheredParameters([param])`."
    )


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo `register_external_parameter`: nothing was registered, so nothing to undo."""


@contextmanager
def unwrap_model_for_generation(model: Engine) -> Iterator[Engine]:
    """DeepSpeed's `deepspeed.runtime.zero.unwrap_model_for_generation(engine)`: the engine with its whole model
    gathered once for the block (`engine.gathered_for_generation()`), so that `generate` does not gather every unit
    for every token. Every rank must enter it.

    Example:
        >>> with zeroshard.zero.unwrap_model_for_generation(engine) as unwrapped:  # doctest: +SKIP
        ...     tokens = unwrapped.module.generate(prompt, max_new_tokens=16)
    """
    with model.gathered_for_generation():
        yield model
