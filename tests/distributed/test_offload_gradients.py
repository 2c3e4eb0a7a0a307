"""Gradients on their way to a host optimizer: copied to the host as each reduction is final on the accumulation
boundary ([Note: gradients to the host during backward]), then released from the device at stage 3 ([Note: a
gradient shard leaves once its host copy holds it]), with results bit-identical to the run without offload."""

from __future__ import annotations

import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case


def _host_copies(rank: int, world_size: int):
    import zeroshard
    from helpers.parity import build_model, ds_config, global_batches, micro_batch, param_groups

    out = {}
    for stage in (1, 2, 3):
        runs = []
        for offload in ("cpu", "none"):
            case = Case(stage=stage, offload=offload, dtype="bf16", gas=2, steps=3, bucket=3000)
            model = build_model(case)
            config = ds_config(case)
            config["data_types"] = {"grad_accum_dtype": "bf16"}  # on CPU only a dtype change needs a host copy
            engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
            losses = []
            for batch in global_batches(case, world_size):
                for k in range(case.gas):
                    loss = engine(*micro_batch(batch, k, rank, world_size, case.micro))
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
            params = torch.cat([v.float().reshape(-1) for v in engine.module.state_dict().values()])
            copies = len(engine.strategy.units) if stage == 3 else len(engine.strategy.buffers)  # per unit / per group
            runs.append((engine.strategy.host_copies_in_backward, copies, case.steps, losses, params))
            engine.destroy()
        out[stage] = runs
    return out


def test_offloaded_gradients_reach_the_host_during_backward():
    """bf16 gradient shards, fp32 host copies (on CUDA: device shards, pinned host copies): in the boundary
    micro-step's backward, stages 1-2 copy bucket by bucket and stage 3 unit by unit, none at the step; results equal
    the run without offload bit for bit."""
    for per_stage in run_on_ranks(_host_copies, 2):
        for stage, (
            (copied, groups, steps, losses, params),
            (_, _, _, plain_losses, plain_params),
        ) in per_stage.items():
            assert copied == groups * steps, (stage, copied, groups, steps)
            assert losses == plain_losses and torch.equal(params, plain_params), stage


def _shards_after_copy(rank: int, world_size: int):
    import zeroshard
    from helpers.parity import build_model, ds_config, global_batches, micro_batch, param_groups
    from zeroshard.utils import safe_get_full_grad

    out = {}
    for gas, placements in ((1, ("cpu", "none", "partial")), (2, ("cpu", "none"))):
        runs = {}
        for placement in placements:
            offload, ratio = ("none", 1.0) if placement == "none" else ("cpu", 0.5 if placement == "partial" else 1.0)
            case = Case(stage=3, offload=offload, ratio=ratio, sub_group=4000, dtype="bf16", gas=gas, steps=4)
            model = build_model(case)
            config = ds_config(case)
            config["data_types"] = {"grad_accum_dtype": "bf16"}  # on CPU only a dtype change needs a host copy
            engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
            losses, norms, reports, full_grads, restores = [], [], [], [], []
            for step, batch in enumerate(global_batches(case, world_size)):
                for k in range(gas):
                    x, y = micro_batch(batch, k, rank, world_size, case.micro)
                    loss = engine(x, y)
                    engine.backward(loss)
                    if step == 2 and k == gas - 1:  # a second backward into the window: the shards come back
                        engine.backward(engine(x, y))
                    reports.append(engine.memory_report())
                    if step == 1 and k == gas - 1:  # read before the step: from the host copies, left released
                        full_grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
                        reports[-1] = engine.memory_report()
                    engine.step()
                    losses.append(loss.item())
                norms.append(engine.get_global_grad_norm())
                restores.append(sum(u.grad_restores for u in engine.strategy.units))
            params = torch.cat([v.float().reshape(-1) for v in engine.module.state_dict().values()])
            runs[placement] = (losses, norms, params, full_grads, reports, restores, engine.strategy.trainable_numel)
            engine.destroy()
        out[gas] = runs
    return out


def test_offloaded_gradient_shards_leave_the_device_once_copied():
    """[Note: a gradient shard leaves once its host copy holds it]: with the optimizer on the host, stage 3's bf16
    gradient shards are gone from the device once the boundary's host copies are made (with accumulation they
    collect the earlier micro-steps there; with partial offload only the offloaded sub-groups' go), the step reads
    neither them nor a read-back (the norm comes from the boundary's records), a gradient read before the step comes
    from the copies, a second backward into the window reads them back, and all of it equals the run without
    offload bit for bit."""
    for per_gas in run_on_ranks(_shards_after_copy, 2):
        for gas, runs in per_gas.items():
            plain = runs["none"]
            for placement, (losses, norms, params, full_grads, reports, restores, numel) in runs.items():
                assert losses == plain[0] and norms == plain[1] and torch.equal(params, plain[2]), (gas, placement)
                assert all(torch.equal(a, b) for a, b in zip(full_grads, plain[3], strict=True)), (gas, placement)
                psi_n = numel / 2  # elements of this rank's shards (padding aside)
                for k, report in enumerate(reports):
                    boundary = (k + 1) % gas == 0
                    if placement == "none" or not boundary:  # bf16 shards held until the step or the copy
                        assert _near(report.gradients, 2 * psi_n), (gas, placement, k, report)
                    elif placement == "cpu":
                        assert report.gradients == 0, (gas, placement, k, report)
                    elif k > 0:  # the device sub-groups' shards only (Adam: 8 bytes per element; bf16: 2)
                        assert 0 < report.gradients < 2 * psi_n, (gas, placement, k, report)
                        assert _near(report.gradients, report.optimizer_state / 4), (gas, placement, k, report)
                # read back only for the second backward of step 2, never by the step or the gradient read
                if placement != "none":
                    assert restores[:2] == [0, 0] and restores[2] > 0 and restores[3] == restores[2], (gas, restores)


def _near(measured: float, expected: float) -> bool:
    """Within the flat buffers' padding."""
    return abs(measured - expected) <= 0.02 * expected
