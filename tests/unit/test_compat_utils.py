"""DeepSpeed's helper names a script imports (`lr_schedules` constants, `get_mom`, `get_lr_ratio`, `OnDevice`, the
throughput timer's attributes, `utils.timer`, `runtime.utils.clip_grad_norm_` / `call_to_str`,
`zero_to_fp32.get_optim_files`, the `*_once` and JSON logging helpers), compared with DeepSpeed 0.19.8's own where
that is cheap. No process group: `clip_grad_norm_` over ranks is in tests/distributed/test_compat_engine.py."""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from helpers.config_checks import log  # noqa: F401  (fixture)
from helpers.deepspeed_reference import import_deepspeed


def test_lr_schedules_constants_equal_deepspeeds():
    from zeroshard.runtime import lr_schedules

    theirs = import_deepspeed("deepspeed.runtime.lr_schedules")
    names = [name for name in dir(theirs) if name.isupper()]
    assert len(names) >= 30 and "WARMUP_NUM_STEPS" in names and "CYCLE_MIN_MOM" in names
    assert {name: getattr(lr_schedules, name) for name in names} == {name: getattr(theirs, name) for name in names}
    assert set(names) <= set(lr_schedules.__all__)


@pytest.mark.parametrize(("decay_mom_rate", "decay_step_size"), [(0.0, 0), (0.001, 3)])
def test_one_cycle_get_mom_equals_deepspeeds(decay_mom_rate, decay_step_size):
    from zeroshard.runtime.lr_schedules import OneCycle

    theirs = import_deepspeed("deepspeed.runtime.lr_schedules").OneCycle
    params = dict(
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=4,
        decay_step_size=decay_step_size,
        decay_lr_rate=0.01,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=decay_mom_rate,
    )

    def moms(cls):
        opt = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.05)
        sched = cls(opt, **params)
        seen = [sched.get_mom()]
        for _ in range(12):  # through the cycle (8 steps) into the decay
            sched.step()
            seen.append(sched.get_mom())
        return seen

    ours = moms(OneCycle)
    assert ours == moms(theirs)  # the same arithmetic: equal to the bit
    assert ours[0] == [(0.9, 0.99)] and ours[4][0][0] == pytest.approx(0.8)
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert OneCycle(sgd, 0.01, 0.1).get_mom() is None  # no betas to cycle, as DeepSpeed's
    adam = torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    assert OneCycle(adam, 0.01, 0.1, cycle_momentum=False).get_mom() is None


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_get_lr_ratio_equals_deepspeeds(warmup_type):
    from zeroshard.runtime.lr_schedules import WarmupCosineLR

    theirs = import_deepspeed("deepspeed.runtime.lr_schedules").WarmupCosineLR

    def ratios(cls):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        sched = cls(opt, total_num_steps=12, warmup_num_steps=4, warmup_type=warmup_type, warmup_min_ratio=0.1)
        seen = [sched.get_lr_ratio()]
        for _ in range(15):
            sched.step()
            seen.append(sched.get_lr_ratio())
        return seen

    ours = ratios(WarmupCosineLR)
    assert ours[0] == 0.0 and ours == pytest.approx(ratios(theirs), rel=1e-12)


def test_on_device_builds_on_the_device_in_the_dtype_and_restores():
    import zeroshard
    from zeroshard.utils import OnDevice

    assert zeroshard.OnDevice is OnDevice
    before = torch.get_default_dtype()
    with OnDevice(dtype=torch.half, device="meta"):
        layer = torch.nn.Linear(4, 4)
        kept = torch.zeros(2, dtype=torch.float32, device="cpu")  # explicit arguments are kept
        index = torch.arange(3)
    assert {(p.device.type, p.dtype) for p in layer.parameters()} == {("meta", torch.half)}
    assert (kept.device.type, kept.dtype) == ("cpu", torch.float32)
    assert (index.device.type, index.dtype) == ("meta", torch.int64)  # integer tensors keep their dtype
    assert torch.get_default_dtype() == before and torch.empty(1).device.type == "cpu"

    with OnDevice(dtype=torch.bfloat16, device="cpu"):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.bfloat16
    with OnDevice(dtype=torch.half, device="meta", enabled=False):
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    with pytest.raises(KeyError), OnDevice(dtype=torch.half, device="meta"):
        raise KeyError("the block raised")
    assert torch.get_default_dtype() == before and torch.empty(1).device.type == "cpu"
    with pytest.raises(TypeError, match="floating-point"):
        OnDevice(dtype=torch.int8)


