"""What a model's code computes and writes into its meta tensors under `zero_init`, recorded to be replayed for real.

[Note: initialisation recorded under zero_init]
Under `zero_init` a model is built on the meta device, where every value its code computes or writes is lost: a
custom norm's `nn.Parameter(torch.ones(d))`, a position table `nn.Parameter(torch.randn(n, d) * 0.02)`, a causal-mask
buffer, `nn.init.zeros_(self.out.weight)` in a parent's `__init__` (adaLN-Zero), `self.apply(init_fn)`, timm's and
torchtitan's `trunc_normal_`, GPT-2's scaled projections (`for n, p in self.named_parameters(): ... normal_(p,
std=0.02 / sqrt(2 * n_layer))`). `initialize` gave such tensors their modules' `reset_parameters()` values, or zeros
where a module had none (a custom LayerNorm's weight): the model trained from another initialisation than its code
writes, without a word. (DeepSpeed's `zero.Init` keeps what a module's own constructor computes and gathers inside
`module.apply` (`override_module_apply`); a direct write to a built child's parameter is lost there.)

So while `zero_init` is active, a torch function mode (torch's public extension point; nothing is patched) records,
from the thread that entered it, for each meta storage made there: the call that created it, and each in-place call
that wrote into it or into a view of it (the view's size, stride, offset and dtype kept). A call's meta arguments
are kept as references to their storages at the version they had then (a later write does not change what an
earlier call read); its real tensor and array arguments as copies (the caller may change them later); the default
dtype it ran under. `torch.nn.init` functions are recorded as one call each; the four that return early on the meta
device without dispatching (`trunc_normal_`, `orthogonal_`, `dirac_`, `sparse_`) are recognised at their `is_meta`
check, by their code, and recorded with their arguments. At the block's end each module's meta parameters and
buffers are bound to their storages' records, every module under the models built (a layer `copy.deepcopy`'d in a
constructor included; a whole model deep-copied is not seen), in a weak map keyed by the module: nothing is added to
the parameters.

Materialising a module (`initialize`, unit by unit; a `GatheredParameters` block before it, also inside the `zero_init`
block) replays its tensors' records: every event they depend on runs in the order it was recorded (so each call
finds what it read at the version it read; no copies of older versions, no recursion), creators on the target device
(a `device="meta"` argument becomes that device), writes into views of their results, real arguments copied afresh.
Each call draws from a seed of its own: the default generator's seed when it was recorded (`torch.initial_seed()`,
as set by `torch.manual_seed`) and the number of calls recorded under that seed before it in this process (a
`generator=` argument: that generator's seed and the number). So the values are the same in every unit layout, in a
block before `initialize` and after it (on the same device type: `initialize` on a GPU draws there, a block before
it on the CPU), and on every rank that seeded alike and built alike (ranks that did not take rank 0's values at
`initialize`: [Note: one start on every rank] in agree.py); the next model built, even
after setting the same seed again, is another one (a fresh process starts the counts anew); a tensor copied from
another inside the constructor (an EMA teacher deep-copied from its student, a buffer cloned from a weight) replays
the same draws. They follow the same distributions as the model built whole, not the same numbers, and recording
draws nothing from the generators.
Where no record initialises a parameter, its module's `reset_parameters()` and `_init_weights` run under a seed of
the module's own, taken the same way from its first parameter's record.

- A tensor whose record is not an initialisation (made by `torch.empty`, or from such a storage, and never written,
  as under transformers' skipped initialisation; or depending on a meta tensor made outside the block) keeps its
  module's own: `reset_parameters()` and the root's `_init_weights`, under the module's seed.
- transformers skips its models' initialisation on the meta device (`init_weights` asks for the device with
  `torch.tensor([])`); seen there (by its code, up the stack), `initialize_weights()` is run and recorded at that
  moment, as it runs when a model is built whole: `_init_weights` on every module, children before parents, so a
  parent's branch reaches its children wherever they are materialised (GPT-2 scales its attention's `c_proj`, CLIP
  initialises its projections from the root); a streamed `from_pretrained` records it too, for the keys its
  checkpoint lacks.
- Not recorded: writes after the `zero_init` block (use `GatheredParameters(..., modifier_rank=0)` there, as with
  DeepSpeed), and a `copy.deepcopy` of a whole model (its tensors are new and no registration hook sees the copy:
  it gets its modules' `reset_parameters()`; copy the layers inside a constructor, or build the copy as the first
  one was); reading a meta value into Python (`.item()` fails on the meta
  device); writes a call makes other than into its first argument, `out=` or `inplace=True` (a batch norm's running
  statistics in a forward run in `__init__`, `torch._foreach_*_`, an `out=` tuple).
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zeroshard.loading.device_moves import DEVICE_MOVES, kept_on_meta
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

# calls named like in-place ones that change no values (metadata, autograd, storage rebinding)
_NOT_WRITES = frozenset(
    {
        "requires_grad_", "share_memory_", "detach_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_",
        "transpose_", "swapdims_", "swapaxes_", "rename_", "resize_", "resize_as_", "record_stream",
    }
)  # fmt: skip
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
        "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
    }
)  # fmt: skip
_UNINITIALISED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
_SEQUENCE = itertools.count()  # events of every recording, in the order they happened
# transformers models whose `_init_weights` runs after the replay, module by module (it could not be recorded)
INIT_AFTER: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _empty_list(args: tuple[Any, ...]) -> bool:
    return len(args) == 1 and isinstance(args[0], list) and not args[0]


def _skipping_init() -> Any:
    """The transformers model whose `init_weights` is asking `get_torch_context_manager_or_global_device()` for the
    device (its `torch.tensor([])`), seen up the stack by their code; None for any other `torch.tensor([])`."""
    modeling = sys.modules.get("transformers.modeling_utils")
    asking = getattr(getattr(modeling, "get_torch_context_manager_or_global_device", None), "__code__", None)
    init_weights = getattr(getattr(getattr(modeling, "PreTrainedModel", None), "init_weights", None), "__code__", None)
    if asking is None or init_weights is None:
        return None
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_FRAMES_UP):
        if frame is None:
            return None
        if frame.f_code is asking:
            caller = frame.f_back
            return caller.f_locals.get("self") if caller is not None and caller.f_code is init_weights else None
        frame = frame.f_back
    return None


class _Places:
    """A recorded call's seed: the default generator's seed when it is recorded, and the number of calls recorded
    under that seed before it in this process (by any recording: two models built one after the other differ, as
    they would built whole; a seed set for a moment inside the block does not make later calls repeat earlier
    draws). Setting the same seed again continues its count: the next model is another one (built whole it would be
    the same one; a fresh process starts every count anew)."""

    def __init__(self) -> None:
        self._next: dict[int, int] = {}  # seed -> calls recorded under it so far

    def next(self) -> tuple[int, int]:
        seed = torch.initial_seed()
        place = self._next.get(seed, 0)
        self._next[seed] = place + 1
        return seed, place


_PLACES = _Places()


def _early_returning_inits() -> dict[Any, Callable[..., Any]]:
    """torch's init functions that return on the meta device before dispatching: the code that checks `is_meta`,
    and the public function to replay with the same arguments."""
    init = torch.nn.init
    pairs = [("_no_grad_trunc_normal_", "trunc_normal_"), ("orthogonal_", "orthogonal_")]
    pairs += [("dirac_", "dirac_"), ("sparse_", "sparse_")]
    out = {}
    for checking, public in pairs:
        code = getattr(getattr(init, checking, None), "__code__", None)
        if code is not None and callable(getattr(init, public, None)):
            out[code] = getattr(init, public)
    return out


_EARLY_RETURNING = _early_returning_inits()
_IS_META = torch.Tensor.is_meta.__get__  # type: ignore[attr-defined]
_FRAMES_UP = 8  # torch function modes stacked inside the block that `_early_return` looks past


@dataclass(frozen=True)
class Geometry:
    """A view of a storage: what `as_strided` needs to take it again from a tensor over the whole storage."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> Geometry:
        return Geometry(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)


