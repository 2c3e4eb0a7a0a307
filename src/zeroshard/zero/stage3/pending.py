"""Parameters `zero_init` built on the meta device, between construction and `initialize`.

[Note: GatheredParameters before initialize]
DeepSpeed's `zero.Init` partitions each parameter as its module is built, so `GatheredParameters` works on them
before `deepspeed.initialize`, and code written for it relies on that: Megatron-style modules initialise their
weights inside `with GatheredParameters(self.weight, modifier_rank=0)` in `__init__`, DeepSpeed-Chat and DeepSpeed's
own tests load or change weights that way after building the model under `zero.Init`. zeroshard's `zero_init` keeps
the model on the meta device until `initialize` shards it unit by unit, so such a block had no values to show and a
rank's change was dropped without a word (a load into a meta tensor is a no-op): the model then trained from its
modules' default initialisation. So, while `zero_init` is active, torch's module registration hooks (its public
global hooks; no constructor is patched) record, from the thread that entered it, which module owns each parameter
and which module holds each module; parameters added later to such a model (PEFT's adapters) are found by a walk of
it. A `GatheredParameters` block over parameters of such a model that no engine owns yet:
- gives the meta ones values on the CPU, a module at a time (a module's own parameters become real together; real
  ones, such as a weight tied to another module, keep theirs): a streamed `from_pretrained` checkpoint's values where
  it has them, else the initialisation the model's code ran under `zero_init` ([Note: initialisation recorded under
  zero_init]; where it wrote nothing, `reset_parameters`, and the root's `_init_weights` for a Hugging Face model;
  zeros where neither writes); broadcast from rank 0, so every rank reads the same values (the
  process group is started if the script has not, as DeepSpeed's `zero.Init` does). PEFT's LoRA adapters become
  real once, for good (they are small), with PEFT's initialisation (lora_B zero; `materialize_adapters`; DoRA,
  whose magnitudes need the base weights, is refused);
- at exit with `modifier_rank=r`, broadcasts them, and those an earlier block kept, from rank r and keeps them:
  `initialize` shards these values instead of initialising or reading them again (the checkpoint does not overwrite
  a change);
- at exit without `modifier_rank`, returns those it made real to the meta device (DeepSpeed discards such changes
  too); `initialize` then gives them the same values again (each recorded random call, and each module's own
  initialisation, draws from a seed of its own), so a read-only block shows the values training starts from.
Every rank holds the kept parameters whole until `initialize`; to keep a large model from ever being whole on a
rank, change it after `initialize` or stream it with `from_pretrained`. A meta parameter that no `zero_init` model
holds (the caller's own `torch.device("meta")`) has no module to initialise it: refused in one line, as is
`initialize` inside a block over the model. Parameters built under `zero_init` also carry DeepSpeed's attributes
from construction ([Note: DeepSpeed's parameter attributes] in ds_param.py), NOT_AVAILABLE until a block or
`initialize` makes them real. A block that broadcasts (values made real, adapters, a modifier) agrees first with the
other ranks, before anything is made real ([Note: gathering calls agree first]), naming each parameter by its model
(numbered in the order `zero_init` recorded the models: an actor and its reference model differ) and its path there
(through modules PEFT wrapped around it later): blocks over different parameters on different ranks, or a block that
raised on one rank before its modifier's broadcast, are named.

[Note: loads before initialize]
`load_state_dict` into a `zero_init` model's meta tensors was a no-op (torch skips a meta parameter with a warning):
`PeftModel.from_pretrained(base, adapter)` on a meta base created the adapters on the meta device and dropped the
saved weights, so training resumed from a fresh LoRA; a state dict loaded into the model before `initialize` was
lost the same way. Under DeepSpeed the adapters are real (made after `zero.Init`) and load. So at the end of the
`zero_init` block every module built gets a `load_state_dict` pre-hook (torch's public hook, a module-level
function so that copying a module does not copy zeroshard's state; handles kept, removed when `initialize` takes
the model): the meta parameters and persistent buffers under it that the state dict has, with the same shape,
become real on the CPU with the loaded values and are kept as a `GatheredParameters(modifier_rank=...)` block keeps
them (`initialize` shards them; a `from_pretrained` checkpoint does not overwrite them). Every rank loads its own
copy (the same file on every rank gives the same values); a large load makes those tensors whole on every rank until
`initialize`, as such a block does; a load that raises (a strict load with missing keys) keeps what it matched, as
torch's own load does. An `assign=True` load into parameters added after the block is refused in one line: PEFT's
`low_cpu_mem_usage=True` assigns the adapter, then moves it to the base's meta device, dropping it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from zeroshard.comm.agreement import CallAgreement
from zeroshard.comm.collectives import Collectives
from zeroshard.comm.topology import local_device
from zeroshard.errors import ZeroshardError
from zeroshard.loading.materialize import (
    init_module,
    make_real,
    materialize_adapters,
    swap_keeping_attributes,
    swappable,
)
from zeroshard.loading.recorded import recording as recording_init
from zeroshard.loading.replay import bind, continue_recording, unrecorded
from zeroshard.loading.weights import weights_covering
from zeroshard.zero.stage3.ds_param import ZeroParamStatus, mark_pending, set_status


class _Built:
    """Who owns what among modules built under `zero_init`. Modules are held weakly and parameters by identity
    only (torch's `swap_tensors`, which makes a meta parameter real, refuses a tensor with a weak reference); a
    module's entries go when it does. Only the thread that entered `zero_init` records."""

    def __init__(self) -> None:
        self._owner: dict[int, weakref.ref[nn.Module]] = {}  # id(parameter) -> its module
        self._params_of: dict[int, list[int]] = {}  # id(module) -> the parameters it owns here
        self._parent: dict[int, weakref.ref[nn.Module]] = {}  # id(module) -> the module holding it
        self._modules: dict[int, weakref.ref[nn.Module]] = {}
        # id(module) -> its place in the order modules were first recorded (the same on every rank that builds the
        # same models): a model's number in the agreement's names
        self._number: dict[int, int] = {}
        self._recorded = 0
        self._kept: set[int] = set()  # parameters whose values a block kept: `initialize` shards them
        self.open: dict[int, int] = {}  # parameters inside GatheredParameters blocks now: how many blocks
        # roots whose PEFT adapters are real: their adapter names (held weakly: an id can be reused)
        self.adapters: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()
        self.thread: int | None = None
        self.depth = 0
        self._agreement: tuple[Any, CallAgreement] | None = None  # (the default group, its agreement)
        self._load_hooks: dict[int, RemovableHandle] = {}  # id(module) -> its load_state_dict pre-hook

    def _track(self, module: nn.Module) -> weakref.ref[nn.Module]:
        key = id(module)
        if key not in self._modules:
            self._modules[key] = weakref.ref(module)
            self._recorded += 1
            self._number[key] = self._recorded
            weakref.finalize(module, self._forget, key)
        return self._modules[key]

    def _forget(self, module_key: int) -> None:
        handle = self._load_hooks.pop(module_key, None)
        if handle is not None:
            handle.remove()
        self._modules.pop(module_key, None)
        self._number.pop(module_key, None)
        self._parent.pop(module_key, None)
        for key in self._params_of.pop(module_key, []):
            self._owner.pop(key, None)
            self._kept.discard(key)

    def forget(self, model: nn.Module) -> None:
        """`initialize` took `model`: its parameters are an engine's (or whole) from now on."""
        for module in model.modules():
            self._forget(id(module))
        for p in model.parameters():
            self._owner.pop(id(p), None)
            self._kept.discard(id(p))
        for module in model.modules():
            self.adapters.pop(module, None)

    def adopt(self, root: nn.Module, params: Sequence[nn.Parameter]) -> None:
        """Record the owners of `params`, parameters added to `root` outside `zero_init` (PEFT's adapters)."""
        ids = {id(p) for p in params}
        for module in root.modules() if ids else ():
            for q in module._parameters.values():
                if q is not None and id(q) in ids and self.owner(q) is None:
                    self._owner[id(q)] = self._track(module)
                    self._params_of.setdefault(id(module), []).append(id(q))

    def parameter(self, module: nn.Module, _: str, param: nn.Parameter | None) -> None:
        if param is None or not param.is_meta or threading.get_ident() != self.thread or self.owner(param):
            return  # a tied weight registered again keeps its first owner
        self._owner[id(param)] = self._track(module)
        self._params_of.setdefault(id(module), []).append(id(param))
        mark_pending(param)

    def module(self, parent: nn.Module, _: str, child: nn.Module | None) -> None:
        if child is not None and threading.get_ident() == self.thread and self._holder(child) is None:
            self._track(child)
            self._parent[id(child)] = self._track(parent)

    def buffer(self, module: nn.Module, _: str, buffer: torch.Tensor | None) -> None:
        if buffer is not None and buffer.is_meta and threading.get_ident() == self.thread:
            self._track(module)  # a model of buffers only is a model too (its buffers' records are bound)

    def owner(self, param: nn.Parameter) -> nn.Module | None:
        ref = self._owner.get(id(param))
        module = ref() if ref is not None else None
        if module is None or not any(q is param for q in module._parameters.values()):
            return None  # another object now has that id
        return module

    def found(self, params: Sequence[nn.Parameter]) -> dict[int, nn.Module]:
        """The module owning each of `params` (by id) that was built under `zero_init`, or added since to a model
        built there (PEFT's adapters, created outside the context): those are found by a walk of the models."""
        out = {id(p): m for p in params if (m := self.owner(p)) is not None}
        wanted = {id(p) for p in params if p.is_meta} - out.keys()
        if wanted:
            roots = [m for ref in list(self._modules.values()) if (m := ref()) is not None and self._holder(m) is None]
            for root in roots:
                for module in root.modules():
                    for q in module._parameters.values():
                        if q is not None and id(q) in wanted:
                            out.setdefault(id(q), module)
        return out

    def _holder(self, module: nn.Module) -> nn.Module | None:
        ref = self._parent.get(id(module))
        parent = ref() if ref is not None else None
        return parent if parent is not None and any(m is module for m in parent._modules.values()) else None

    def modules(self) -> Iterator[nn.Module]:
        """Every module recorded and still alive."""
        return (m for ref in list(self._modules.values()) if (m := ref()) is not None)

    def hook_loads(self) -> None:
        """[Note: loads before initialize] every recorded module takes a state dict into its meta tensors."""
        for module in self.modules():
            if id(module) not in self._load_hooks:
                # a module-level function: a hook that is a bound method of BUILT would be deep-copied (and pickled)
                # with every module copied, and BUILT with it
                self._load_hooks[id(module)] = module.register_load_state_dict_pre_hook(_load_pre_hook)

    def loading(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, assign: bool) -> None:
        """[Note: loads before initialize] the meta parameters and persistent buffers under `module` that
        `state_dict` has (same shape) become real with its values, kept for `initialize` as a
        `GatheredParameters(modifier_rank=...)` block keeps them; torch's own load then copies the same values (it
        skipped meta tensors with a warning)."""
        made: list[nn.Parameter] = []
        tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        for name, t in tensors:
            value = state_dict.get(prefix + name)
            if not t.is_meta or not isinstance(value, torch.Tensor) or value.is_meta or value.shape != t.shape:
                continue
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path)
            if not isinstance(t, nn.Parameter) and leaf in owner._non_persistent_buffers_set:
                continue  # torch never loads those
            if assign and isinstance(t, nn.Parameter) and self.owner(t) is None:
                raise ZeroshardError(
                    f"load_state_dict(assign=True) into {prefix + name}, a meta parameter added to a zero_init model "
                    "after it was built (PEFT's low_cpu_mem_usage=True loads an adapter so, then moves it to the meta "
                    "device, dropping its values): load with assign=False (PeftModel.from_pretrained(..., "
                    "low_cpu_mem_usage=False), the default)"
                )
            if isinstance(t, nn.Parameter):
                with unrecorded(), swappable(owner):
                    make_real(t, torch.device("cpu"))
                with torch.no_grad():
                    t.copy_(value)
                made.append(t)
            else:
                owner._buffers[leaf] = value.detach().to("cpu", t.dtype, copy=True)
        self.adopt(module, made)  # PEFT's adapters, made after zero_init, are the model's
        for p in made:
            self.keep(p)
        set_status([p for p in made if hasattr(p, "ds_status")], ZeroParamStatus.AVAILABLE)

    def keep(self, param: nn.Parameter) -> None:
        self._kept.add(id(param))

    def kept(self, param: nn.Parameter) -> bool:
        return id(param) in self._kept and self.owner(param) is not None

    def paths(self) -> list[tuple[int, dict[int, str]]]:
        """Each model recorded whole (held by no recorded module, as a module still being built is), by number, with
        the path of every module in it: a module wrapped outside `zero_init` (PEFT's LoRA layers hold the original
        as `base_layer`) is reached through its model, not through the parent recorded at its construction."""
        roots = [m for ref in list(self._modules.values()) if (m := ref()) is not None and self._holder(m) is None]
        return [(self._number[id(r)], {id(m): n for n, m in r.named_modules()}) for r in roots]

    def agreement(self) -> CallAgreement:
        """[Note: gathering calls agree first] for blocks before `initialize`, over the default group (the store's
        timeout); one per group, so that a timeout's refusal lasts."""
        group = dist.group.WORLD
        if self._agreement is None or self._agreement[0] is not group:
            self._agreement = (group, CallAgreement(Collectives(None, dist.get_world_size(), dist.get_rank()), None))
        return self._agreement[1]

    def root(self, module: nn.Module) -> nn.Module:
        seen = {id(module)}
        while (parent := self._holder(module)) is not None and id(parent) not in seen:
            seen.add(id(parent))
            module = parent
        return module


