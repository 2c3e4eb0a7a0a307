"""Offload: every offloaded configuration gives the same losses and parameters as without offload."""

from __future__ import annotations

import pytest
import torch
from test_parity import _check

from helpers.harness import run_on_ranks
from helpers.parity import Case, engine_run

CASES = [
    Case(stage=1, offload="cpu"),
    Case(stage=2, offload="cpu", gas=3),
    Case(stage=3, offload="cpu"),
    Case(stage=3, offload_param="cpu"),
    Case(stage=3, offload="cpu", offload_param="cpu", gas=3),
    Case(stage=2, offload="cpu", dtype="bf16"),
    Case(stage=3, offload="cpu", offload_param="cpu", dtype="bf16"),
    Case(stage=3, offload="nvme", sub_group=4000),  # several sub-groups: prefetch k+1, write k back
    Case(stage=3, offload="nvme", sub_group=4000, gas=3, dtype="bf16"),
    Case(stage=1, offload="nvme"),
    Case(stage=2, offload="nvme", gas=3),  # every param group read, stepped and written back in turn
    Case(stage=2, offload="nvme", dtype="bf16"),
    Case(stage=3, offload_param="nvme"),  # shards read back for every gather, written after every step
    Case(stage=3, offload="nvme", offload_param="nvme", sub_group=4000, gas=3),
    Case(stage=3, offload="cpu", offload_param="nvme", dtype="bf16", persistence=2000),
    # [Note: partial offload]: the later half of the sub-groups on the host, the others on the device
    Case(stage=3, offload="cpu", sub_group=4000, ratio=0.5),
    Case(stage=3, offload="cpu", offload_param="cpu", sub_group=1000, ratio=0.6, dtype="bf16", gas=3),
    Case(stage=3, offload="cpu", sub_group=1000, ratio=0.4, dtype="bf16"),  # host copies of bf16 gradients
    Case(stage=3, offload="cpu", offload_param="nvme", sub_group=1000, ratio=0.5),
]


def _run(rank: int, world_size: int, cases: list[Case]):
    return [engine_run(rank, world_size, case) for case in cases]


# a second spawn: variants whose tier, stage and dtype the other cases also combine
SLOW_CASES = [CASES[i] for i in (2, 3, 5, 8, 11, 17, 18)]


@pytest.mark.parametrize(
    "cases",
    [
        [c for c in CASES if c not in SLOW_CASES],
        pytest.param(SLOW_CASES, marks=pytest.mark.slow),
    ],  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
    ids=["default", "variants"],
)
def test_offload_parity_and_placement(cases: list[Case]):
    per_rank = run_on_ranks(_run, 2, cases)
    _check(cases, per_rank, 2)
    for i, case in enumerate(cases):
        report = per_rank[0][i][2]
        if case.offload == "nvme":  # between steps, master weights and optimizer state are on disk only
            assert report.optimizer_state == 0 and report.master_weights == 0, (case.name, report)
            assert report.host_optimizer_state == 0 and report.host_master_weights == 0, (case.name, report)
            psi_n = report.trainable_numel / 2
            shards = psi_n * (2 if case.dtype == "bf16" else 4) if case.offload_param == "nvme" else 0
            # stage 3 keeps the gradient shards there too (bf16 when they are reduced once per step)
            grads = psi_n * (2 if case.dtype == "bf16" and case.gas == 1 else 4) if case.stage == 3 else 0
            one = 4 * psi_n if case.dtype == "fp32" and case.offload_param == "nvme" else 0  # master is the shard
            expected = 12 * psi_n + shards + grads - one
            assert abs(report.nvme_bytes - expected) <= 0.05 * expected, (case.name, report)
            assert case.stage < 3 or report.gradients == 0, (case.name, report)
        if case.offload == "cpu" and case.ratio < 1.0:
            _check_partial_offload(case, report)
        elif case.offload == "cpu":  # the device tier holds no optimizer state or master weights
            assert report.optimizer_state == 0 and report.master_weights == 0, (case.name, report)
            psi_n = report.trainable_numel / 2
            assert abs(report.host_optimizer_state - 8 * psi_n) <= 0.02 * 8 * psi_n, (case.name, report)
            shared = case.offload_param == "cpu" and case.dtype == "fp32"  # one fp32 host shard is both
            master = report.host_params if shared else report.host_master_weights
            assert abs(master - 4 * psi_n) <= 0.02 * 4 * psi_n, (case.name, report)
        if case.offload_param == "cpu":
            assert report.params == 0 and report.host_params > 0, (case.name, report)
        if case.offload_param == "nvme":  # between uses, the compute shards are on disk only
            assert report.params == 0 and report.host_params == 0, (case.name, report)
            shard_bytes = report.trainable_numel / 2 * (2 if case.dtype == "bf16" else 4)
            grad_bytes = report.trainable_numel / 2 * (2 if case.dtype == "bf16" and case.gas == 1 else 4)
            state_bytes = 12 * report.trainable_numel / 2 + grad_bytes if case.offload == "nvme" else 0
            if case.offload == "nvme" and case.dtype == "fp32":
                state_bytes -= shard_bytes  # one fp32 file is both the master and the compute shard
            assert abs(report.nvme_bytes - shard_bytes - state_bytes) <= 0.05 * (shard_bytes + state_bytes), (
                case.name,
                report,
            )


