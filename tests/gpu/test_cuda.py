"""The GPU suite (issue 13): the parity, offload, fp16, checkpoint and stage-3 feature cases on CUDA with NCCL.

    make test-gpu          # python -m pytest tests/gpu -m cuda

Every case runs at world size 1, and also at 2 on a machine with two or more GPUs (NCCL needs one device per
rank). The reference is the same single-process PyTorch run as on the CPU (tests/helpers/parity.py), on the same
GPU, with the CPU suite's tolerances ([Note: bf16 tolerance] in tests/distributed/test_parity.py). Without CUDA
every test here is skipped (the `cuda` marker, tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import (
    Case,
    build_model,
    ds_config,
    engine_run,
    global_batches,
    micro_batch,
    param_groups,
    reference_run,
    relative_difference,
)

pytestmark = pytest.mark.cuda

WORLD_SIZES = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]
TOL = {"fp32": (1e-6, 1e-6), "bf16": (1e-2, 1e-2)}

PARITY = [Case(stage=s, dtype=d, gas=g) for s in (0, 1, 2, 3) for d in ("fp32", "bf16") for g in (1, 3)] + [
    Case(stage=3, persistence=2000),
    Case(stage=3, reuse=10**9, prefetch=10**9),
    Case(stage=3, max_live=3000),
    Case(stage=3, variant="twice"),
    Case(stage=2, variant="frozen"),
    Case(stage=3, variant="mostly_frozen", gas=3),  # two sections per block unit ([Note: frozen parameters at stage 3])
]
OFFLOAD = [
    Case(stage=1, offload="cpu"),
    Case(stage=2, offload="cpu", gas=3),
    Case(stage=3, offload="cpu", dtype="bf16"),
    Case(stage=3, offload="cpu", offload_param="cpu"),
    Case(stage=3, variant="mostly_frozen", offload="cpu", offload_param="cpu"),  # both sections' copies, side stream
    Case(stage=2, offload="nvme", gas=3),
    Case(stage=3, offload="nvme", sub_group=4000),
    Case(stage=3, offload="nvme", offload_param="nvme", sub_group=4000, gas=3),
    # [Note: partial offload]: one fused AdamW over masters on the GPU and on the host
    Case(stage=3, offload="cpu", sub_group=1000, ratio=0.5, dtype="bf16"),
    Case(stage=3, offload="cpu", offload_param="cpu", sub_group=1000, ratio=0.6, gas=3),
    # GPU masters published into pinned bf16 host shards (cast on the GPU, asynchronous), and into NVMe-homed ones
    Case(stage=3, offload="cpu", offload_param="cpu", sub_group=1000, ratio=0.4, dtype="bf16"),
    Case(stage=3, offload="cpu", offload_param="nvme", sub_group=1000, ratio=0.5, dtype="bf16"),
]


def _on_cuda(rank: int, world_size: int, cases: list[Case]):
    assert torch.cuda.is_available()
    out = [engine_run(rank, world_size, case) for case in cases]
    assert torch.distributed.get_backend() == "nccl"
    references = [reference_run(case, world_size, device=f"cuda:{rank}") for case in cases] if rank == 0 else []
    return [(losses, params) for losses, params, _ in out], references


def _check(cases: list[Case], results, tol: tuple[float, float] | None = None) -> None:
    per_rank, references = [r[0] for r in results], results[0][1]
    world_size = len(per_rank)
    failures = []
    for i, case in enumerate(cases):
        ref_losses, ref_params = references[i]
        loss_tol, param_tol = tol or TOL[case.dtype]
        for step in range(case.steps):
            loss = sum(per_rank[r][i][0][step] for r in range(world_size)) / world_size
            rel = abs(loss - ref_losses[step]) / abs(ref_losses[step])
            if rel > loss_tol:
                failures.append(f"{case.name} step {step}: loss {loss!r} vs reference {ref_losses[step]!r} ({rel:.1e})")
            p_rel = relative_difference(per_rank[0][i][1][step], ref_params[step])
            if p_rel > param_tol:
                failures.append(f"{case.name} step {step}: params rel diff {p_rel:.1e}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parity_on_cuda(world_size: int) -> None:
    _check(PARITY, run_on_ranks(_on_cuda, world_size, PARITY))


def _compile(engine) -> None:
    engine.compile()  # the default backend, inductor: Triton kernels


def _compiled_on_cuda(rank: int, world_size: int, cases: list[Case]):
    out = [engine_run(rank, world_size, case, None, _compile) for case in cases]
    references = [reference_run(case, world_size, device=f"cuda:{rank}") for case in cases] if rank == 0 else []
    return [(losses, params) for losses, params, _ in out], references


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_compiled_engine_on_cuda(world_size: int) -> None:
    """`engine.compile()` with inductor on the GPU, stage 3's hooks eager between compiled units ([Note: hooks under
    torch.compile]); fused kernels round differently: 1e-5 (tests/distributed/test_compile.py on the CPU)."""
    cases = [Case(stage=2, steps=4), Case(stage=3, steps=4), Case(stage=3, dtype="bf16", steps=4)]
    results = run_on_ranks(_compiled_on_cuda, world_size, cases)
    _check(cases[:2], [(r[0][:2], r[1][:2]) for r in results], tol=(1e-5, 1e-5))
    _check(cases[2:], [(r[0][2:], r[1][2:]) for r in results])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_offload_parity_on_cuda(world_size: int, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU offload (pinned host buffers, side-stream gradient copies, H2D prefetch of parameter shards) and NVMe."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the NVMe cases' swap files (ds_config's nvme_path: the temp dir)
    _check(OFFLOAD, run_on_ranks(_on_cuda, world_size, OFFLOAD))


def _fp16(rank: int, world_size: int, stage: int):
    """fp16 with the dynamic loss scaler on CUDA: the scale starts at 2**32, far above what fp16 gradients hold, so
    the first steps overflow, are skipped and halve the scale until it fits (2**16 already fits this model: no step
    overflowed at that start); then the loss falls and the parameters stay finite."""
    import zeroshard

    case = Case(stage=stage, steps=30)
    model = build_model(case)
    config = ds_config(case)
    config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 32, "hysteresis": 1}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    losses = []
    batch = global_batches(case, world_size)[0]  # one batch throughout: the loss falls step by step once unskipped
    for _ in range(case.steps):
        x, y = (t.to(engine.device) for t in micro_batch(batch, 0, rank, world_size, case.micro))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with engine.gathered_for_generation():
        finite = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    return losses, engine.skipped_steps, engine.loss_scale, finite


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_loss_scaler_on_cuda(stage: int) -> None:
    for losses, skipped, scale, finite in run_on_ranks(_fp16, WORLD_SIZES[-1], stage):
        assert finite and 0 < skipped < len(losses) - 5 and scale < 2**32, (skipped, scale)
        assert losses[:skipped] == [losses[0]] * skipped, losses  # a skipped step leaves the parameters alone
        assert losses[-1] < losses[skipped] - 0.1, losses


def _resume(rank: int, world_size: int, stage: int, root: str, decoupled: bool):
    """Save after 4 steps, train 4 more; a fresh engine loads the save and trains the same 4: equal losses. With
    `decoupled` the save's thread copies the GPU shards on its own stream while the next step runs
    ([Note: decoupled checkpoint writes])."""
    import zeroshard

    case = Case(stage=stage, steps=8, dtype="bf16")
    batches = global_batches(case, world_size)

    def run(engine, steps: range) -> list[float]:
        out = []
        for step in steps:
            x, y = (t.to(engine.device) for t in micro_batch(batches[step], 0, rank, world_size, case.micro))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    def fresh(writer: dict | None = None):
        model = build_model(case)
        config = ds_config(case)
        if writer:
            config["checkpoint"] = {"writer": writer}
        return zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)[0]

    engine = fresh({"decoupled": True} if decoupled else None)
    run(engine, range(4))
    engine.save_checkpoint(root)
    assert decoupled == (engine._pending_save is not None)
    straight = run(engine, range(4, 8))
    engine.destroy()
    engine = fresh()
    engine.load_checkpoint(root)
    resumed = run(engine, range(4, 8))
    return straight, resumed


@pytest.mark.parametrize("decoupled", [False, True], ids=["sync", "decoupled"])
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_resume_on_cuda(stage: int, decoupled: bool, tmp_path) -> None:
    for straight, resumed in run_on_ranks(_resume, WORLD_SIZES[-1], stage, str(tmp_path), decoupled):
        assert straight == resumed


def _stage3_features(rank: int, world_size: int, root: str):
    """GatheredParameters with a modifier rank, save_16bit_model, and the caching allocator's peak against
    memory_report() (issue 12: within 10%), on a 15M-parameter GPT whose activations (one sequence of 4 tokens)
    are negligible next to its model states."""
    import zeroshard
    from zeroshard.models.gpt import GPT, GPTConfig

    # cuBLAS keeps a workspace per (handle, stream), 32 MiB on sm90, from the allocator, and a handle per thread:
    # the forward's (this thread) and the backward's (autograd's device thread) are made here, before the baseline,
    # so the measured peak holds the model's bytes only (the first GPU run's gap, 72.9 MB, was these two)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    torch.nn.functional.linear(w, w, w[0]).sum().backward()
    del w
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    with zeroshard.zero_init():  # no full copy on the GPU while sharding (that transient is not the training peak)
        model = GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=4, n_head=8, n_embd=512))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    init_peak = torch.cuda.max_memory_allocated() - baseline
    torch.cuda.reset_peak_memory_stats()  # the training steps' peak: the model states stay allocated across it
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randint(0, 4096, (1, 4), generator=generator).to(engine.device)
        engine.backward(engine(x, x))
        report = engine.memory_report()  # with the gradient shards, which the step frees ([Note: gradient shards
        engine.step()  # exist from reduction to step])
    # the communication buffers at their peak in use (on CUDA the pool keeps none between uses: [Note: pooled
    # buffers between passes])
    gathered = report.peak_gathered_params + report.persistent_params
    accounted = report.model_states + gathered + engine.strategy.pool.peak_bytes
    measured = torch.cuda.max_memory_allocated() - baseline
    head = engine.module.lm_head.weight
    with zeroshard.GatheredParameters([head], modifier_rank=0):
        if rank == 0:
            head.data.fill_(0.5)
    with zeroshard.GatheredParameters([head]):
        filled = bool((head == 0.5).all())
    engine.save_16bit_model(root)
    return accounted, measured, init_peak, filled


def test_stage3_features_and_allocator_peak_on_cuda(tmp_path) -> None:
    for accounted, measured, init_peak, filled in run_on_ranks(_stage3_features, WORLD_SIZES[-1], str(tmp_path)):
        assert filled
        assert abs(measured - accounted) <= 0.1 * accounted, (measured, accounted, init_peak)
    assert any(p.name.endswith((".bin", ".safetensors")) for p in tmp_path.iterdir())


def _partial_offload_places(rank: int, world_size: int):
    """Where `offload_optimizer.ratio` 0.5 puts the optimizer state: some on the GPU, the rest in host memory, and
    the report's columns agree with the tensors' devices."""
    import zeroshard

    case = Case(stage=3, offload="cpu", sub_group=1000, ratio=0.5, dtype="bf16", steps=2)
    model = build_model(case)
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=param_groups(model, case), config=ds_config(case)
    )
    for batch in global_batches(case, world_size):
        x, y = (t.to(engine.device) for t in micro_batch(batch, 0, rank, world_size, case.micro))
        engine.backward(engine(x, y))
        engine.step()
    held: dict[str, int] = {}
    for state in engine.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                held[value.device.type] = held.get(value.device.type, 0) + value.numel() * value.element_size()
    report = engine.memory_report()
    engine.destroy()
    return held, report.optimizer_state, report.host_optimizer_state


def test_partial_offload_splits_state_between_gpu_and_host() -> None:
    for held, device_bytes, host_bytes in run_on_ranks(_partial_offload_places, WORLD_SIZES[-1]):
        assert set(held) == {"cuda", "cpu"}, held
        assert (held["cuda"], held["cpu"]) == (device_bytes, host_bytes)


def _gradients_after_copy(rank: int, world_size: int, gas: int):
    """[Note: a gradient shard leaves once its host copy holds it] on CUDA: the shards (bf16 without accumulation,
    fp32 with it) leave the GPU once their pinned host copies are queued on the side stream, whose copies are held
    back here (`torch.cuda._sleep`) while the compute stream allocates and fills blocks of the same sizes: only
    `record_stream` keeps those from taking the released shards' memory before the copies read it. A second
    backward into the window reads the shards back; a gradient read before the step comes from the copies."""
    import zeroshard
    from zeroshard.utils import safe_get_full_grad

    out = {}
    for offload in ("cpu", "none"):
        case = Case(stage=3, offload=offload, dtype="bf16", gas=gas, steps=2)
        model = build_model(case)
        engine, _, _, _ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        batch = global_batches(case, world_size)[0]
        held, clobber = [], []
        for k in range(gas):
            x, y = (t.to(engine.device) for t in micro_batch(batch, k, rank, world_size, case.micro))
            stream = engine.strategy.gradients_tier.copy_stream
            with torch.cuda.stream(stream):
                torch.cuda._sleep(500_000_000)  # the boundary's copies wait behind this
            engine.backward(engine(x, y))
            for unit in engine.strategy.units:  # garbage into whatever blocks of the shards' sizes are free now
                shape, dtype = unit.grad_shard.shape, unit.grad_shard.dtype
                clobber += [torch.full(shape, float("nan"), dtype=dtype, device=engine.device) for _ in range(2)]
            if k == gas - 1:
                engine.backward(engine(x, y))  # into the same window: read back from the copies
            held.append(engine.memory_report().gradients)
        grads = [safe_get_full_grad(p).cpu() for p in engine.module.parameters()]
        restores = sum(u.grad_restores for u in engine.strategy.units)
        engine.step()
        out[offload] = (held, grads, restores, engine.get_global_grad_norm())
        engine.destroy()
    return out


@pytest.mark.parametrize("gas", [1, 2])
def test_offloaded_gradient_shards_leave_the_gpu_once_copied(gas: int) -> None:
    for out in run_on_ranks(_gradients_after_copy, WORLD_SIZES[-1], gas):
        (held, grads, restores, norm), (plain_held, plain_grads, _, plain_norm) = out["cpu"], out["none"]
        assert held[-1] == 0 and all(h > 0 for h in plain_held), (held, plain_held)
        assert restores > 0
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
        assert norm == plain_norm, (norm, plain_norm)


def _super_offload(rank: int, world_size: int, gas: int):
    """[Note: speculative host steps] on CUDA: the host steps each sub-group during backward from the pinned copies
    the side stream fills (held back here behind a sleeping kernel, so a step that did not wait for them would read
    stale values), publishing from its own stream; the results equal stepping after backward bit for bit. The
    worker thread keeps to its share of the rank's cores; the main thread's mask and torch's thread count stay."""
    import os
    import threading

    import zeroshard
    from zeroshard.zero.stage3.speculate import worker_cores

    out = {}
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    local = int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    for super_offload in (True, False):
        case = Case(stage=3, offload="cpu", dtype="bf16", gas=gas, steps=3, clip=0.0, sub_group=3000, variant="deep")
        model = build_model(case)
        config = ds_config(case)
        config["zero_optimization"]["offload_optimizer"]["super_offload"] = super_offload
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        losses, worker = [], None
        for batch in global_batches(case, world_size):
            for k in range(gas):
                x, y = (t.to(engine.device) for t in micro_batch(batch, k, rank, world_size, case.micro))
                with torch.cuda.stream(engine.strategy.gradients_tier.copy_stream):
                    torch.cuda._sleep(200_000_000)
                loss = engine(x, y)
                engine.backward(loss)
                thread = next((t for t in threading.enumerate() if t.name == "zeroshard-super-offload"), None)
                worker = worker or (thread and sorted(os.sched_getaffinity(thread.native_id)))
                engine.step()
                losses.append(loss.item())
        params = [p.detach().float().cpu() for p in engine.module.state_dict().values()]
        speculation = engine.strategy.speculation
        taken = (speculation.steps_taken, speculation.taken_during_backward) if speculation is not None else (0, 0)
        groups = sum(g.tier.offloaded for g in engine.strategy.built.sub_groups)
        engine.destroy()
        out[super_offload] = (losses, params, taken, groups, worker)
    expected = worker_cores(cores, 0.8, *local, os.cpu_count() or len(cores))
    kept = (sorted(os.sched_getaffinity(0)) == cores, torch.get_num_threads() == threads)
    return expected or cores, kept, out