BUILT = _Built()


def _load_pre_hook(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, metadata: Any, *_: Any) -> None:
    BUILT.loading(module, state_dict, prefix, bool((metadata or {}).get("assign_to_params_buffers")))


@contextmanager
def recording() -> Iterator[None]:
    """Record ownership for the duration of a `zero_init` context, from the thread that entered it (nested contexts
    record once)."""
    if BUILT.depth and BUILT.thread != threading.get_ident():
        raise ZeroshardError("zeroshard.zero_init() is active in another thread; build models under it one at a time")
    BUILT.depth += 1
    if BUILT.depth > 1:
        try:
            yield
        finally:
            BUILT.depth -= 1
        return
    BUILT.thread = threading.get_ident()
    handles = [
        module_hooks.register_module_parameter_registration_hook(BUILT.parameter),
        module_hooks.register_module_module_registration_hook(BUILT.module),
        module_hooks.register_module_buffer_registration_hook(BUILT.buffer),
    ]
    try:
        with recording_init():  # [Note: initialisation recorded under zero_init]
            try:
                yield
            finally:
                bind(BUILT.modules())
                BUILT.hook_loads()
    finally:
        for handle in handles:
            handle.remove()
        BUILT.depth, BUILT.thread = 0, None


@dataclass
class Pending:
    """A GatheredParameters block's parameters that no engine owns yet, built under `zero_init`: `made` real for the
    block, and `real` already (kept by an earlier block, or PEFT's adapters)."""

    made: list[nn.Parameter]
    real: list[nn.Parameter]
    owner_of: dict[int, nn.Module]  # the module holding each: named by the agreement at the block's end


