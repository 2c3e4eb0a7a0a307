"""A backward the script runs itself: `loss.backward()`, or `engine.scale(loss).backward()` under fp16.

[Note: a backward the engine did not start]
DeepSpeed 0.18 made `loss.backward()` on an engine's output equivalent to `engine.backward(loss)` at ZeRO stages 1-3
("torch-style backward"): the gradient entering the engine's outputs is divided by gradient_accumulation_steps,
the gradients are reduced by the time the backward returns, `engine.step()` follows as usual; under fp16 the loss
must go through `engine.scale(loss)` first (it multiplies by the loss scale), or the backward is refused. zeroshard
does the same, at every stage and on both backends:
- `Engine.forward` puts a hook on each output that requires grad (`ManualBackward.watch`). In a backward no
  `engine.backward` started, the first of them begins the engine's backward (`strategy.begin_backward`) and asks
  autograd to end it when the whole backward is done (`queue_callback`: `strategy.finish_backward`, the micro-step
  counted as `engine.backward` counts it); each divides the gradient it sees by gradient_accumulation_steps.
- What a script's own backward skips of `engine.backward`: the wall-clock timers, the monitors' `train_loss`, the
  collective deadline's naming; a loss term made with `create_graph=True` (a gradient penalty) reaches the
  parameters through the double-backward graph, not the outputs, and is not divided: such a loss needs
  `engine.backward`. Refused with tensor parallelism's vocab-parallel loss (its backward must run inside
  `loss_parallel()`, which only `engine.backward` enters). A reentrant checkpoint around the whole engine runs its
  first forward without grad, so nothing is watched: it needs `engine.backward` too (its recompute, a forward
  inside a backward, is not watched either).
- A backward that accumulates into no parameter of the engine (`torch.autograd.grad(...)` for a gradient penalty,
  `backward(inputs=...)` without them) is no micro-step: its gradients pass through unchanged.
- Which backward `engine.backward` started is told by autograd's graph task id, which `engine.backward` registers
  from a hook on its loss (`EngineBackwards`, process-wide as DeepSpeed's tracker is: a generator's loss that one
  engine back-propagates through another engine's outputs, as in a GAN, is not the second engine's backward, and
  its gradients stay in `.grad` for that engine's step: [Note: gradients outside engine.backward]).
Before this, a plain `loss.backward()` left undivided gradients (stages 0-2: reduced at the step, 2e-4 relative off
DeepSpeed's parameters after two steps with accumulation 2) and failed at stage 3 with a second micro-step.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from zeroshard.errors import ZeroshardError


def _graph_task() -> int:
    return int(torch._C._current_graph_task_id())


def _first_accumulator(node: Any, limit: int = 100_000) -> Any:
    """The nearest node that accumulates into a leaf's `.grad` (AccumulateGrad) reachable from `node`, breadth first:
    after a loss, the last layer's weight a few nodes away, however deep the model."""
    queue: deque[Any] = deque([node])
    seen: set[int] = set()
    while queue and len(seen) < limit:
        current = queue.popleft()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if hasattr(current, "variable"):
            return current
        queue.extend(next_node for next_node, _ in current.next_functions)
    return None


def _accumulates(accumulator: Any) -> bool:
    """Whether the running backward accumulates into the parameters' `.grad` (`loss.backward()`), not a
    `torch.autograd.grad(...)` (a gradient penalty through the engine's outputs) or a `backward(inputs=...)` that
    leaves them out: those are no micro-step of the engine's."""
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError:  # autograd.grad with respect to parameters: torch cannot say, and it accumulates nothing
        return False


class EngineBackwards:
    """The autograd graph tasks some `engine.backward` is running (their ids, counted)."""

    def __init__(self) -> None:
        self._tasks: Counter[int] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def running(self, loss: torch.Tensor) -> Iterator[None]:
        """Around `loss.backward()` in `engine.backward`: its graph task is an engine's."""
        seen: list[int] = []

        def register(grad: torch.Tensor) -> torch.Tensor:
            task = _graph_task()
            with self._lock:
                self._tasks[task] += 1
            seen.append(task)
            return grad

        handle = loss.register_hook(register) if loss.requires_grad else None
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
            with self._lock:
                self._tasks.subtract(seen)
                self._tasks += Counter()  # drop the zeros

    def current(self) -> bool:
        """Whether the backward running this hook is one some `engine.backward` started."""
        with self._lock:
            return self._tasks[_graph_task()] > 0


ENGINE_BACKWARDS = EngineBackwards()  # process-wide: [Note: a backward the engine did not start]


class ManualBackward:
    """One engine's side of [Note: a backward the engine did not start]: `begin` and `end` are the engine's
    backward bookkeeping around the strategy's; `divisor` is gradient_accumulation_steps."""

    def __init__(
        self,
        begin: Callable[[], None],
        end: Callable[[], None],
        divisor: Callable[[], int],
        needs_scale: bool,
    ) -> None:
        self._begin, self._end, self._divisor = begin, end, divisor
        self.needs_scale = needs_scale  # fp16: the loss must come through engine.scale()
        self.scaled = False  # engine.scale() ran since the last manual backward began
        self.engine_backwards = 0  # this engine's engine.backward calls running (any graph task is then its own)
        self._task: int | None = None  # the manual backward under way

    def watch(self, output: Any) -> None:
        """Hook the outputs of a training forward that will be back-propagated."""
        if not torch.is_grad_enabled():
            return
        if _graph_task() != -1:  # a forward inside a backward: a reentrant checkpoint's recompute
            return
        flat, _ = tree_flatten(output)
        for tensor in flat:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                # a node of this output's graph that accumulates into a leaf's .grad, held while the graph lives
                accumulator = _first_accumulator(tensor.grad_fn)
                if accumulator is not None:
                    tensor.register_hook(functools.partial(self._on_grad, accumulator))

    def _on_grad(self, accumulator: Any, grad: torch.Tensor) -> torch.Tensor:
        if self.engine_backwards or ENGINE_BACKWARDS.current() or not _accumulates(accumulator):
            return grad
        task = _graph_task()
        if self._task != task:
            self._start(task)
        divisor = self._divisor()
        return grad / divisor if divisor != 1 else grad

    def _start(self, task: int) -> None:
        if self.needs_scale and not self.scaled:
            raise ZeroshardError(
                "loss.backward() on the engine's output without loss scaling under fp16: call engine.backward(loss), "
                "or engine.scale(loss).backward()"
            )
        self.scaled = False
        self._task = task
        self._begin()
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._task = None
        self._end()