def _check_partial_offload(case: Case, report) -> None:
    """Adam's 8 bytes per element split between the device and the host, each side with its own fp32 masters
    (4 bytes: half its state) and, on the host, the fp32 gradient copies made during backward (bf16 shards)."""
    psi_n = report.trainable_numel / 2
    device, host = report.optimizer_state, report.host_optimizer_state
    assert device > 0 and host > 0, (case.name, report)
    assert abs(device + host - 8 * psi_n) <= 0.02 * 8 * psi_n, (case.name, report)
    fp32 = case.dtype == "fp32"
    if fp32 and case.offload_param == "none":  # a device master is its fp32 compute shard: counted once, as params
        assert report.master_weights == 0, (case.name, report)
    else:
        assert report.master_weights == device / 2, (case.name, report)
    host_masters = report.host_params if fp32 and case.offload_param == "cpu" else report.host_master_weights
    assert host_masters == host / 2, (case.name, report)
    fp32_grads = fp32 or case.gas > 1  # the shard itself serves as the fp32 gradient (host and device are one here)
    assert report.host_gradients == (0 if fp32_grads else host / 2), (case.name, report)
    # after the step no gradient shard holds memory ([Note: gradient shards exist from reduction to step]): the
    # offloaded sub-groups' ones went when their host copies were made, the others' at the step
    assert report.gradients == 0, (case.name, report)


def _vm_hwm() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def _nvme_rss(rank: int, world_size: int, nvme_path: str, layers: int, width: int, params_on_nvme: bool):
    """Train `layers` x `width` for two steps (bf16, stage 3, AdamW state and masters on NVMe, optionally the
    compute shards too); returns (peak RSS before the model existed, peak RSS after, report, losses)."""
    import torch

    import zeroshard
    from zeroshard.models.gpt import GPT, GPTConfig

    def run(cfg: GPTConfig, sub_group: int):
        torch.manual_seed(0)
        with zeroshard.zero_init():  # no full copy of the model at any time
            model = GPT(cfg)
        offload = {"device": "nvme", "nvme_path": nvme_path}
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "sub_group_size": sub_group,
                "stage3_max_reuse_distance": 0,
                "stage3_prefetch_bucket_size": 1,
                "offload_optimizer": offload,
                "offload_param": {**offload, "buffer_count": 2} if params_on_nvme else {"device": "none"},
            },
        }
        engine, *_ = zeroshard.initialize(model=model, config=config)
        x = torch.randint(0, cfg.vocab_size, (1, 8))
        losses = []
        for _ in range(2):
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        report = engine.memory_report()
        engine.strategy.hooks.remove()  # not destroy(): that gathers the whole model on purpose
        engine.strategy.stepper.store.close()
        engine.strategy.stepper.param_store.close()
        return report, losses

    run(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False), 1000)  # warm-up
    before = _vm_hwm()
    report, losses = run(GPTConfig(vocab_size=8192, block_size=16, n_layer=layers, n_head=8, n_embd=width), 1)
    return before, _vm_hwm(), report, losses


@pytest.mark.slow  # ~85 s each: a model large enough that RSS measures the shards
def test_nvme_optimizer_offload_peak_rss_below_half_the_optimizer_state(tmp_path):
    """A 310M-parameter model, stage 3, bf16, AdamW; master weights and Adam moments (12 B/param, 3.5 GiB) on NVMe,
    and with them the gradient shards (as DeepSpeed's ZeRO-Infinity). What stays in memory: the bf16 compute shards
    (2 B/param), two sub-groups of optimizer state (one stepping, the next being read; sub-groups are whole units,
    150 MB each here), the gathered units, activations, and the interpreter with torch (~350 MiB).
    Measured: the process's peak RSS is 0.38 x the optimizer state (1.33 GiB)."""
    [(_, peak, report, losses)] = run_on_ranks(_nvme_rss, 1, str(tmp_path), 24, 1024, False, timeout=600)
    numel = report.trainable_numel
    state_bytes = 12 * numel
    assert numel >= 300_000_000
    assert abs(report.nvme_bytes - 14 * numel) <= 0.02 * 14 * numel, report  # + the bf16 gradient shards
    assert report.host_optimizer_state == 0 and report.gradients == 0, "still resident after the step"
    assert peak < 0.5 * state_bytes, f"peak RSS {peak / 2**20:.0f} MiB = {peak / state_bytes:.2f} x the state"
    assert losses[1] < losses[0], losses
    assert not any(tmp_path.iterdir()), "swap files must be removed when the stores close"


