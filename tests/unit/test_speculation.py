"""[Note: undoing an Adam step] and the core split of [Note: speculative host steps], without a process group."""

from __future__ import annotations

import os

import pytest
import torch

from zeroshard.optim.adam import UncorrectedAdam
from zeroshard.optim.rollback import undo_adam_step, undoable_reason
from zeroshard.zero.stage3.speculate import keep_to_share, worker_cores

LR = 1e-2


def _optimizers(param: torch.nn.Parameter):
    yield torch.optim.AdamW([param], lr=LR, weight_decay=0.1, fused=True)
    yield torch.optim.AdamW([param], lr=LR, weight_decay=0.0, foreach=True)
    yield torch.optim.Adam([param], lr=LR, weight_decay=0.1)  # L2: the decay enters the moments
    yield UncorrectedAdam([param], lr=LR, weight_decay=0.1, adam_w_mode=True)
    yield UncorrectedAdam([param], lr=LR, weight_decay=0.1, adam_w_mode=False)


@pytest.mark.parametrize("which", range(5))
@pytest.mark.parametrize("history", [0, 4])
def test_an_undone_step_restores_the_state_to_within_rounding(which, history):
    """After `history` steps, one more step and its undo: parameters within a few float32 roundings of the larger
    of the parameter and its update (at most about 3 lr), moments within rounding of their scale, the step count
    back; from the first step the moments are exact zeros again."""
    torch.manual_seed(which)
    param = torch.nn.Parameter(torch.randn(10_000))
    optimizer = list(_optimizers(param))[which]
    for _ in range(history):
        param.grad = torch.randn(10_000)
        optimizer.step()
    before = param.detach().clone()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[param].items()}
    grad = torch.randn(10_000)
    param.grad = grad
    optimizer.step()
    assert not torch.equal(param.detach(), before)
    undo_adam_step(optimizer, [(param, grad)])
    after = optimizer.state[param]
    atol = 8 * 3.2 * LR * 2**-24  # an update is at most about 3.2 lr: (1 - beta1) / sqrt(1 - beta2) uncorrected
    torch.testing.assert_close(param.detach(), before, rtol=2.5e-7, atol=atol)
    assert int(after["step"]) == history
    if history == 0:
        assert not after["exp_avg"].any() and not after["exp_avg_sq"].any()
    else:
        for key in ("exp_avg", "exp_avg_sq"):
            scale = float(grad.abs().max()) ** (1 if key == "exp_avg" else 2)
            torch.testing.assert_close(after[key], state[key], rtol=0.0, atol=4 * scale * 2**-24)
        param.grad = grad  # the next step from the undone state is the step that was undone, to rounding
        optimizer.step()
        undo_adam_step(optimizer, [(param, grad)])
        torch.testing.assert_close(param.detach(), before, rtol=5e-7, atol=2 * atol)


def test_only_plain_adam_steps_can_be_undone():
    param = torch.nn.Parameter(torch.zeros(3))
    assert undoable_reason(torch.optim.AdamW([param])) is None
    assert undoable_reason(UncorrectedAdam([param])) is None
    assert "SGD" in str(undoable_reason(torch.optim.SGD([param], lr=0.1)))
    assert "amsgrad" in str(undoable_reason(torch.optim.AdamW([param], amsgrad=True)))
    assert "maximize" in str(undoable_reason(torch.optim.Adam([param], maximize=True)))


def test_the_worker_takes_its_share_of_this_ranks_cores():
    """cpuadam_cores_perc of the cores (rounded), at least one and one fewer than all; of this rank's slice when the
    node's ranks share a mask (too large for theirs to be disjoint)."""
    assert worker_cores(list(range(16)), 0.8, 0, 1, 16) == list(range(3, 16))
    assert worker_cores(list(range(10)), 0.8, 0, 1, 10) == list(range(2, 10))  # round(8.0), not int(7.99...)
    assert worker_cores([0, 1], 0.8, 0, 1, 2) == [1]
    assert worker_cores([0, 1], 1.0, 0, 1, 2) == [1]
    assert worker_cores([0, 1, 2, 3], 0.1, 0, 1, 4) == [3]
    assert worker_cores([5], 0.8, 0, 1, 8) == []
    assert worker_cores(list(range(16)), 0.75, 1, 2, 16) == list(range(10, 16))  # rank 1 of 2: cores 8-15
    assert worker_cores(list(range(8, 16)), 0.75, 1, 2, 16) == list(range(10, 16))  # already bound: as it is
    assert worker_cores(list(range(32)), 0.75, 3, 4, 64) == list(range(26, 32))  # 4 ranks in one 32-core cgroup


def test_only_the_calling_thread_keeps_to_its_share(monkeypatch):
    """What the worker thread does first on CUDA: its mask and intra-op thread count change, the main thread's
    do not (torch's count is per thread with OpenMP)."""
    import os
    import threading

    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    if len(cores) < 2:
        pytest.skip("one core: nothing to split")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    seen = {}

    def worker():
        seen["kept"] = keep_to_share(0.5, threads)
        seen["mask"], seen["threads"] = sorted(os.sched_getaffinity(0)), torch.get_num_threads()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    torch.set_num_threads(threads)  # threads started later take the process's default from the last setter
    assert seen["kept"] == seen["mask"] == worker_cores(cores, 0.5, 0, 1, os.cpu_count() or len(cores))
    assert seen["threads"] == min(len(seen["kept"]), threads)
    assert sorted(os.sched_getaffinity(0)) == cores and torch.get_num_threads() == threads


def test_a_host_step_waits_for_a_decoupled_saves_writes(monkeypatch):
    """[Note: decoupled checkpoint writes]: the step a sub-group takes during backward changes state a decoupled
    save's thread may still be writing; with a plain `loss.backward()` (no commit before it) it waits for the
    thread first."""
    import threading
    import time
    from types import SimpleNamespace

    import zeroshard.checkpoint.decoupled as decoupled
    from zeroshard.zero.stage3.speculate import SpeculativeSteps

    writer = threading.Thread(target=time.sleep, args=(0.3,))
    writer.start()
    monkeypatch.setattr(decoupled, "_PENDING", [SimpleNamespace(pid=os.getpid(), thread=writer)])
    steps = SpeculativeSteps.__new__(SpeculativeSteps)
    steps._group_of, steps._waiting = {7: 0}, {0: 1}
    steps.scale_of, steps._events = lambda: 1.0, lambda: ()
    submitted = []
    steps._submit = lambda job: submitted.append((job.k, writer.is_alive()))
    steps.delivered(SimpleNamespace(index=7), during_backward=True)
    assert submitted == [(0, False)]  # submitted after the writes, not while they ran
