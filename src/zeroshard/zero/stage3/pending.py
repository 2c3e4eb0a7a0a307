"""Parameters `zero_init` built on the meta device, between construction and `initialize`.

[Note: GatheredParameters before initialize]
DeepSpeed's `zero.Init` partitions each parameter as its module is built, so `GatheredParameters` works on them
before `deepspeed.initialize`, and code written for it relies on that: Megatron-style modules initialise their
weights inside `with GatheredParameters(self.weight, modifier_rank=0)` in `__init__`, DeepSpeed-Chat and DeepSpeed's
own tests load or change weights that way after building the model under `zero.Init`. zeroshard's `zero_init` keeps
the model on the meta device until `initialize` shards it unit by unit, so such a block had no values to show and a
rank's change was dropped without a word (a load into a meta tensor is a no-op): the model then trained from its
modules' default initialisation. So, while `zero_init` is active, torch's module registration hooks (its public
global hooks; no constructor is patched) record which module owns each parameter and which module holds each
module, and a `GatheredParameters` block over meta parameters no engine owns yet:
- gives each one's module values first, on the CPU: the checkpoint's where a `from_pretrained` under `zero_init`
  provides them, else the module's own initialisation (`reset_parameters`, and the root's `_init_weights` for a
  Hugging Face model), as `initialize` would; the whole module at once, so that a module's own parameters are all
  meta or all real, which `initialize` expects of it;
- at exit with `modifier_rank=r`, broadcasts them from rank r and keeps them: `initialize` then shards these values
  instead of initialising or reading them again (the checkpoint does not overwrite a change);
- at exit without `modifier_rank`, returns them to the meta device (DeepSpeed discards such changes too).
Every rank holds the kept parameters whole until `initialize`; to keep a large model from ever being whole on a
rank, change it after `initialize` or stream it with `from_pretrained`. A meta parameter that `zero_init` did not
build (the caller's own `torch.device("meta")`) has no module to initialise it: refused in one line.
Parameters built under `zero_init` also carry DeepSpeed's attributes from construction ([Note: DeepSpeed's
parameter attributes] in ds_param.py), NOT_AVAILABLE until a block or `initialize` makes them real.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_hooks

from zeroshard.errors import ZeroshardError
from zeroshard.loading.materialize import init_module, swap_keeping_attributes
from zeroshard.loading.weights import weights_covering
from zeroshard.zero.stage3.ds_param import ZeroParamStatus, mark_pending, set_status


class _Built:
    """Who owns what among modules built under `zero_init`. Modules are held weakly and parameters by identity
    only (torch's `swap_tensors`, which makes a meta parameter real, refuses a tensor with a weak reference); a
    module's entries go when it does."""

    def __init__(self) -> None:
        self._owner: dict[int, weakref.ref[nn.Module]] = {}  # id(parameter) -> its module
        self._parent: dict[int, weakref.ref[nn.Module]] = {}  # id(module) -> the module holding it
        self._kept: set[int] = set()  # parameters whose values a block kept: `initialize` shards them
        self._finalizers: dict[int, weakref.finalize] = {}

    def _track(self, module: nn.Module) -> weakref.ref[nn.Module]:
        key = id(module)
        if key not in self._finalizers:
            self._finalizers[key] = weakref.finalize(module, self._forget, key)
        return weakref.ref(module)

    def _forget(self, module_key: int) -> None:
        self._finalizers.pop(module_key, None)
        self._parent.pop(module_key, None)
        for key in [k for k, ref in self._owner.items() if ref() is None]:
            self._owner.pop(key, None)
            self._kept.discard(key)

    def parameter(self, module: nn.Module, _: str, param: nn.Parameter | None) -> None:
        if param is None or not param.is_meta or self.owner(param) is not None:
            return  # a tied weight registered again keeps its first owner
        self._owner[id(param)] = self._track(module)
        mark_pending(param)

    def module(self, parent: nn.Module, _: str, child: nn.Module | None) -> None:
        if child is not None and self._holder(child) is None:
            self._track(child)
            self._parent[id(child)] = self._track(parent)

    def owner(self, param: nn.Parameter) -> nn.Module | None:
        ref = self._owner.get(id(param))
        module = ref() if ref is not None else None
        if module is None or not any(q is param for q in module._parameters.values()):
            return None  # another object now has that id
        return module

    def _holder(self, module: nn.Module) -> nn.Module | None:
        ref = self._parent.get(id(module))
        parent = ref() if ref is not None else None
        return parent if parent is not None and any(m is module for m in parent._modules.values()) else None

    def keep(self, param: nn.Parameter) -> None:
        self._kept.add(id(param))

    def kept(self, param: nn.Parameter) -> bool:
        return id(param) in self._kept and self.owner(param) is not None

    def root(self, module: nn.Module) -> nn.Module:
        seen = {id(module)}
        while (parent := self._holder(module)) is not None and id(parent) not in seen:
            seen.add(id(parent))
            module = parent
        return module


BUILT = _Built()


@contextmanager
def recording() -> Iterator[None]:
    """Record ownership for the duration of a `zero_init` context (nested contexts record once)."""
    handles = [
        module_hooks.register_module_parameter_registration_hook(BUILT.parameter),
        module_hooks.register_module_module_registration_hook(BUILT.module),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def make_values(params: Sequence[nn.Parameter], modifier_rank: int | None) -> list[nn.Parameter]:
    """[Note: GatheredParameters before initialize] give `params` (meta, owned by no engine) their modules' values
    on the CPU; returns every parameter made real (their modules' others too). A block that changes them needs the
    process group at its exit: started now if the script has not (DeepSpeed's `zero.Init` starts it too)."""
    owners: dict[int, nn.Module] = {}
    for p in params:
        owner = BUILT.owner(p)
        if owner is None:
            raise ZeroshardError(
                f"GatheredParameters: a meta-device parameter of shape {tuple(p.shape)} that zeroshard.zero_init() "
                "(deepspeed.zero.Init) did not build, so nothing can give it values before initialize; build the "
                "model under zeroshard.zero_init(), or enter the block after initialize"
            )
        owners.setdefault(id(owner), owner)
    if modifier_rank is not None and not dist.is_initialized():
        from zeroshard.comm.topology import init_distributed

        init_distributed()
    made: list[nn.Parameter] = []
    cpu = torch.device("cpu")
    for owner in owners.values():
        own = [p for p in owner.parameters(recurse=False) if p.is_meta]
        with torch.random.fork_rng(devices=[]):
            init_module(owner, BUILT.root(owner), cpu)
        for p in own:
            weights = weights_covering(p)
            if weights is not None:  # transformers loads the checkpoint over the initialisation
                weights.read_whole([(p, p)])
        set_status(own, ZeroParamStatus.AVAILABLE)
        made += own
    return made


def end_values(made: Sequence[nn.Parameter], modifier_rank: int | None) -> None:
    """The block is over: keep rank `modifier_rank`'s values everywhere, or (None) return `made` to the meta device."""
    if modifier_rank is None:
        for p in made:
            swap_keeping_attributes(p, torch.empty_like(p, device="meta"))
        set_status(made, ZeroParamStatus.NOT_AVAILABLE)
        return
    for p in made:
        BUILT.keep(p)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    from zeroshard.comm.collectives import Collectives

    comm = Collectives(None, dist.get_world_size(), dist.get_rank())
    # NCCL moves device memory only: the values travel through the current CUDA device and come back
    nccl = dist.get_backend() == "nccl"
    for p in made:
        data = p.data.to(torch.device("cuda", torch.cuda.current_device())) if nccl else p.data
        comm.broadcast(data, src=modifier_rank, label="GatheredParameters before initialize")
        if data is not p.data:
            p.data.copy_(data)