@pytest.mark.slow  # ~85 s each: a model large enough that RSS measures the shards
def test_zero_infinity_keeps_the_compute_shards_on_nvme_too(tmp_path):
    """The same model with the bf16 compute shards on NVMe as well (read ahead of each gather, written after each
    step): what remains is the working set. Measured: peak RSS 0.23 x the optimizer state (816 MiB)."""
    [(_, peak, report, losses)] = run_on_ranks(_nvme_rss, 1, str(tmp_path), 24, 1024, True, timeout=600)
    numel = report.trainable_numel
    state_bytes = 12 * numel
    assert abs(report.nvme_bytes - 16 * numel) <= 0.02 * 16 * numel, report
    assert report.host_params == 0 and report.params == 0, report
    assert peak < 0.3 * state_bytes, f"peak RSS {peak / 2**20:.0f} MiB = {peak / state_bytes:.2f} x the state"
    assert losses[1] < losses[0], losses
    assert not any(tmp_path.iterdir()), "swap files must be removed when the stores close"


def _bad_offload_inputs(rank: int, world_size: int, root: str):
    import os
    import shutil
    from collections import namedtuple

    import zeroshard
    from helpers.parity import Case, build_model, ds_config

    missing = os.path.join(root, "missing")
    readonly = os.path.join(root, "readonly")
    os.mkdir(readonly, mode=0o555)
    cases = {
        "param path missing": (3, {"offload_param": {"device": "nvme", "nvme_path": missing}}),
        "optimizer path missing": (2, {"offload_optimizer": {"device": "nvme", "nvme_path": missing}}),
        "param path read-only": (3, {"offload_param": {"device": "nvme", "nvme_path": readonly}}),
        "disk full": (3, {"offload_optimizer": {"device": "nvme", "nvme_path": root}}),
        "offload_optimizer with stage 0": (0, {"offload_optimizer": {"device": "cpu"}}),
        "unknown device": (3, {"offload_optimizer": {"device": "gpu"}}),
    }
    usage = namedtuple("usage", "total used free")
    real_usage = shutil.disk_usage
    errors = {}
    for name, (stage, zero) in cases.items():
        config = ds_config(Case(stage=stage))
        config["zero_optimization"].update(zero)
        if name == "disk full":
            shutil.disk_usage = lambda path: usage(1 << 40, (1 << 40) - 4096, 4096)  # type: ignore[assignment]
        try:
            zeroshard.initialize(model=build_model(Case(stage=stage)), config=config)
            errors[name] = None
        except zeroshard.ConfigError as err:
            errors[name] = str(err)
        finally:
            shutil.disk_usage = real_usage
    os.chmod(readonly, 0o755)
    return errors, sorted(os.listdir(root)), os.access(readonly, os.W_OK) and os.geteuid() == 0


def test_bad_offload_inputs_fail_before_training_and_leave_nothing(tmp_path):
    [(errors, left, root_user)] = run_on_ranks(_bad_offload_inputs, 1, str(tmp_path))
    expect = {
        "param path missing": ["zero_optimization.offload_param.nvme_path", "does not exist"],
        "optimizer path missing": ["zero_optimization.offload_optimizer.nvme_path", "does not exist"],
        "param path read-only": ["zero_optimization.offload_param.nvme_path", "not writable"],
        "disk full": ["zero_optimization.offload_optimizer.nvme_path", "free", "bytes"],
        "offload_optimizer with stage 0": ["offload_optimizer", "stage >= 1"],
        "unknown device": ["offload_optimizer.device", "gpu"],
    }
    for name, words in expect.items():
        if name == "param path read-only" and root_user:
            continue  # root writes to a 0555 directory; the unit tests cover a read-only mount
        assert errors[name] is not None, f"{name}: no error"
        assert all(w in errors[name] for w in words), (name, errors[name])
    assert left == ["readonly"], f"files left behind: {left}"


