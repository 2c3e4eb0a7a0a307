"""DeepSpeed's `PipelineEngine`: `train_batch()` runs one optimizer step over a pipeline schedule of micro-batches.

[Note: pipeline step]
One `train_batch` pulls `gradient_accumulation_steps` micro-batches from the data iterator (on the first stage for
inputs, on the last for labels, as DeepSpeed) and hands the inputs, concatenated, to a `torch.distributed.pipelining`
schedule (1F1B, GPipe or interleaved 1F1B) over this replica's pipeline group, which splits them back into the same
micro-batches; the labels stay per micro-batch (a tensor or a tuple of tensors on the device, anything else as it is, as
DeepSpeed's), found by the micro-batch's index, which is what the schedule splits as its target. The schedule's loss
function returns `loss / gas` (DeepSpeed's `_scale_loss_by_gas`), so the `.grad`s the schedule accumulates are
DeepSpeed's; the ZeRO strategy is not involved during the schedule and collects those `.grad`s at the step as one
backward ([Note: gradients outside engine.backward]), reducing them over the stage's data-parallel group. The clipping
norm adds up every stage's share (`StepPolicy.model_parallel`). The reported loss is the mean over micro-batches and
replicas, broadcast from the last stage to the whole pipeline, as DeepSpeed's `_aggregate_total_loss`; rank 0 writes it
to the monitors as `Train/Samples/train_loss` (`eval_batch`'s as `eval_loss`), as DeepSpeed's pipeline engine does
([Note: monitor events]).

[Note: the schedule's set-up forward]
A new torch schedule infers its stages' shapes on its first step: each stage runs its module once in training mode on
the first micro-batch's inputs (stage 0) or on uninitialised tensors of the received shapes (the others), and the
backward of that, before the real micro-batches (the layers run without checkpoints there: `inferring_shapes`). torch
keeps the RNG out of it (`fork_rng`); it does not keep the module's buffers: a BatchNorm counted one batch more than
DeepSpeed's and took its statistics from that batch, on later stages from whatever memory `torch.empty` returned.
`_Stage` copies the module's buffers when the inference starts and puts them back before its first real forward, so
the set-up leaves no trace there (a module's own Python counters still see the call). A new input shape builds a new
schedule, and so costs one more set-up forward and backward ([Note: pipeline input shapes]: about +45% on that batch
for a small 2-stage model on CPU), and the stages exchange the first stage's shapes (and any stage's refusal) before
every batch (one small object all-gather over the pipeline group).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from zeroshard.checkpoint.torn import refuse_torn
from zeroshard.engine import Engine
from zeroshard.errors import ZeroshardError
from zeroshard.offload.states import PARAMS
from zeroshard.pipe.checkpoint import PipelineCheckpointMixin
from zeroshard.pipe.context import PipeContext
from zeroshard.pipe.module import PipelineModule, inferring_shapes
from zeroshard.utils.repeating import RepeatingLoader

_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


class PipelineEngine(PipelineCheckpointMixin, Engine):
    """What `zeroshard.initialize(model=PipelineModule(...))` returns: `train_batch()` / `eval_batch()`.

    Example:
        >>> engine, _, _, _ = zeroshard.initialize(model=net, config=cfg, training_data=ds)  # doctest: +SKIP
        >>> for _ in range(steps): loss = engine.train_batch()  # doctest: +SKIP
    """

    def __init__(self, *engine_args: Any, pipe: PipeContext) -> None:
        super().__init__(*engine_args)
        self.pipe = pipe
        self.data_iterator: Iterator[Any] | None = (
            RepeatingLoader(self.training_dataloader) if self.training_dataloader is not None else None
        )
        self._schedules: dict[tuple[str, bool, int, tuple[Any, ...]], Any] = {}
        self._micro_losses: list[Any] = []  # losses; outputs under eval_batch(compute_loss=False)
        self._labels: list[Any] = []  # this batch's labels, per micro-batch (on the last stage)
        self._compute_loss = True  # eval_batch(compute_loss=False): the last stage keeps its outputs, not losses
        self.agg_train_loss: torch.Tensor | None = None

    @property
    def pipeline_module(self) -> PipelineModule:
        assert isinstance(self.module, PipelineModule)
        return self.module

    def is_first_stage(self) -> bool:
        return self.pipe.is_first

    def is_last_stage(self) -> bool:
        return self.pipe.is_last

    @property
    def stage_id(self) -> int:
        return self.pipe.groups.stage

    @property
    def num_stages(self) -> int:
        return self.pipe.groups.grid.stages

    @property
    def dp_world_size(self) -> int:
        return self.pipe.data_parallel_size

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        self.data_iterator = iterator

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ZeroshardError("a pipeline engine trains with engine.train_batch() and evaluates with eval_batch()")

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches ([Note: pipeline step]); returns
        the mean loss (on every rank)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        self._require_optimizer("train_batch")
        self._refuse_offloaded("train_batch")  # it ends in a step: [Note: offloaded states]
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.schedules.before_batch(self.global_steps)  # [Note: legacy curriculum learning]
        self.tput_timer.start()  # stopped by the step below: [Note: throughput timer]
        self.accumulation.loss_scale = self.loss_scale
        with self._deadline("engine.train_batch"), torch.profiler.record_function("zeroshard.pipeline_schedule"):
            self._run(train=True)
            self.pipe.reduce_tied_grads(self.pipeline_module)
        self.accumulation.micro_steps += self.gradient_accumulation_steps() - 1
        self.step()  # the boundary: the strategy collects the .grads ([Note: pipeline step])
        self.agg_train_loss = self._aggregate_loss()
        self.telemetry.batch_loss("Train/Samples/train_loss", self.agg_train_loss, self.global_samples)
        return self.agg_train_loss

    @property
    def micro_batches(self) -> int:
        """DeepSpeed's pipeline attribute: the micro-batches a `train_batch` runs (`gradient_accumulation_steps`)."""
        return self.gradient_accumulation_steps()

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward only over `num_micro_batches` micro-batches (default `gradient_accumulation_steps`); returns the
        mean loss over them and the replicas, on every rank (with `bcast_loss=False` on the last stage only, None
        elsewhere, as DeepSpeed's), and with `return_logits=True` the last stage's outputs of the last micro-batch (the
        `outputs` DeepSpeed's forward leaves, each micro-batch replacing the one before; None on other stages). With
        `compute_loss=False` the loss_fn is not applied: the last stage returns its outputs averaged element by element
        over the micro-batches and the replicas, the other stages None, as DeepSpeed's."""
        if reduce_output != "avg":
            raise ZeroshardError(f"eval_batch(reduce_output={reduce_output!r}): only 'avg' is supported")
        if num_micro_batches is not None and num_micro_batches < 1:
            raise ZeroshardError(f"eval_batch(num_micro_batches={num_micro_batches}): expected at least 1")
        refuse_torn(self, "eval_batch")
        if self.strategy is not None:
            self.strategy.refuse_away("eval_batch", (PARAMS,))
        self.set_dataiterator(data_iter)
        self.module.eval()
        count = num_micro_batches or self.gradient_accumulation_steps()
        self._compute_loss = compute_loss
        try:
            with self._deadline("engine.eval_batch"), torch.no_grad():
                outputs = self._run(train=False, count=count)
        finally:
            self._compute_loss = True
        if not compute_loss:
            self.module.train()
            mean = self._mean_outputs(count)
            return (mean, _last_micro_batch(outputs, count)) if return_logits else mean
        loss = self._aggregate_loss(count)
        self.telemetry.batch_loss("Train/Samples/eval_loss", loss, self.global_samples)
        self.module.train()
        shown = loss if bcast_loss or self.pipe.is_last else None
        return (shown, _last_micro_batch(outputs, count)) if return_logits else shown

    def consolidated_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        raise ZeroshardError(
            "the whole model cannot be consolidated here: each pipeline stage holds its own layers; save_checkpoint "
            "keeps every stage (pipe_stage_XX/)"
        )

    def _run(self, train: bool, count: int | None = None) -> Any:
        gas = count or self.gradient_accumulation_steps()
        self._micro_losses = []
        inputs: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        refused: str | None = None  # a stage's reason to stop, raised on every stage ([Note: pipeline input shapes])
        if self.pipe.is_first or self.pipe.is_last:
            if self.data_iterator is None:
                raise ZeroshardError("train_batch()/eval_batch() need data: pass data_iter= or training_data=")
            try:
                batches = [next(self.data_iterator) for _ in range(gas)]
                if self.pipe.is_first:
                    self.pipeline_module.tuple_input = isinstance(batches[0][0], tuple)  # [Note: tuples between
                    inputs = _concat([b[0] for b in batches], self.device)  # stages]
                if self.pipe.is_last:  # the schedule splits each micro-batch's index; _micro_loss finds its labels
                    self._labels = [_labels(b[1], self.device) for b in batches]
                    kwargs["target"] = torch.arange(gas, device=self.device)
                    kwargs["losses"] = []
            except StopIteration:
                refused = _EXHAUSTED
            except ZeroshardError as err:
                refused = f"stage {self.stage_id}: {err}"
        schedule = self._schedule(train, gas, self._input_shapes(inputs, refused))
        outputs = schedule.step(*inputs, **kwargs) if train else schedule.eval(*inputs, **kwargs)
        # the first step's metadata inference also calls the loss function, on placeholder tensors: keep the
        # micro-batches' own losses, the last `gas`
        self._micro_losses = self._micro_losses[-gas:]
        return outputs

    def _input_shapes(self, inputs: tuple[Any, ...], refused: str | None) -> tuple[Any, ...]:
        """[Note: pipeline input shapes] The first stage's input shapes and dtypes, the same on every stage of this
        pipeline (one small all-gather over the pipeline group per batch): torch's schedule fixes the activations'
        shapes on its first step, so inputs of other shapes (another sequence length) take a schedule of their own,
        on every stage, as DeepSpeed's `dynamic_shape` sends each batch's shapes; without it a later stage received
        into buffers of the first batch's shapes and gloo aborted. `refused`: this stage's reason to refuse the batch
        (its inputs or labels, or the data ran out), raised on every stage: none is left waiting in the schedule."""
        shapes = tuple((tuple(t.shape), str(t.dtype)) for t in inputs if isinstance(t, torch.Tensor))
        posts: list[Any] = [(shapes if self.pipe.is_first else None, refused)]
        if self.num_stages > 1:
            posts = [None] * self.num_stages
            dist.all_gather_object(
                posts, (shapes if self.pipe.is_first else None, refused), group=self.pipe.pp_comm.group
            )
        reasons = [reason for _, reason in posts if reason is not None]
        if _EXHAUSTED in reasons:
            raise StopIteration("the data iterator ran out on the first or the last stage")
        if reasons:
            raise ZeroshardError(reasons[0])
        return tuple(next(shape for shape, _ in posts if shape is not None))

    def _schedule(self, train: bool, gas: int, shapes: tuple[Any, ...] = ()) -> Any:
        key = (self.pipe.schedule, train, gas, shapes)  # a load into another dp changes gas: [Note: pipeline
        if key not in self._schedules:  # checkpoints]; other input shapes: [Note: pipeline input shapes]
            kept = (gas, self.gradient_accumulation_steps())  # (an eval_batch's own count keeps the training one)
            self._schedules = {k: v for k, v in self._schedules.items() if k[2] in kept}  # the old ones go
            while len(self._schedules) >= _KEPT_SCHEDULES:  # each holds receive buffers of its shapes
                del self._schedules[next(iter(self._schedules))]
            module, group = self.pipeline_module, self.pipe.pp_comm.group
            if self.pipe.schedule == "interleaved":  # [Note: interleaved chunks]
                total = self.num_stages * module.virtual_stages
                stages: list[Any] = [
                    _Stage(chunk, index, total, self.device, group=group)
                    for chunk, index in zip(module.chunk_modules(), module.local_chunks(), strict=True)
                ]
                schedule: Any = ScheduleInterleaved1F1B(stages, gas, loss_fn=self._micro_loss, scale_grads=False)
            else:
                stage = _Stage(module, self.stage_id, self.num_stages, self.device, group=group)
                # fewer micro-batches than stages: torch's Schedule1F1B refuses to be built (DeepSpeed's TrainSchedule
                # runs it); GPipe gives the same gradients, its activations held for at most that few micro-batches
                kind = "gpipe" if self.pipe.schedule == "1f1b" and gas < self.num_stages else self.pipe.schedule
                schedule = _SCHEDULES[kind](stage, gas, loss_fn=self._micro_loss, scale_grads=False)
            self._schedules[key] = schedule
        return self._schedules[key]

    def _micro_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        loss_fn = self.pipeline_module.loss_fn if self._compute_loss else None
        loss = loss_fn(output, self._labels[int(index.reshape(-1)[0])]) if loss_fn is not None else output
        self._micro_losses.append(_detached(loss))
        scale = self.loss_scale if self.loss_scaler is not None else 1.0
        scaled: torch.Tensor = loss / self.gradient_accumulation_steps()
        return scaled * scale if scale != 1.0 else scaled

    def _mean_outputs(self, count: int) -> torch.Tensor | None:
        """`eval_batch(compute_loss=False)`: the `count` micro-batches' outputs averaged element by element and over the
        replicas, on the last stage (DeepSpeed's `_reduce_outputs`); None elsewhere."""
        if not self.pipe.is_last:
            return None
        first = self._micro_losses[0]
        if isinstance(first, torch.Tensor):
            return self._replica_mean(torch.stack(self._micro_losses).sum(0) / count)
        return type(first)(  # a tuple of output tensors: each averaged
            self._replica_mean(torch.stack([out[i] for out in self._micro_losses]).sum(0) / count)
            for i in range(len(first))
        )

    def _replica_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.pipe.dp_comm.world_size > 1:
            self.pipe.dp_comm.all_reduce(tensor, label="pipe.outputs")
            tensor /= self.pipe.dp_comm.world_size
        return tensor

    def _aggregate_loss(self, count: int | None = None) -> torch.Tensor:
        """The mean loss over the `count` micro-batches (gradient_accumulation_steps) and the replicas, on every rank
        ([Note: pipeline step])."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.pipe.is_last:
            total = torch.stack([x.float() for x in self._micro_losses]).sum() / (
                count or self.gradient_accumulation_steps()
            )
            if self.pipe.dp_comm.world_size > 1:
                self.pipe.dp_comm.all_reduce(total, label="pipe.loss")
                total /= self.pipe.dp_comm.world_size
        self.pipe.pp_comm.broadcast(total, src=self.pipe.last_stage_rank, label="pipe.loss")
        return total


def _detached(value: Any) -> Any:
    """A micro-batch's loss, or its outputs (a tensor or a tuple of them) under `eval_batch(compute_loss=False)`."""
    if isinstance(value, tuple | list):
        return type(value)(_detached(v) for v in value)
    return value.detach() if isinstance(value, torch.Tensor) else value


def _last_micro_batch(outputs: Any, count: int) -> Any:
    """The rows of the last of `count` micro-batches in the schedule's merged outputs (a tensor or a tuple of them),
    which torch's schedule split and joined along dimension 0."""
    if isinstance(outputs, torch.Tensor):
        return outputs.tensor_split(count)[-1]
    if isinstance(outputs, tuple | list):
        return type(outputs)(_last_micro_batch(o, count) for o in outputs)
    return outputs


def _concat(parts: list[Any], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Micro-batches (a tensor or a tuple of tensors each) joined along the batch dimension; one batch's must agree
    in every other dimension (the schedule splits the joined tensor back: [Note: pipeline input shapes])."""
    columns = [[p] for p in parts] if isinstance(parts[0], torch.Tensor) else [list(p) for p in parts]
    for index in range(len(columns[0])):
        shapes = {tuple(c[index].shape[1:]) for c in columns if isinstance(c[index], torch.Tensor)}
        if len(shapes) > 1:
            raise ZeroshardError(
                f"the micro-batches of one train_batch/eval_batch have inputs of different shapes {sorted(shapes)} "
                "(beyond the batch dimension): torch's pipeline schedule splits one joined batch; pad the "
                "micro-batches of a batch to one length (batches may differ from one another)"
            )
    return tuple(torch.cat([c[i] for c in columns]).to(device) for i in range(len(columns[0])))


def _labels(labels: Any, device: torch.device) -> Any:
    """A micro-batch's labels as DeepSpeed's pipeline engine hands them to the loss function: a tensor on the device,
    a tuple or list as a tuple of tensors on the device (anything else in it is refused, as DeepSpeed asserts), and
    anything else (a dict, an int) unchanged."""
    if isinstance(labels, torch.Tensor):
        return labels.to(device)
    if isinstance(labels, (tuple, list)):
        if not all(isinstance(x, torch.Tensor) for x in labels):
            kinds = sorted({type(x).__name__ for x in labels if not isinstance(x, torch.Tensor)})
            raise ZeroshardError(
                f"a pipeline batch's labels are a {type(labels).__name__} holding {kinds}: tensors only"
            )
        return tuple(x.to(device) for x in labels)
    return labels


_EXHAUSTED = "the data iterator ran out"
_KEPT_SCHEDULES = 8  # schedules kept for reuse (train and eval, per input shapes)


class _Stage(PipelineStage):
    """torch's PipelineStage whose shape inference leaves the module's buffers as they were ([Note: the schedule's
    set-up forward])."""

    _kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            self._kept = [(buffer, buffer.clone()) for buffer in self.submod.buffers()]
        with inferring_shapes():  # the layers run without checkpoints there (pipe/module.py)
            return super()._prepare_forward_infra(*args, **kwargs)

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        if self._kept is not None:
            with torch.no_grad():
                for buffer, value in self._kept:
                    buffer.copy_(value)
            self._kept = None
        return super().forward_one_chunk(*args, **kwargs)