@dataclass
class Call:
    """A recorded call: its arguments with meta tensors as `Ref`s, the meta device as `DEVICE`, the tensor a write
    goes into as `TARGET`, generators as `Seeded`; `sequence` its place in the recording."""

    func: Callable[..., Any] | None  # None: not replayable (it read a meta tensor made outside the recording)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    sequence: int = 0  # the order of events over all recordings
    seed: int = 0  # the recording's seed, and the call's place in it: the call's random draws
    place: int = 0
    default_dtype: torch.dtype = torch.float32

    @property
    def name(self) -> str:
        return str(getattr(self.func, "__name__", self.func))


@dataclass
class Write:
    into: Geometry
    call: Call


@dataclass(eq=False)
class Record:
    """One meta storage's history: its creator (an output of `creator`, at `path`) and the writes into it."""

    creator: Call
    path: tuple[int, ...]
    made: Geometry
    writes: list[Write] = field(default_factory=list)

    def initialises(self, version: int | None = None) -> bool:
        """Whether the storage holds values at `version` (its last by default) that the replay can compute: not made by
        `torch.empty` (or from such a storage) without a write since. Iterative: chains of calls can be long."""
        stack, seen = [(self, len(self.writes) if version is None else version)], set()
        while stack:
            record, at = stack.pop()
            if (id(record), at) in seen:
                continue
            seen.add((id(record), at))
            writes = record.writes[:at]
            if record.creator.func is None or any(w.call.func is None for w in writes):
                return False
            if writes:
                continue
            if record.creator.name in _UNINITIALISED:
                return False
            calls = (record.creator.args, record.creator.kwargs)
            stack += [(r.record, r.version) for r in leaves(calls) if isinstance(r, Ref)]
        return True