def begin(params: Sequence[nn.Parameter], modifier_rank: int | None = None) -> Pending | None:
    """[Note: GatheredParameters before initialize] `params` (owned by no engine) given values for the block, on the
    CPU: their modules' (a module at a time) or a streamed checkpoint's, the same on every rank; None when none of
    them was built under `zero_init` and none is on the meta device (a model built whole: nothing to do).
    `modifier_rank`: the rank whose values the block's end will broadcast (agreed now, with the broadcasts here)."""
    found = BUILT.found(params)
    meta = [p for p in params if p.is_meta]
    for p in meta:
        if id(p) not in found:
            raise ZeroshardError(
                f"GatheredParameters: a meta-device parameter of shape {tuple(p.shape)} that zeroshard.zero_init() "
                "(deepspeed.zero.Init) did not build, so nothing can give it values before initialize; build the "
                "model under zeroshard.zero_init(), or enter the block after initialize"
            )
    if not found:
        return None
    if not dist.is_initialized():  # every rank enters the block; DeepSpeed's zero.Init starts the group too
        from zeroshard.comm.topology import init_distributed
        from zeroshard.config.features import collective_timeout

        init_distributed(timeout_s=collective_timeout())  # no config yet: DEEPSPEED_TIMEOUT or the default
    owners = {id(m): m for p in params if (m := found.get(id(p))) is not None}
    roots = {id(r): r for r in (BUILT.root(m) for m in owners.values())}.values()
    new_adapters = [
        (root, names) for root in roots if (names := _adapter_names(root)) and BUILT.adapters.get(root) != names
    ]
    _agree_entry(params, found, new_adapters, modifier_rank)  # before anything changes: it may raise
    made: list[nn.Parameter] = []
    for root, names in new_adapters:  # PEFT's initialisation (lora_B zero), once per adapter
        adapters = materialize_adapters(root)  # real from now on (small), the same on every rank
        BUILT.adopt(root, adapters)
        _broadcast(adapters, 0)
        BUILT.adapters[root] = names
    for owner in owners.values():
        if any(p.is_meta for p in owner.parameters(recurse=False)):
            made += _values_of(owner)
    fresh = {id(p) for p in made}
    real = [p for p in params if id(p) in found and id(p) not in fresh]
    _broadcast(made, 0)  # one set of values on every rank, whatever each rank's random state
    set_status([*made, *real], ZeroParamStatus.AVAILABLE)
    for p in [*made, *real]:
        BUILT.open[id(p)] = BUILT.open.get(id(p), 0) + 1
    owner_of = {**found, **{id(p): m for m in owners.values() for p in m.parameters(recurse=False)}}
    return Pending(made, real, owner_of)


