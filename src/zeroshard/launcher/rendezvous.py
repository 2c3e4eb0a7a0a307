"""Process-group start-up that survives torchrun's elastic restarts.

[Note: one store namespace per restart attempt]
Under torchrun the workers' `env://` store is the agent's TCPStore (TORCHELASTIC_USE_AGENT_STORE=True),
and it outlives a restart. torch's own env:// handler then connects a fresh client *without* a prefix
("we create a new TCPStore for every retry"), so a restarted group's ranks see the keys the previous
attempt wrote: the gloo/NCCL rendezvous reads the dead ranks' addresses and hangs or fails at random.
The fix is to give every attempt its own namespace, `PrefixStore(f"attempt_{TORCHELASTIC_RESTART_COUNT}",
store)`, and to build the process group on that store. `init_process_group_from_env` does it;
`zeroshard.comm.topology.init_distributed` should call it (or `attempt_store`) instead of
`init_method="env://"` when TORCHELASTIC_RESTART_COUNT is set.

The restart count is per agent, so across nodes it only agrees while no node is replaced: a node whose
launcher was started again counts from 0 while the survivors count on. Multi-node launches therefore set
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (runner.run_watched): every rendezvous round then gets a fresh store
of its own (hosted by global rank 0 on a free port), nothing stale can be read, and no prefix is used.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def restart_count() -> int:
    """Which attempt this is: 0 for the first start, n after n elastic restarts (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def attempt_store(store: dist.Store, attempt: int | None = None) -> dist.PrefixStore:
    """`store` seen through a per-attempt namespace (see [Note: one store namespace per restart attempt])."""
    return dist.PrefixStore(f"attempt_{restart_count() if attempt is None else attempt}", store)


def env_store(timeout: datetime.timedelta) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) from torchrun's variables, as torch's env:// handler would build them."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timeout,
        multi_tenant=not agent_hosts_store,
    )
    return store, rank, world_size


def init_process_group_from_env(backend: str, timeout_s: float = 1800.0) -> None:
    """`dist.init_process_group` on the per-attempt store; a no-op if a group exists already."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = env_store(timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        store = attempt_store(store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def under_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