def test_on_device_gives_what_deepspeeds_gives_a_model():
    from zeroshard.utils import OnDevice

    theirs = import_deepspeed("deepspeed.utils.init_on_device").OnDevice

    def built(cls):
        with cls(dtype=torch.half, device="meta"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        return [(n, p.device.type, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]

    assert built(OnDevice) == built(theirs)


def _timer_sequence(timer) -> list:
    """DeepSpeed's TestSerialContext::test_throughput_calculation, on the timer alone (gas 6, start_step 2)."""
    out = [timer.initialized, timer.started, timer.start_step, timer.start_time, timer.micro_step_count]
    out += [timer.global_step_count, timer.total_elapsed_time, timer.avg_samples_per_sec()]
    timer.stop()
    out += [timer.initialized, timer.micro_step_count]
    timer.start()
    out += [timer.initialized, timer.started]
    timer.stop()
    out += [timer.initialized, timer.started, timer.micro_step_count, timer.global_step_count]
    while timer.micro_step_count < 6 * timer.start_step:
        timer.start()
        timer.stop(global_step=(timer.micro_step_count + 1) % 6 == 0)
    out += [timer.global_step_count, timer.total_elapsed_time]
    while timer.global_step_count == timer.start_step:
        timer.start()
        current, total = timer.step_elapsed_time, timer.total_elapsed_time
        boundary = (timer.micro_step_count + 1) % 6 == 0
        timer.stop(global_step=boundary)
        span = timer.end_time - timer.start_time
        assert timer.step_elapsed_time == (current + span if not boundary else 0)
        assert timer.total_elapsed_time == total + span
    out += [timer.global_step_count, timer.avg_samples_per_sec() > 0]
    timer.update_epoch_count()  # DeepSpeed-Chat calls it on the engine's timer at each epoch's end
    return out + [timer.epoch_count, timer.micro_step_count]


def test_throughput_timer_attributes_follow_deepspeeds():
    from zeroshard.monitor.throughput import ThroughputTimer

    ds_timer = import_deepspeed("deepspeed.utils.timer").ThroughputTimer
    config = SimpleNamespace(enabled=True, synchronized=False)
    ours = ThroughputTimer(enabled=True, synchronized=False, batch_size=84, steps_per_output=None)
    assert _timer_sequence(ours) == _timer_sequence(ds_timer(config, batch_size=84))


def test_engine_tput_timer_starts_at_forward():
    import zeroshard

    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    timer = engine.tput_timer
    assert (timer.initialized, timer.started, timer.avg_samples_per_sec()) == (False, False, -math.inf)
    loss = engine(torch.ones(2, 4)).sum()
    assert (timer.initialized, timer.started) == (True, True)
    engine.backward(loss)
    engine.step()
    assert (timer.started, timer.micro_step_count, timer.global_step_count) == (False, 1, 1)
    engine.destroy()


def test_synchronized_wall_clock_timer_as_deepspeeds(log):  # noqa: F811
    from zeroshard.utils.timer import SynchronizedWallClockTimer

    timers = SynchronizedWallClockTimer()
    timers("fwd").start()
    with pytest.raises(RuntimeError, match="already been started"):
        timers("fwd").start()
    assert timers("fwd").elapsed(reset=False) >= 0 and timers("fwd").started_  # a running timer keeps running
    timers("fwd").stop()
    with pytest.raises(RuntimeError, match="not started"):
        timers("fwd").stop()
    for _ in range(3):
        timers("bwd").start()
        timers("bwd").stop()
    means = timers.get_mean(["bwd", "missing"])
    assert list(means) == ["bwd"] and means["bwd"] >= 0 and len(timers("bwd").elapsed_records or []) == 3
    assert set(timers.get_timers()) == {"fwd", "bwd"}
    timers.log(["fwd", "bwd", "missing"], normalizer=2.0)
    lines = [r.getMessage() for r in log.records if "time (ms)" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("[Rank -1] time (ms) | fwd: ") and "| bwd: " in lines[0]
    assert timers("fwd").elapsed() == 0.0  # log reset them
    assert "mem_allocated:" in timers.memory_usage()


def test_utils_timer_throughput_timer_takes_deepspeeds_constructor():
    from zeroshard.utils import timer as timer_module

    ds_signature = import_deepspeed("deepspeed.utils.timer").ThroughputTimer.__init__
    import inspect

    ours = inspect.signature(timer_module.ThroughputTimer.__init__).parameters
    theirs = inspect.signature(ds_signature).parameters
    assert [(k, p.default) for k, p in ours.items()] == [(k, p.default) for k, p in theirs.items()]
    lines: list[str] = []
    config = SimpleNamespace(enabled=True, synchronized=False)
    timer = timer_module.ThroughputTimer(config, None, start_step=0, steps_per_output=1, logging_fn=lines.append)
    timer.update_epoch_count()
    for _ in range(2):
        timer.start()
        timer.stop(global_step=True)
    assert timer.batch_size == 1 and lines[0].startswith("epoch=1/micro_step=1/global_step=1, RunningAvg"), lines
    assert timer_module.STEP_GLOBAL_TIMER == "step" and timer_module.FORWARD_MICRO_TIMER == "fwd_microstep"


@pytest.mark.parametrize("norm_type", [2, 1, math.inf])
def test_clip_grad_norm_equals_torchs_on_one_process(norm_type):
    from zeroshard.runtime.utils import clip_grad_norm_

    def grads():
        torch.manual_seed(0)
        a, b, frozen = (torch.nn.Parameter(torch.randn(5)) for _ in range(3))
        (a * 3 + b.pow(2)).sum().backward()
        return [a, b, frozen]  # frozen has no gradient: left out, as in DeepSpeed

    ours, reference = grads(), grads()
    norm = clip_grad_norm_(ours, max_norm=0.5, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm=0.5, norm_type=norm_type)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for p, q in zip(ours[:2], reference[:2], strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert ours[2].grad is None
    big = clip_grad_norm_(ours[0], max_norm=1e6)  # a single tensor; under max_norm nothing changes
    torch.testing.assert_close(ours[0].grad, reference[0].grad)
    assert big.item() == pytest.approx(ours[0].grad.norm().item(), rel=1e-6)


def test_call_to_str_equals_deepspeeds():
    from zeroshard.runtime.utils import call_to_str

    theirs = import_deepspeed("deepspeed.runtime.utils").call_to_str
    for args, kwargs in [((), {}), ((1, "a"), {}), ((), {"bias": False}), ((4, [1]), {"p": 0.1, "name": "x"})]:
        assert call_to_str("Layer", *args, **kwargs) == theirs("Layer", *args, **kwargs)


def test_get_optim_files_lists_the_optimizer_shards_in_natural_order(tmp_path):
    from zeroshard.checkpoint.format import model_file, optim_file
    from zeroshard.utils.zero_to_fp32 import get_optim_files

    tag = tmp_path / "global_step3"
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        get_optim_files(str(tag))
    (tag / "optim").mkdir(parents=True)
    (tag / "model").mkdir()
    with pytest.raises(FileNotFoundError, match="can't find"):
        get_optim_files(str(tag))
    names = [optim_file(10), optim_file(2), optim_file(2, ".part00001"), optim_file(2, ".part00000"), model_file(0)]
    for name in names:
        (tag / name).write_bytes(b"")
    listed = [p.removeprefix(str(tag) + "/") for p in get_optim_files(str(tag))]
    natural_keys = import_deepspeed("deepspeed.utils.zero_to_fp32").natural_keys
    assert listed == sorted(names[:4], key=natural_keys)  # DeepSpeed's order: rank 2's files, then rank 10's
    assert listed[-1] == optim_file(10)


def test_logging_once_and_json_helpers(log, tmp_path):  # noqa: F811
    from zeroshard.utils import logger
    from zeroshard.utils.logging import log_dist_once, print_json_dist, warning_once

    logger.warning_once("compat-test: said once %d", 1)
    warning_once("compat-test: said once %d", 1)
    logger.warning_once("compat-test: said once %d", 2)  # other arguments: a new message
    log_dist_once("compat-test: dist once", ranks=[0])
    logger.log_dist_once("compat-test: dist once", ranks=[0])
    messages = [r.getMessage() for r in log.records if "compat-test" in r.getMessage()]
    assert messages == ["compat-test: said once 1", "compat-test: said once 2", "[Rank -1] compat-test: dist once"]
    assert [r.levelno for r in log.records if "said once" in r.getMessage()] == [logging.WARNING] * 2

    path = tmp_path / "metrics.json"
    print_json_dist({"loss": 1.5}, ranks=[0], path=str(path))  # before torch.distributed: every process writes
    assert json.loads(path.read_text()) == {"loss": 1.5, "rank": -1}
    with pytest.raises(TypeError, match="path="):
        print_json_dist({"loss": 1.5})