def _values_of(owner: nn.Module) -> list[nn.Parameter]:
    """The module's meta parameters made real: initialised as `initialize` would, then the checkpoint's values."""
    own = [p for p in owner.parameters(recurse=False) if p.is_meta]
    with torch.random.fork_rng(devices=[]):
        init_module(owner, BUILT.root(owner), torch.device("cpu"))
    for p in own:
        weights = weights_covering(p)
        if weights is not None:  # transformers loads the checkpoint over the initialisation
            weights.read_whole([(p, p)])
    return own


def end(pending: Pending, modifier_rank: int | None) -> None:
    """The block is over: rank `modifier_rank`'s values everywhere, kept for `initialize`; or (None) the parameters
    made real for the block back on the meta device (those real before keep theirs)."""
    both = [*pending.made, *pending.real]
    for p in both:
        left = BUILT.open.pop(id(p), 1) - 1
        if left:
            BUILT.open[id(p)] = left
    if modifier_rank is not None:
        try:
            if dist.get_world_size() > 1:  # naming the parameters walks the models
                BUILT.agreement().agree(
                    f"the end of GatheredParameters(modifier_rank={modifier_rank}) before initialize",
                    f"broadcast from rank {modifier_rank} of {_named(both, pending.owner_of)}",
                    awaited="the end of its GatheredParameters block (one that raised on a rank does not broadcast)",
                )
        except BaseException:
            _back_to_meta(pending)  # nothing kept that the other ranks do not have
            raise
        for p in both:
            BUILT.keep(p)
        _broadcast(both, modifier_rank)
        return
    _back_to_meta(pending)