@pytest.mark.parametrize("gas", [1, 2])
def test_super_offload_steps_during_backward_on_cuda(gas: int) -> None:
    for expected, kept, out in run_on_ranks(_super_offload, WORLD_SIZES[-1], gas):
        (losses, params, (taken, during), groups, worker), plain = out[True], out[False]
        assert groups >= 4 and taken == groups * 3 and during > 0, (groups, taken, during)
        assert losses == plain[0] and all(torch.equal(a, b) for a, b in zip(params, plain[1], strict=True))
        assert worker == expected and kept == (True, True), (worker, expected, kept)


def _rss(address: int | None = None) -> int | None:
    """Resident bytes of the process (/proc/self/status), or of the mapping holding `address` (/proc/self/smaps:
    None when no mapping holds it)."""
    if address is None:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    return None


def test_pinned_state_is_exactly_sized_and_copies_asynchronously() -> None:
    """[Note: pinned memory without rounding]: 96 MiB + 4 KiB of state adds that much to the process (resident:
    page-locked; torch's allocator would pin 128 MiB), reports itself pinned, copies both ways without blocking the
    host (the copies queue behind a sleeping kernel and the host returns first), and is unmapped when freed."""
    import gc

    from zeroshard.offload.pinned import pinned_zeros

    numel = (96 << 20) // 4 + 1024
    nbytes = numel * 4
    torch.zeros(1, device="cuda")  # the context (and its host memory) first
    torch.cuda.cudart()
    before = _rss()
    host = pinned_zeros(numel, torch.float32)
    grown = _rss() - before  # type: ignore[operator]
    address = host.data_ptr()
    assert host.is_pinned() and (_rss(address) or 0) >= nbytes, _rss(address)
    assert nbytes <= grown < nbytes + (16 << 20), (grown, nbytes)
    device = torch.randn(numel, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
        host.copy_(device, non_blocking=True)
        back = torch.empty_like(device)
        back.copy_(host, non_blocking=True)
        assert not stream.query(), "a copy blocked the host"
    stream.synchronize()
    assert torch.equal(back, device) and torch.equal(host, device.cpu())
    del host
    gc.collect()
    assert _rss(address) is None


def test_wall_clock_times_the_device_with_events() -> None:
    """[Note: wall clock breakdown] on CUDA: a timer records events on the current stream, so a kernel the host
    only launched counts in full (the host returns at once; the event time includes the sleeping kernel)."""
    import time

    from zeroshard.monitor.wall_clock import WallClock

    clock = WallClock(True, torch.device("cuda"))
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    host = time.perf_counter()
    with clock.time("fwd"):
        torch.cuda._sleep(200_000_000)  # about 0.1 s on an H100
    host_ms = (time.perf_counter() - host) * 1e3
    events: list = []
    clock.after_step(True, 8, events.extend)
    device_ms = clock.snapshot()["fwd"]
    assert device_ms > 20.0 and device_ms > 5 * host_ms, (device_ms, host_ms)
    assert [name for name, _, _ in events][0] == "Train/Samples/elapsed_time_ms_forward" and events[0][1] == device_ms


QUANTIZED_FROZEN = [
    Case(stage=3, variant="mostly_frozen"),
    Case(stage=3, variant="mostly_frozen", offload="cpu", offload_param="cpu"),  # pinned codes, side-stream gathers
    Case(stage=3, variant="mostly_frozen", offload="cpu", offload_param="nvme", dtype="bf16"),
]


def _quantized_frozen_on_cuda(rank: int, world_size: int, cases: list[Case]):
    """[Note: quantized frozen weights]: each case with the key; the reference starts from the engine's values."""
    out, frozen = [], []

    def configure(config: dict) -> dict:
        config["zero_optimization"]["zero_quantized_nontrainable_weights"] = True
        return config

    for case in cases:
        values: dict[str, torch.Tensor] = {}

        def capture(engine, values=values) -> None:
            names = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
            values.update({n: v.float().cpu() for n, v in engine.module.state_dict().items() if n in names})

        losses, params, _ = engine_run(rank, world_size, case, configure, capture)
        out.append((losses, params))
        frozen.append(values)
    pairs = zip(cases, frozen, strict=True)
    references = [reference_run(c, world_size, f"cuda:{rank}", v) for c, v in pairs] if rank == 0 else []
    return out, references


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_quantized_frozen_weights_on_cuda(world_size: int, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    _check(QUANTIZED_FROZEN, run_on_ranks(_quantized_frozen_on_cuda, world_size, QUANTIZED_FROZEN))
