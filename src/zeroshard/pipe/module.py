"""DeepSpeed's `PipelineModule`: a sequence of layers split into stages, each rank building and running its own.

[Note: tied layers]
A `TiedLayerSpec` key used on several stages gives each of those stages its own copy of the module (in
`tied_modules`, one per key, so a stage that uses the key twice shares one copy). The copies start from the
lowest stage's values (broadcast at initialize) and the engine sums their gradients over the tie group (the
stages holding the key, same data-parallel replica) before each step, so every copy takes the same update, as
DeepSpeed's `allreduce_tied_weight_gradients`.

[Note: interleaved chunks]
The interleaved schedule (zeroshard's `"pipeline": {"schedule": "interleaved", "virtual_stages": v}`) splits
the layers into num_stages * v chunks with the same partition method; chunk k runs on stage k % num_stages,
so each rank holds v chunks, each a PipelineStage of torch's ScheduleInterleaved1F1B.

[Note: pipeline activation checkpointing]
With `activation_checkpoint_interval` n > 0 (the module's argument, `set_checkpoint_interval(n)`, or the config's
`pipeline.activation_checkpoint_interval`, which DeepSpeed's pipeline engine writes into the module when above 0), the
stage's layers run in ranges of n, and a range is recomputed in the backward when it is checkpointable, as DeepSpeed's
`_is_checkpointable` decides: every layer's class named in `checkpointable_layers` when that is given, else any layer
holding parameters (a range of activations and reshapes is not worth recomputing). The checkpoint is
`activation_checkpoint_func` when given, called as DeepSpeed calls it (`func(range, *inputs)`; floating-point inputs
that need no gradient made leaves that do, as DeepSpeed's engine makes the first stage's, else a reentrant checkpoint
such as `checkpointing.checkpoint` gave the layers before it no gradient, silently), else torch's non-reentrant one
(DeepSpeed's default is its reentrant `checkpointing.checkpoint`; `pipeline.use_reentrant: false` puts the
non-reentrant one in the given function's place, as DeepSpeed: the same gradients either way). Each layer gets the
previous one's output as one argument, a tuple too, as DeepSpeed's `exec_func` passes it. DeepSpeed's special case for
its Megatron GPT pipes (only `ParallelTransformerLayerPipe` ranges with a reentrant checkpoint) is not kept: the
non-reentrant checkpoint takes the embedding's range as well.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroshard.comm.topology import init_distributed
from zeroshard.errors import ConfigError
from zeroshard.pipe.layers import LayerSpec, StageSpan, TiedLayerSpec, building_stage_layers
from zeroshard.pipe.mesh import PipeGrid
from zeroshard.pipe.partition import partition
from zeroshard.runtime.utils import set_random_seed
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

Layer = nn.Module | LayerSpec | Callable[..., Any]


class PipelineModule(nn.Module):
    """Layers run in sequence, split over `num_stages` pipeline stages; this rank builds only its stage's layers
    (DeepSpeed's `deepspeed.pipe.PipelineModule`). Pass it to `zeroshard.initialize` and train with
    `engine.train_batch()`; the last stage applies `loss_fn(output, labels)`.

    Example:
        >>> net = PipelineModule(layers=[nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)], num_stages=2,
        ...                      loss_fn=nn.CrossEntropyLoss())  # doctest: +SKIP
        >>> engine, _, _, _ = zeroshard.initialize(model=net, config=cfg)  # doctest: +SKIP
        >>> loss = engine.train_batch(data_iter=batches)  # doctest: +SKIP
    """

    grid: PipeGrid

    def __init__(
        self,
        layers: Sequence[Layer],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        self.model_parallel_size = 1
        if topology is not None:
            num_stages, self.model_parallel_size = _from_topology(topology, num_stages)
        if num_stages is None:
            raise ConfigError("PipelineModule needs num_stages=")
        if not dist.is_initialized():  # DeepSpeed needs init_distributed() first; from the environment here
            init_distributed()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.grid = PipeGrid(int(num_stages), world)
        self.num_stages = int(num_stages)
        self.stage_id = self.grid.stage_of(rank)
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self._checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.tuple_input = False  # the first stage's data is a tuple (the pipeline engine sets it per batch)
        self._specs = list(layers)
        self._partition_method = partition_method
        self._seed_fn = (seed_fn or set_random_seed) if seed_layers else None
        self._base_seed = base_seed
        self.virtual_stages = 1
        self.parts = self._partition(1)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.chunk_funcs: list[list[Callable[..., Any]]] = []
        self._build()
        log_rank(logger, 20, f"pipeline stages at layers {self.parts} ({partition_method}); stage {self.stage_id}")

    def _partition(self, virtual: int) -> list[int]:
        counts, names = [_count_params(s) for s in self._specs], _names(self._specs)
        return partition(self._partition_method, counts, names, self.num_stages * virtual)

    def interleave(self, virtual: int) -> None:
        """[Note: interleaved chunks] Re-split into `num_stages * virtual` chunks; this rank keeps chunks
        stage, stage + num_stages, ... (torch's ScheduleInterleaved1F1B layout). Layers given as modules are
        reused; specs are built again (with seed_layers, from the same seeds)."""
        if virtual == self.virtual_stages:
            return
        for name, _ in list(self.named_children()):
            if name != "loss_fn":  # a loss module (nn.MSELoss()) is no layer: it stays
                delattr(self, name)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs = {}
        self.virtual_stages = virtual
        self.parts = self._partition(virtual)
        self._build()
        log_rank(logger, 20, f"interleaved pipeline: {virtual} chunks per rank at layers {self.parts}")

    @property
    def _local_start(self) -> int:
        """DeepSpeed's: the index of this stage's first layer (its first chunk's when interleaved)."""
        return self.parts[self.stage_id]

    @property
    def _local_stop(self) -> int:
        """DeepSpeed's: one past this stage's last layer (of its first chunk when interleaved)."""
        return self.parts[self.stage_id + 1]

    @property
    def forward_funcs(self) -> list[Callable[..., Any]]:
        return [fn for chunk in self.chunk_funcs for fn in chunk]

    def local_chunks(self) -> list[int]:
        """Global chunk indices this rank holds (its stage index when not interleaved)."""
        return [c * self.num_stages + self.stage_id for c in range(self.virtual_stages)]

    def chunk_modules(self) -> list[nn.Module]:
        """One module per local chunk, for torch's PipelineStage (sharing this module's parameters)."""
        total = self.num_stages * self.virtual_stages
        return [
            _Chunk(funcs, functools.partial(self._run_checkpointed, first=index == 0, last=index == total - 1))
            for funcs, index in zip(self.chunk_funcs, self.local_chunks(), strict=True)
        ]

    def _build(self) -> None:
        self.chunk_funcs = []
        ranks = self.grid.dp_ranks(self.stage_id)
        with building_stage_layers(StageSpan(self.num_stages, ranks[0], len(ranks))):
            for chunk in self.local_chunks():
                layers = range(self.parts[chunk], self.parts[chunk + 1])
                self.chunk_funcs.append([self._build_layer(i) for i in layers])

    def _build_layer(self, index: int) -> Callable[..., Any]:
        spec = self._specs[index]
        if self._seed_fn is not None:
            self._seed_fn(self._base_seed + index)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                self.tied_modules[spec.key] = spec.build()
                self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
            module = self.tied_modules[spec.key]
            return functools.partial(spec.forward_fn, module) if spec.forward_fn is not None else module
        if isinstance(spec, LayerSpec):
            built = spec.build()
            self.add_module(str(index), built)
            return built
        if isinstance(spec, nn.Module):
            self.add_module(str(index), spec)
            return spec
        if callable(spec):
            return spec
        raise ConfigError(f"PipelineModule layer {index} is {type(spec).__name__}: not a module, spec or function")

    def tied_stages(self) -> dict[str, list[int]]:
        """Every tie key and the stages that use it (the same on every rank: computed from the specs)."""
        ties: dict[str, list[int]] = {}
        for chunk in range(len(self.parts) - 1):
            stage = chunk % self.num_stages
            for spec in self._specs[self.parts[chunk] : self.parts[chunk + 1]]:
                if isinstance(spec, TiedLayerSpec) and stage not in ties.setdefault(spec.key, []):
                    ties[spec.key].append(stage)
        return {key: sorted(stages) for key, stages in ties.items()}

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        module = self.tied_modules[key]
        return [module.get_parameter(attr) for attr in self.tied_weight_attrs[key]]

    def forward(self, *inputs: Any) -> Any:
        last = self.stage_id == self.num_stages - 1
        return self._run_checkpointed(self.forward_funcs, *inputs, first=self.stage_id == 0, last=last)

    def topology(self) -> PipeGrid:
        return self.grid

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint the layers in ranges of `interval` from the next forward (0: none), as DeepSpeed's."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"set_checkpoint_interval({interval!r}): expected an int >= 0")
        self.activation_checkpoint_interval = interval

    def use_non_reentrant_checkpoint(self) -> None:
        """`pipeline.use_reentrant: false`: torch's non-reentrant checkpoint, also over a given
        `activation_checkpoint_func` (DeepSpeed's engine puts its `non_reentrant_checkpoint` there)."""
        self._checkpoint_func = None

    def _is_checkpointable(self, funcs: Sequence[Callable[..., Any]]) -> bool:
        """Whether a range is recomputed ([Note: pipeline activation checkpointing])."""
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, nn.Module))

    def _run_checkpointed(
        self, funcs: list[Callable[..., Any]], *inputs: Any, first: bool = True, last: bool = True
    ) -> Any:
        """The layers over what torch's stage hands over, spread as positional arguments: a 1-tuple is told from a
        tensor by `one_tuple_mark()` after it (at a stage boundary) or by `tuple_input` (the first stage's data), as
        DeepSpeed keeps a tuple a tuple ([Note: tuples between stages])."""
        if inputs and is_one_tuple_mark(inputs[-1]):
            x: Any = tuple(inputs[:-1])
        elif first and self.tuple_input:
            x = tuple(inputs)
        else:
            x = inputs[0] if len(inputs) == 1 else inputs
        out = self._run_ranges(funcs, x)
        if not last and isinstance(out, tuple) and len(out) == 1 and isinstance(out[0], torch.Tensor):
            return (*out, one_tuple_mark(out[0].device))
        return out

    def _run_ranges(self, funcs: list[Callable[..., Any]], x: Any) -> Any:
        interval = self.activation_checkpoint_interval
        if interval <= 0 or not torch.is_grad_enabled() or _INFERRING_SHAPES.get():
            return _run(funcs, x)
        for start in range(0, len(funcs), interval):
            run = functools.partial(_run, funcs[start : start + interval])
            if not self._is_checkpointable(funcs[start : start + interval]):
                x = run(x)
            elif self._checkpoint_func is not None:  # DeepSpeed's call: the inputs spread, a single one unwrapped
                spread = x if isinstance(x, tuple) else (x,)
                x = self._checkpoint_func(functools.partial(_run_spread, run), *_differentiable(spread))
            else:
                x = checkpoint(run, x, use_reentrant=False)
        return x


