"""`offload_optimizer.super_offload`: offloaded sub-groups stepped during backward ([Note: speculative host steps]),
bit-identical to stepping after backward when the step is taken, stepped back when it is skipped."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import weakref

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case


def _config(case: Case, super_offload: bool, grad_dtype: str | None) -> dict:
    from helpers.parity import ds_config

    config = ds_config(case)
    config["zero_optimization"]["offload_optimizer"]["super_offload"] = super_offload
    if grad_dtype is not None:  # on CPU only a dtype change makes a separate host copy (fp32: the shard serves)
        config["data_types"] = {"grad_accum_dtype": grad_dtype}
    return config


def _train(case: Case, super_offload: bool, grad_dtype: str | None, rank: int, world_size: int, poison=None):
    import zeroshard
    from helpers.parity import build_model, global_batches, micro_batch, param_groups
    from zeroshard.utils import safe_get_full_grad

    model = build_model(case)
    config = _config(case, super_offload, grad_dtype)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    losses, params, grads = [], [], []
    for step, batch in enumerate(global_batches(case, world_size)):
        for k in range(case.gas):
            x, y = micro_batch(batch, k, rank, world_size, case.micro)
            handle = poison(model, rank) if poison is not None and step == 2 else None
            loss = engine(x, y)
            engine.backward(loss)
            if handle is not None:
                handle.remove()
            if step == 1 and k == case.gas - 1:  # before the step: the speculated copies are scaled already
                grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
            engine.step()
            losses.append(loss.item())
        params.append(torch.cat([v.float().reshape(-1) for v in engine.module.state_dict().values()]))
    speculation = engine.strategy.speculation
    counts = (0, 0, 0)
    if speculation is not None:
        counts = (speculation.steps_taken, speculation.steps_undone, speculation.taken_during_backward)
    sub_groups = sum(g.tier.offloaded for g in engine.strategy.built.sub_groups)
    out = (losses, params, grads, counts, sub_groups, engine.skipped_steps)
    engine.destroy()
    return out


# (case, grad dtype, sub-groups submitted to the worker while autograd still runs, per step; None: not counted):
# fp32 gradients (the shard is its own host copy), bf16 ones (separate copies). With 6 blocks of 6.2K shard
# elements, the sub-groups that wait for backward's end are the root unit's (with block 0, and at 13K block 1), the
# one holding block 1 (the last reductions are still in flight when autograd returns) and the persistent unit's, in
# one of its own.
_CASES = (
    (Case(stage=3, offload="cpu", clip=0.0, sub_group=3000, steps=4), None, None),
    (Case(stage=3, offload="cpu", clip=0.0, sub_group=3000, steps=3, dtype="bf16"), "bf16", None),
    (Case(stage=3, offload="cpu", clip=0.0, sub_group=3000, steps=3, ratio=0.5), None, None),
    (Case(stage=3, offload="cpu", clip=0.0, sub_group=3000, steps=3, gas=2, variant="deep", persistence=100), None, 4),
    (Case(stage=3, offload="cpu", clip=0.0, sub_group=3000, steps=2, variant="deep", dtype="bf16"), "bf16", 4),
    (Case(stage=3, offload="cpu", clip=0.0, sub_group=13000, steps=2, variant="deep", persistence=100), None, 2),
)


def _bit_identical(rank: int, world_size: int):
    return [
        (_train(case, True, dtype, rank, world_size), _train(case, False, dtype, rank, world_size))
        for case, dtype, _ in _CASES
    ]


def test_steps_during_backward_are_bit_identical():
    """Every case: the host stepped every offloaded sub-group by the time backward returned, every step (with 6
    blocks, the number given submitted while autograd still ran), and losses, parameters after every step and
    `safe_get_full_grad` before a step equal the run without super_offload bit for bit."""
    for per_rank in run_on_ranks(_bit_identical, 2):
        for (case, _, during), (fast, plain) in zip(_CASES, per_rank, strict=True):
            losses, params, grads, (taken, undone, early), sub_groups, skipped = fast
            assert sub_groups >= (2 if case.ratio == 1.0 else 1), case
            assert taken == sub_groups * case.steps and undone == 0 and skipped == 0, case
            if during is not None:
                assert early == during * case.steps, (case, early, sub_groups)
            assert losses == plain[0], case
            assert all(torch.equal(a, b) for a, b in zip(params, plain[1], strict=True)), case
            assert all(torch.equal(a, b) for a, b in zip(grads, plain[2], strict=True)), case
            assert plain[3] == (0, 0, 0)


def _poison(model, rank):
    """On rank 1, an inf into the gradient of the first block's output: the units behind it (in backward order)
    were stepped by then, so the step is skipped and those steps are undone on both ranks."""
    if rank != 1:
        return None

    def hook(module, inputs, output):
        output.register_hook(lambda g: g * math.inf)

    return model.blocks[0].register_forward_hook(hook)


def _skipped(rank: int, world_size: int):
    case = Case(stage=3, offload="cpu", clip=0.0, sub_group=3000, steps=5)
    return _train(case, True, None, rank, world_size, _poison), _train(case, False, None, rank, world_size, _poison)


def test_a_skipped_step_is_undone():
    """A non-finite gradient on one rank skips the step (stage 3 skips a non-finite norm): the sub-groups stepped
    during that backward are stepped back, to within float32 rounding of the run that never stepped them."""
    for (losses, params, _, (taken, undone, _), sub_groups, skipped), plain in run_on_ranks(_skipped, 2):
        assert skipped == plain[5] == 1
        assert undone >= 1 and taken == sub_groups * 5 - (sub_groups - undone)
        assert losses[:3] == plain[0][:3]
        assert all(torch.equal(a, b) for a, b in zip(params[:2], plain[1][:2], strict=True))
        for a, b in zip(params[2:], plain[1][2:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert max(abs(x - y) for x, y in zip(losses, plain[0], strict=True)) < 1e-4


def _refusals(rank: int, world_size: int):
    import zeroshard
    from helpers.parity import build_model, global_batches, micro_batch, param_groups
    from zeroshard.errors import ConfigError, ZeroshardError

    out = {}
    case = Case(stage=3, offload="cpu", clip=0.0, sub_group=3000, steps=2)
    (x, y), _ = [micro_batch(b, 0, rank, world_size, case.micro) for b in global_batches(case, world_size)]
    model = build_model(case)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=param_groups(model, case), config=_config(case, True, None)
    )
    engine.backward(engine(x, y))
    threads = {t.name for t in threading.enumerate()}
    out["worker"] = "zeroshard-super-offload" in threads
    try:
        engine.backward(engine(x, y))
    except ZeroshardError as error:
        out["second backward"] = str(error)
    out["setters"] = _setters_refused(engine)
    before = engine.strategy.speculation.steps_undone
    engine.zero_grad()  # gradients dropped without a step: what backward stepped is undone
    out["undone by zero_grad"] = engine.strategy.speculation.steps_undone - before
    engine.backward(engine(x, y))  # allowed again
    engine.step()
    folder = os.path.join(tempfile.gettempdir(), f"zeroshard-super-offload-{os.getppid()}")  # the same on both ranks
    engine.save_checkpoint(folder, tag="good")
    stepper = engine.strategy.stepper

    def fails(*args, **kwargs):
        raise RuntimeError("injected")

    if rank == 1:  # the worker's next step fails, on one rank: every rank raises as backward ends
        stepper.step_sub_group = fails
    for call in (lambda: engine.backward(engine(x, y)), engine.step, lambda: engine.backward(engine(x, y))):
        try:
            call()
        except ZeroshardError as error:
            out.setdefault("after a failure", []).append(str(error))
    if rank == 1:
        del stepper.step_sub_group
    engine.load_checkpoint(folder, tag="good")  # forgets the failure, with the state it doubted
    engine.backward(engine(x, y))
    engine.step()
    out["after the load"] = engine.strategy.speculation.steps_taken
    # a load between backward and step drops the window: what backward stepped is stepped back first (a module-only
    # load keeps the optimizer state, which held that step)
    from zeroshard.utils import safe_get_full_optimizer_state

    param = next(p for p in engine.module.parameters() if p.requires_grad)
    moments = safe_get_full_optimizer_state(param, "exp_avg")
    engine.backward(engine(x, y))
    stepped = (safe_get_full_optimizer_state(param, "exp_avg") - moments).abs().max().item()
    undone = engine.strategy.speculation.steps_undone
    engine.load_checkpoint(folder, tag="good", load_module_only=True)
    out["undone by a load"] = engine.strategy.speculation.steps_undone - undone
    out["moments back"] = (stepped, (safe_get_full_optimizer_state(param, "exp_avg") - moments).abs().max().item())
    if rank == 0:  # both ranks loaded: the step after it has collectives
        shutil.rmtree(folder)

    # every gradient inf/nan: no rank steps anything during backward, and the refusals hold all the same (decided
    # by what arrived, the same on every rank, not by what this rank stepped: else one rank raises while another
    # goes on into the step's collectives)
    def infinite(module, inputs, loss):
        loss.register_hook(lambda g: g * math.inf)

    handle = model.register_forward_hook(infinite)
    engine.backward(engine(x, y))
    handle.remove()
    out["stepped with inf"] = list(engine.strategy.speculation.stepped)
    try:
        engine.backward(engine(x, y))
    except ZeroshardError as error:
        out["second backward with inf"] = str(error)
    out["setters with inf"] = _setters_refused(engine)
    engine.step()
    out["skipped with inf"] = engine.skipped_steps
    worker = next(t for t in threading.enumerate() if t.name == "zeroshard-super-offload")
    out["holds only a weak reference"] = isinstance(worker._args[0], weakref.ref)  # type: ignore[attr-defined]
    engine.destroy()
    worker.join(10)
    out["stopped by destroy"] = not worker.is_alive()

    clipped = Case(stage=3, offload="cpu", clip=1.0, sub_group=3000)
    model = build_model(clipped)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=param_groups(model, clipped), config=_config(clipped, True, None)
    )
    out["with clipping"] = engine.strategy.speculation
    engine.destroy()

    model = build_model(case)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    config = _config(case, True, None)
    del config["optimizer"]
    try:
        zeroshard.initialize(model=model, optimizer=sgd, config=config)
    except ConfigError as error:
        out["client SGD"] = str(error)
    return out


def _gathered_write(param) -> None:
    import zeroshard

    with zeroshard.GatheredParameters([param], modifier_rank=0), torch.no_grad():
        param.fill_(0.5)


def _setters_refused(engine) -> list[str]:
    """DeepSpeed's setters between the boundary's backward and the step: each refused in one line."""
    from zeroshard.errors import ZeroshardError
    from zeroshard.utils import (
        safe_get_full_fp32_param,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_grad,
    )

    param = next(p for p in engine.module.parameters() if p.requires_grad)
    full, local = safe_get_full_fp32_param(param), safe_get_local_fp32_param(param)
    calls = (
        lambda: safe_set_full_grad(param, torch.zeros_like(full)),
        lambda: safe_set_full_fp32_param(param, full),
        lambda: safe_set_full_optimizer_state(param, torch.zeros_like(full), "exp_avg"),
        lambda: safe_set_local_grad(param, torch.zeros_like(local)),
        lambda: safe_set_local_fp32_param(param, local),
        lambda: _gathered_write(param),
    )
    refused = []
    calls += (lambda: engine.optimizer.load_state_dict(engine.optimizer.state_dict()),)
    for call in calls:
        try:
            call()
        except ZeroshardError as error:
            refused.append(str(error))
    return refused


def test_what_super_offload_refuses():
    """A second backward before the step, and DeepSpeed's setters, are refused (the update was taken already), on
    every rank alike, also when no rank stepped anything (every gradient inf);
    zero_grad without a step undoes what backward stepped; the worker thread refers to its engine weakly (an
    engine dropped without destroy() is not kept alive by it) and ends with destroy(); a failure on the worker is
    raised as backward ends and every later call refuses until a checkpoint is loaded; with clipping nothing is
    speculated (DeepSpeed's behaviour); an optimizer whose step cannot be undone is refused before training."""
    outs = run_on_ranks(_refusals, 2)
    for out in outs:
        assert "second backward before engine.step()" in out["second backward"]
        for key in ("setters", "setters with inf"):  # every setter, in one line naming it
            assert len(out[key]) == 7 and all("between backward and engine.step()" in m for m in out[key]), out[key]
            assert [m.split()[0] for m in out[key]] == [
                "safe_set_full_grad",
                "safe_set_full_fp32_param",
                "safe_set_full_optimizer_state",
                "safe_set_local_grad",
                "safe_set_local_fp32_param",
                "GatheredParameters(modifier_rank=0)",
                "engine.optimizer.load_state_dict",
            ]
        assert out["stepped with inf"] == [] and "second backward" in out["second backward with inf"]
        assert out["skipped with inf"] == 1
        assert out["undone by zero_grad"] >= 2
        assert out["worker"] and out["holds only a weak reference"] and out["stopped by destroy"]
    for rank, out in enumerate(outs):
        failures = out["after a failure"]  # raised as backward ends, then refused until a checkpoint is loaded
        assert len(failures) == 3 and all("load the last checkpoint" in f for f in failures), failures
        assert ("injected" if rank == 1 else "failed on rank(s) [1]") in failures[0], failures
        assert out["after the load"] > 0
        assert out["undone by a load"] >= 2
        stepped, left = out["moments back"]
        assert stepped > 1e-4 and left < 1e-7 * max(1.0, stepped), out["moments back"]
        assert out["with clipping"] is None
        assert "super_offload" in out["client SGD"] and "SGD" in out["client SGD"]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage 3"),
        ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}, '"cpu"'),
        ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}, "offload_param"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "'SGD'"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "amsgrad": True}}}, "amsgrad"),
        ({"zero_optimization": {"offload_optimizer": {"cpuadam_cores_perc": 0.0}}}, "cpuadam_cores_perc"),
    ],
)
def test_super_offload_config_refusals(change, needle):
    from zeroshard.config import parse_config
    from zeroshard.errors import ConfigError

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default, 1.0, leaves nothing to speculate on
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}},
    }
    for key, value in change.items():
        if key == "zero_optimization":
            for sub, val in value.items():
                if isinstance(val, dict):
                    config[key].setdefault(sub, {}).update(val)
                else:
                    config[key][sub] = val
        else:
            config[key] = value
    with pytest.raises(ConfigError, match="super_offload") as error:
        parse_config(config)
    assert needle in str(error.value)


def test_with_clipping_any_optimizer_goes():
    """With gradient clipping (DeepSpeed's default 1.0) super_offload speculates on nothing, so undoes nothing."""
    from zeroshard.config import parse_config

    parse_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}},
        }
    )
