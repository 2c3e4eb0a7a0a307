"""Stage 3 resumes bit-for-bit also with a persistent unit and units kept gathered for reuse (the
gathered copies are refreshed after a load, which fills shards only)."""

from __future__ import annotations

from typing import Any

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups


def _run(rank: int, world_size: int, root: str, resume: bool):
    import zeroshard

    case = Case(stage=3, steps=6, persistence=2000, reuse=10**9, prefetch=10**9)
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    batches = global_batches(case, world_size)
    start = 0
    if resume:
        engine.load_checkpoint(root)
        start = 3
    losses = []
    for step in range(start, 6):
        x, y = micro_batch(batches[step], 0, rank, world_size, case.micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if not resume and step == 2:
            engine.save_checkpoint(root)
    engine.destroy()
    return losses


def test_stage3_resume_with_persistent_and_reused_units(tmp_path):
    before = run_on_ranks(_run, 2, str(tmp_path), False)
    after = run_on_ranks(_run, 2, str(tmp_path), True)
    for rank in range(2):
        assert after[rank] == before[rank][3:], (rank, before[rank], after[rank])


def _train(rank: int, world_size: int, case, root: str, start: int, save_at: int | None) -> tuple[list[float], Any]:
    import zeroshard

    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    if start:
        engine.load_checkpoint(root)
    batches = global_batches(case, world_size)
    losses = []
    for step in range(start, case.steps):
        x, y = micro_batch(batches[step], 0, rank, world_size, case.micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == save_at:
            engine.save_checkpoint(root)
    report = engine.memory_report()
    engine.destroy()
    return losses, report


def _across_ratios(rank: int, world_size: int, root: str) -> dict[float, tuple[list[float], Any]]:
    def case(ratio: float) -> Case:
        return Case(stage=3, steps=6, offload="cpu", sub_group=1000, ratio=ratio)

    out = {0.5: _train(rank, world_size, case(0.5), root, 0, save_at=2)}
    for ratio in (1.0, 0.0):  # all on the host, all on the device
        out[ratio] = _train(rank, world_size, case(ratio), root, 3, save_at=None)
    return out


def test_partial_offload_checkpoint_resumes_with_any_split(tmp_path):
    """[Note: partial offload]: the checkpoint holds no placement; a run saved with half of the optimizer state on
    the host resumes bit-for-bit with all of it on the host or all on the device."""
    for runs in run_on_ranks(_across_ratios, 2, str(tmp_path)):
        (saved, split), (on_host, host_only), (on_device, device_only) = runs[0.5], runs[1.0], runs[0.0]
        assert on_host == saved[3:] and on_device == saved[3:], runs
        assert split.optimizer_state > 0 and split.host_optimizer_state > 0, split
        assert host_only.optimizer_state == 0 and device_only.host_optimizer_state == 0, (host_only, device_only)


def _serial_loads(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each rank's load interval (wall clock, one machine) with and without pipeline_loading_checkpoint, on one
    node of 2 and on 2 nodes of 1; and the losses after each load."""
    import os
    import time

    import zeroshard
    from zeroshard.checkpoint import load
    from zeroshard.checkpoint.errors import CheckpointError

    case = Case(stage=3, steps=4)
    batches = global_batches(case, world_size)
    inner = load._load_into
    intervals: list[tuple[float, float]] = []

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        time.sleep(0.5)  # long enough that two loads at once overlap on any machine
        if fail and rank == 0:
            raise OSError("disk gone")
        out = inner(*args, **kwargs)
        intervals.append((start, time.time()))
        return out

    load._load_into = timed  # type: ignore[assignment]

    def run(serial: bool | None) -> list[float]:
        model = build_model(case)
        config = ds_config(case)
        if serial is not None:
            config["zero_optimization"]["pipeline_loading_checkpoint"] = serial
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        if serial is not None:
            engine.load_checkpoint(root)
        losses = []
        for step in range(2 if serial is not None else 0, case.steps):
            loss = engine(*micro_batch(batches[step], 0, rank, world_size, case.micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if serial is None and step == 1:
                engine.save_checkpoint(root)
        engine.destroy()
        return losses

    fail = False
    out: dict[str, Any] = {"full": run(None)}
    for name, serial, per_node in (("off", False, "2"), ("serial", True, "2"), ("serial_two_nodes", True, "1")):
        os.environ["ZEROSHARD_RANKS_PER_NODE"] = per_node
        out[name] = (run(serial), intervals.pop())
    # rank 0's load fails: rank 1 still gets its turn (not a wait for the write timeout) and both report it
    fail, os.environ["ZEROSHARD_RANKS_PER_NODE"], os.environ["ZEROSHARD_CHECKPOINT_WRITE_TIMEOUT"] = True, "2", "60"
    start = time.time()
    try:
        run(True)
    except CheckpointError as e:
        out["failed"] = (str(e), time.time() - start)
    return out


def test_pipeline_loading_checkpoint_loads_one_rank_per_node_at_a_time(tmp_path):
    """zero_optimization.pipeline_loading_checkpoint (DeepSpeed's serial load): the ranks of a node load in turns
    (rank 1 starts after rank 0 ends); ranks on different nodes, or with the option off, load at once; the training
    after the load is the same, and continues the saved run bit for bit."""
    ranks = run_on_ranks(_serial_loads, 2, str(tmp_path))
    for name in ("off", "serial", "serial_two_nodes"):
        for rank in range(2):
            assert ranks[rank][name][0] == ranks[rank]["full"][2:], (name, rank)
        (start0, end0), (start1, end1) = (ranks[r][name][1] for r in range(2))
        overlap = min(end0, end1) - max(start0, start1)
        if name == "serial":
            assert start1 >= end0, (start0, end0, start1, end1)
        else:
            assert overlap > 0.1, (name, start0, end0, start1, end1)  # at once: most of the 0.5 s sleeps overlap
    for rank in range(2):
        message, seconds = ranks[rank]["failed"]
        assert "rank 0" in message and "disk gone" in message and seconds < 30, (rank, message, seconds)


def _slow_serial_load(rank: int, world_size: int, root: str) -> str:
    """Each load takes 1 s, the write deadline is 1.5 s: the third rank of a node starts 2 s after the first."""
    import os
    import time

    import zeroshard
    from zeroshard.checkpoint import load

    case = Case(stage=3, steps=2)
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    engine.save_checkpoint(root)
    engine.destroy()
    inner = load._load_into

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return inner(*args, **kwargs)

    load._load_into = slow  # type: ignore[assignment]
    os.environ.update(ZEROSHARD_RANKS_PER_NODE="3", ZEROSHARD_CHECKPOINT_WRITE_TIMEOUT="1.5")
    config = ds_config(case)
    config["zero_optimization"]["pipeline_loading_checkpoint"] = True
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    path, _ = engine.load_checkpoint(root)
    engine.destroy()
    return str(path)


def test_serial_loads_of_a_node_are_not_taken_for_a_stuck_rank(tmp_path):
    """The deadlines of waits that span the node's loads in turn grow with the ranks in line: three healthy 1 s loads
    under a 1.5 s write deadline complete (before, the third rank gave up on the second)."""
    assert all(path.endswith("global_step0") for path in run_on_ranks(_slow_serial_load, 3, str(tmp_path)))