class _Chunk(nn.Module):
    """A chunk of an interleaved PipelineModule as torch's PipelineStage wants it: a module (its layers are
    registered here too, the same parameter objects) whose forward runs the chunk's functions."""

    def __init__(self, funcs: list[Callable[..., Any]], run: Callable[..., Any]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([f for f in funcs if isinstance(f, nn.Module)])
        self._funcs = funcs
        self._run = run

    def forward(self, *inputs: Any) -> Any:
        return self._run(self._funcs, *inputs)


def _from_topology(topology: Any, num_stages: int | None) -> tuple[int, int]:
    """(stages, model-parallel size) of DeepSpeed's PipeDataParallelTopology / PipeModelDataParallelTopology,
    whose rank layout is the mesh's ([Note: pipeline mesh], [Note: 3D mesh] in pipe/three_d.py)."""
    axes = list(getattr(topology, "axes", []))
    if axes not in (["pipe", "data"], ["pipe", "data", "model"]) or not callable(getattr(topology, "get_dim", None)):
        raise ConfigError(
            f"PipelineModule(topology=...) with axes {axes}: expected DeepSpeed's PipeDataParallelTopology or "
            "PipeModelDataParallelTopology (axes pipe, data[, model]); or pass num_stages="
        )
    stages = int(topology.get_dim("pipe"))
    if num_stages is not None and int(num_stages) != stages:
        raise ConfigError(f"PipelineModule(num_stages={num_stages}, topology=...) with {stages} pipe stages: pass one")
    return stages, int(topology.get_dim("model")) if "model" in axes else 1


# torch's schedule is inferring the stages' shapes ([Note: the schedule's set-up forward] in pipe/engine.py): the
# layers run without checkpoints, whose recompute a reentrant checkpoint would refuse under the inference's
# `torch.autograd.grad` (only the shapes are wanted there)
_INFERRING_SHAPES: ContextVar[bool] = ContextVar("zeroshard_pipe_inferring_shapes", default=False)


@contextmanager
def inferring_shapes() -> Iterator[None]:
    token = _INFERRING_SHAPES.set(True)
    try:
        yield
    finally:
        _INFERRING_SHAPES.reset(token)


# [Note: tuples between stages] torch's stage spreads a tuple into positional arguments, and a 1-tuple arrives as a
# lone tensor; a stage whose output is a 1-tuple sends this mark after it (no gradient: the stage's backward skips it),
# and the next stage's module turns the pair back into the 1-tuple the layer returned, as DeepSpeed's receiving stage
# rebuilds a tuple. (A stage's own data is a tuple by `PipelineModule.tuple_input`, set by the engine.)
def one_tuple_mark(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.uint8, device=device)


def is_one_tuple_mark(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and tuple(value.shape) == (1,)


def _run(funcs: Sequence[Callable[..., Any]], x: Any) -> Any:
    """The layers in turn, each given the previous one's output as one argument (a tuple too), as DeepSpeed's."""
    for fn in funcs:
        x = fn(x)
    return x


def _run_spread(run: Callable[[Any], Any], *inputs: Any) -> Any:
    return run(inputs[0] if len(inputs) == 1 else inputs)


def _differentiable(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """A reentrant checkpoint's inputs: floating-point tensors that need no gradient made leaves that do, as
    DeepSpeed's pipeline engine makes the first stage's inputs under activation checkpointing; otherwise a reentrant
    checkpoint (DeepSpeed's `checkpointing.checkpoint`) returns outputs without a gradient and the layers in it get
    none, silently."""
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return inputs
    return tuple(
        t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs
    )


def _count_params(spec: Layer) -> int:
    """Trainable elements of a layer, as DeepSpeed counts them for `partition_method="parameters"` (a spec is
    built on the CPU to count it, then dropped)."""
    module = spec.build() if isinstance(spec, LayerSpec) else spec
    if not isinstance(module, nn.Module):
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _names(specs: Sequence[Layer]) -> list[str]:
    return [
        s.typename.__name__ if isinstance(s, LayerSpec) else type(s).__name__ if isinstance(s, nn.Module) else ""
        for s in specs
    ]
