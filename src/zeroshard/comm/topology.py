"""Process-group set-up: from torchrun's environment, or a single process with no variables at all."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its rank in the data-parallel group, its device and backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _pick_device(local_rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> Topology:
    """Initialise torch.distributed once and describe the result.

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) the env:// rendezvous is used. With no
    variables at all a one-process group is created on an in-memory store, so `python train.py`
    runs the same code path as a multi-process job. NCCL is chosen on CUDA and gloo on CPU.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, default_backend = _pick_device(local_rank)
    chosen = backend or default_backend
    if not dist.is_initialized():
        kwargs = {}
        if timeout_s is not None:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ and "MASTER_ADDR" in os.environ:
            # torchrun's agent store outlives restarts: one store namespace per attempt (launcher/rendezvous.py)
            from zeroshard.launcher.rendezvous import init_process_group_from_env

            init_process_group_from_env(chosen, timeout_s or 1800.0)
        elif "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(chosen, init_method="env://", **kwargs)  # type: ignore[arg-type]
        else:
            dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, **kwargs)  # type: ignore[arg-type]
    topo = Topology(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=dist.get_backend(),
        group=None,
    )
    logger.debug("initialised %s", topo)
    return topo