def _back_to_meta(pending: Pending) -> None:
    """The parameters made real for the block go back to the meta device; those a block inside this one kept, or
    still open in an enclosing block, stay real."""
    back = [p for p in pending.made if not BUILT.kept(p) and id(p) not in BUILT.open]
    for p in back:
        owner = pending.owner_of.get(id(p))
        with unrecorded(), swappable(owner) if owner is not None else nullcontext():
            swap_keeping_attributes(p, torch.empty_like(p, device="meta"))
        # inside zero_init: the constructor's later writes still count
        name = next((n for n, q in owner._parameters.items() if q is p), None) if owner is not None else None
        if owner is not None and name is not None:
            continue_recording(owner, name, p)
    set_status(back, ZeroParamStatus.NOT_AVAILABLE)


def _adapter_names(root: nn.Module) -> frozenset[str]:
    return frozenset(getattr(root, "peft_config", None) or ())


def _agree_entry(
    params: Sequence[nn.Parameter],
    found: Mapping[int, nn.Module],
    adapters: Sequence[tuple[nn.Module, frozenset[str]]],
    modifier_rank: int | None,
) -> None:
    """[Note: gathering calls agree first] before a block's broadcasts: those of the adapters and the meta parameters
    it makes real (from rank 0), and the modifier's at its end; described before anything is made real."""
    owners = {id(m): m for m in found.values()}.values()
    made = {id(p): m for m in owners for p in m.parameters(recurse=False) if p.is_meta}
    if dist.get_world_size() == 1 or (not (made or adapters) and modifier_rank is None):
        return  # nothing sent
    named, paths = [sorted(names) for _, names in adapters], BUILT.paths()
    meta = [p for m in owners for p in m.parameters(recurse=False) if id(p) in made]
    kept = [p for p in params if id(p) in found]
    at_end = (
        f"; broadcast from rank {modifier_rank} of {_named(kept, found, paths)} at the end"
        if modifier_rank is not None
        else ""
    )
    BUILT.agreement().agree(
        "GatheredParameters before initialize"
        + (f", modifier_rank={modifier_rank}" if modifier_rank is not None else ""),
        f"broadcast from rank 0 of adapters {named} and {_named(meta, made, paths)}{at_end}",
    )