RESUME = [
    Case(stage=2, offload="nvme", gas=2, steps=4),
    Case(stage=3, offload="nvme", offload_param="nvme", sub_group=4000, gas=2, steps=4),
    Case(stage=3, offload="cpu", offload_param="nvme", dtype="bf16", steps=4),
]


def _nvme_checkpoint_resume(rank: int, world_size: int, root: str):
    import os

    import zeroshard
    from helpers.parity import build_model, ds_config, global_batches, micro_batch, param_groups

    def train(engine, case, batches):
        losses = []
        for batch in batches:
            for k in range(case.gas):
                loss = engine(*micro_batch(batch, k, rank, world_size, case.micro))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses

    def params(engine):
        return torch.cat([v.float().reshape(-1) for v in engine.module.state_dict().values()])

    out = []
    for i, case in enumerate(RESUME):
        batches = global_batches(case, world_size)
        runs = []
        for resumed in (False, True):
            torch.manual_seed(7 if resumed else 0)  # the resumed engine starts from other weights
            model = build_model(case)
            engine, *_ = zeroshard.initialize(
                model=model, model_parameters=param_groups(model, case), config=ds_config(case)
            )
            if resumed:  # after a step, so the load replaces optimizer state that is already on disk
                train(engine, case, batches[:1])
                engine.load_checkpoint(os.path.join(root, str(i)))
            else:
                train(engine, case, batches[:2])
                engine.save_checkpoint(os.path.join(root, str(i)))
            runs.append((train(engine, case, batches[2:]), params(engine), engine.memory_report().nvme_bytes))
            engine.destroy()
        out.append(runs)
    return out


def test_nvme_checkpoints_resume_bit_identically(tmp_path):
    """Checkpoints read the offloaded state from the swap files and a load writes it back there."""
    for per_case in run_on_ranks(_nvme_checkpoint_resume, 2, str(tmp_path)):
        for case, ((losses, params, disk), (resumed_losses, resumed_params, resumed_disk)) in zip(
            RESUME, per_case, strict=True
        ):
            assert resumed_losses == losses, case.name
            assert torch.equal(resumed_params, params), case.name
            assert resumed_disk == disk, f"{case.name}: the load left replaced state in the swap files"


def _nvme_parts(rank: int, world_size: int, root: str):
    import glob
    import os

    import zeroshard
    from helpers.parity import build_model, ds_config, global_batches, micro_batch, param_groups

    def params(engine):
        return torch.cat([v.float().reshape(-1) for v in engine.module.state_dict().values()])

    case = Case(stage=3, offload="nvme", offload_param="nvme", sub_group=1000, dtype="bf16", steps=2)
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    for batch in global_batches(case, world_size):
        engine.backward(engine(*micro_batch(batch, 0, rank, world_size, case.micro)))
        engine.step()
    resident_before = engine.memory_report()
    store, peak = engine.strategy.stepper.store, [0]
    fetch = store.fetch

    def fetch_and_measure(key: str) -> None:
        fetch(key)
        peak[0] = max(peak[0], store.resident_bytes)

    store.fetch = fetch_and_measure
    engine.save_checkpoint(os.path.join(root, "ckpt"), tag="t")
    largest = max(sum(e.nbytes) for k, e in store._entries.items() if k.startswith("subgroup"))
    resident_after = engine.memory_report()
    saved = params(engine)
    parts = len(engine.strategy.built.sub_groups)
    engine.destroy()
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(root, "ckpt", "t", "optim", f"rank{rank:05d}*")))
    plain = Case(stage=2, dtype="bf16")  # another stage, no offload: the parts are read as one rank's pieces
    model = build_model(plain)
    other, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, plain), config=ds_config(plain))
    other.load_checkpoint(os.path.join(root, "ckpt"), tag="t")
    loaded = params(other)
    other.destroy()
    return files, parts, saved, loaded, resident_before, resident_after, (peak[0], largest, store.disk_bytes)


def test_nvme_checkpoints_are_written_one_sub_group_at_a_time(tmp_path):
    """With state on NVMe a rank writes one file pair per optimizer sub-group, holding only that sub-group in
    memory ([Note: state parts]); another stage without offload loads them."""
    for files, parts, saved, loaded, before, after, (peak, largest, disk) in run_on_ranks(
        _nvme_parts, 2, str(tmp_path)
    ):
        assert parts > 2 and len(files) == parts, (parts, files)
        assert 0 < peak <= largest < disk / 2, (peak, largest, disk)  # one sub-group's state in memory at a time
        assert torch.equal(saved, loaded)
        for report in (before, after):  # nothing left in memory by the save
            assert report.host_optimizer_state == 0 and report.host_params == 0 and report.params == 0, report