@dataclass(frozen=True)
class Ref:
    record: Record
    version: int
    view: Geometry


@dataclass(frozen=True)
class Seeded:
    """A `torch.Generator` argument: replayed as a generator seeded from its seed and the call's place."""

    seed: int


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


DEVICE = _Marker("DEVICE")
TARGET = _Marker("TARGET")


@dataclass(frozen=True)
class Binding:
    """A parameter or buffer's record, and its own view of the storage."""

    record: Record
    view: Geometry


def leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, list | tuple):
        for item in tree:
            yield from leaves(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from leaves(item)
    else:
        yield tree


def outputs(tree: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Any]]:
    if isinstance(tree, list | tuple):
        for k, item in enumerate(tree):
            yield from outputs(item, (*path, k))
    else:
        yield path, tree


def tree_map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, list | tuple) and not hasattr(tree, "_fields"):
        return type(tree)(tree_map(item, fn) for item in tree)
    if isinstance(tree, dict):
        return {k: tree_map(v, fn) for k, v in tree.items()}
    return fn(tree)


def storage_key(t: Any) -> int | None:
    if not isinstance(t, torch.Tensor) or not t.is_meta:
        return None
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without a storage of their own
        return None


def _is_meta_device(value: Any) -> bool:
    return (isinstance(value, torch.device) and value.type == "meta") or (isinstance(value, str) and value == "meta")