def _named(
    params: Sequence[nn.Parameter],
    owner_of: Mapping[int, nn.Module],
    paths: list[tuple[int, dict[int, str]]] | None = None,
) -> str:
    """`params` by model and name in it (the longest path that reaches them: a model still being built, in its part
    built so far) and shape: the same on every rank that makes the same block over the same models."""
    paths = BUILT.paths() if paths is None else paths
    names = []
    for p in params:
        owner = owner_of[id(p)]
        number, path = max(
            ((n, where[id(owner)]) for n, where in paths if id(owner) in where), key=_longer, default=(0, "?")
        )
        attr = next((k for k, q in owner._parameters.items() if q is p), "?")
        names.append(
            f"model {number}: {path}.{attr}{tuple(p.shape)}" if path else f"model {number}: {attr}{tuple(p.shape)}"
        )
    return f"{len(names)} tensor(s) {names}"


def _longer(found: tuple[int, str]) -> tuple[int, int]:
    """The deeper path wins; between equal depths, the model recorded first (a module shared by two models)."""
    return len(found[1].split(".")) if found[1] else 0, -found[0]


def _broadcast(params: Sequence[nn.Parameter], src: int) -> None:
    if not params or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    comm = Collectives(None, dist.get_world_size(), dist.get_rank())
    # NCCL moves device memory only: the values travel through this rank's GPU (the current device is GPU 0 on
    # every rank when the script started NCCL without set_device: NCCL refuses, or hangs on, duplicate GPUs)
    via = local_device() if "nccl" in str(dist.get_backend()) else None
    with torch.no_grad():
        comm.broadcast_coalesced([p.data for p in params], src, via, label="GatheredParameters before initialize")


def refuse_open_block(model: nn.Module) -> None:
    """`initialize` inside a `GatheredParameters` block over the model: the block's end would act on an engine's
    parameters as on pending ones."""
    if BUILT.open and any(id(p) in BUILT.open for p in model.parameters()):
        raise ZeroshardError(
            "initialize was called inside a GatheredParameters block over the model's parameters (built under "
            "zero_init, not initialized yet); leave the block first"
        )