class Recorder(TorchFunctionMode):
    """The torch function mode that records meta storages' histories while `zero_init` is active."""

    def __init__(self) -> None:
        super().__init__()
        self._records: dict[int, Record] = {}  # storage -> its record
        self._alive: list[torch.Tensor] = []  # a tensor per recorded storage: keys are not reused while recording
        self._paused = 0
        self.initialised: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # transformers models recorded whole

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in DEVICE_MOVES and not self._paused and storage_key(args[0]) is not None:
            moved = kept_on_meta(func, args, kwargs)
            if moved is None:
                return args[0]
            func, args, kwargs = moved
        out = func(*args, **kwargs)
        if self._paused:
            return out
        if func == _IS_META and out is True:
            self._early_return(args[0])
        elif func is torch.tensor and _empty_list(args) and isinstance(out, torch.Tensor) and out.is_meta:
            model = _skipping_init()
            if model is not None:  # transformers' check of the device, about to skip: what it skips, recorded now
                self._initialise(model)
        elif any(storage_key(t) is not None for t in itertools.chain(leaves(args), leaves(kwargs), leaves(out))):
            self._record(func, args, kwargs, out)
        return out

    @contextmanager
    def paused(self) -> Iterator[None]:
        """zeroshard's own meta tensors (a block's parameters going back to the meta device) are not the model's."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _initialise(self, model: Any) -> None:
        """transformers' `initialize_weights()` on the meta model, recorded (the mode is off its stack while it
        handles a call: entered again). A model whose `_init_weights` cannot run there (it reads a value) has what
        it wrote dropped and runs `_init_weights` module by module after the replay, on real tensors, as before."""
        lengths = [(record, len(record.writes)) for record in self._records.values()]
        try:
            with self:
                model.initialize_weights()
        except Exception as e:  # noqa: BLE001 - any failure of the model's own code on the meta device
            for record, length in lengths:
                del record.writes[length:]
            if model in INIT_AFTER:  # post_init again (a subclass calling it twice): said once
                return
            INIT_AFTER.add(model)
            logger.warning(
                "zeroshard.zero_init: %s's _init_weights cannot run on the meta device (%s); it runs module by module "
                "when each is materialised instead, where a parent's branch cannot reach its children",
                type(model).__name__,
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
            return
        self.initialised.add(model)

    def binding(self, t: torch.Tensor) -> Binding | None:
        key = storage_key(t)
        record = self._records.get(key) if key is not None else None
        return Binding(record, Geometry.of(t)) if record is not None else None

    def alias(self, t: torch.Tensor, binding: Binding) -> None:
        """`t` (a fresh meta tensor standing for a parameter again) continues `binding`'s record."""
        key = storage_key(t)
        if key is not None and binding.view == binding.record.made and Geometry.of(t) == binding.view:
            self._records[key] = binding.record
            self._alive.append(t.detach())  # the storage itself: the parameter may be swapped again

    def _early_return(self, tensor: Any) -> None:
        """An init function's `is_meta` check: the code that read it is up the stack, past this method, ours and any
        torch function mode entered after this one (a `torch.device` context inside the block)."""
        frame: FrameType | None = sys._getframe(2)
        for _ in range(_FRAMES_UP):
            if frame is None:
                return
            public = _EARLY_RETURNING.get(frame.f_code)
            if public is not None:
                code = frame.f_code
                names = code.co_varnames[: code.co_argcount]
                given = {name: frame.f_locals[name] for name in names if name in frame.f_locals}
                if given.get("tensor") is tensor:
                    self._record(public, (), given, tensor)
                return
            if frame.f_code.co_name != "__torch_function__":
                return  # someone else's `is_meta` question
            frame = frame.f_back

    def _record(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func is torch.Tensor.__deepcopy__:  # a buffer's `copy.deepcopy` (its memo is no argument): a clone
            func, args, kwargs = torch.Tensor.clone, args[:1], {}
        name = str(getattr(func, "__name__", ""))
        if name in _NOT_WRITES or name in ("__get__", "__set__"):
            return  # `.data` read (an alias) or rebound (the parameter's storage is another one's from now on)
        target = kwargs.get("out")
        writes = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))
        if target is None and (writes or kwargs.get("inplace") is True):
            target = args[0] if args else next((kwargs[k] for k in ("tensor", "self", "input") if k in kwargs), None)
        key = storage_key(target)
        if key is not None:
            record = self._records.get(key)
            if record is not None and isinstance(target, torch.Tensor):  # a write into a storage of ours
                record.writes.append(Write(Geometry.of(target), self._call(func, args, kwargs, target)))
            return
        creator: Call | None = None
        for path, t in outputs(out):
            key = storage_key(t)
            if key is None or key in self._records:
                continue  # a view of a storage already recorded, or not a meta tensor
            if creator is None:
                creator = self._call(func, args, kwargs, None)
            self._records[key] = Record(creator, path, Geometry.of(t))
            self._alive.append(t)

    def _call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], target: Any) -> Call:
        """The call with its meta arguments as references and its real ones as copies; not replayable if one is a
        meta tensor made outside the recording."""
        unknown = False

        def template(value: Any) -> Any:
            nonlocal unknown
            if target is not None and value is target:
                return TARGET
            if _is_meta_device(value):
                return DEVICE
            if isinstance(value, torch.Generator):
                return Seeded(value.initial_seed())
            if isinstance(value, np.ndarray):
                return value.copy()
            if isinstance(value, torch.Tensor) and not value.is_meta:
                return value.detach().clone()
            key = storage_key(value)
            if key is None:
                return value
            record = self._records.get(key)
            if record is None:
                unknown = True
                return value
            return Ref(record, len(record.writes), Geometry.of(value))

        templated = Call(func, tree_map(args, template), tree_map(kwargs, template))
        if unknown:
            templated.func = None
        templated.sequence = next(_SEQUENCE)
        templated.seed, templated.place = _PLACES.next()
        templated.default_dtype = torch.get_default_dtype()
        return templated

    def close(self) -> None:
        self._records.clear()
        self._alive.clear()


class _Active(threading.local):
    """The recording under way in this thread (torch function modes are per thread too)."""

    recorder: Recorder | None = None


_ACTIVE = _Active()


@contextmanager
def recording() -> Iterator[Recorder]:
    """A `Recorder` active for the duration: [Note: initialisation recorded under zero_init]."""
    recorder = Recorder()
    outer, _ACTIVE.recorder = _ACTIVE.recorder, recorder
    try:
        with recorder:
            yield recorder
    finally:
        _ACTIVE.recorder = outer
        recorder.close()


def active() -> Recorder | None:
    return _ACTIVE.recorder


def bindings_of(recorder: Recorder, module: nn.Module) -> dict[str, Binding]:
    """The module's own meta parameters' and buffers' bindings, by name."""
    own = {**module._parameters, **module._buffers}
    return {n: b for n, t in own.items() if t is not None and (b := recorder.binding(t)) is not None}
