"""`checkpoint.use_node_local_storage` ([Note: node-local checkpoints]): 4 gloo ranks as 2 nodes of 2
(ZEROSHARD_RANKS_PER_NODE), each node saving into a folder of its own, stand for nodes without a shared filesystem.
Each node's folder holds only its ranks' files (and its leader's copies of what every rank reads whole), commits
on its own, and a resume continues bit for bit; a load from another node's folder is refused up front."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, flat_params, global_batches, micro_batch, param_groups

NODE_LOCAL = {"checkpoint": {"use_node_local_storage": True}}
CASES = [  # (case, extra config, both nodes given one folder)
    (Case(stage=0, steps=4), {}, False),  # rank 0 alone writes the optimizer state on a shared filesystem
    (Case(stage=1, steps=4), {}, False),
    (Case(stage=2, steps=4, variant="frozen"), {}, False),  # frozen weights: the leaders' own copies
    (Case(stage=3, steps=4), {}, False),
    (Case(stage=3, steps=4, offload="nvme", sub_group=3000), {}, False),  # state parts swapped in one at a time
    (Case(stage=3, steps=4), {"checkpoint": {**NODE_LOCAL["checkpoint"], "writer": {"decoupled": True}}}, False),
    (Case(stage=2, steps=4), {"zeroshard": {"backend": "fsdp2"}}, False),
    (Case(stage=1, steps=4), {}, True),  # one filesystem after all: an ordinary checkpoint
]


def _engine(case: Case, extra: dict[str, Any]) -> Any:
    import zeroshard

    model = build_model(case)
    config = {**ds_config(case), **NODE_LOCAL, **extra}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    return engine


def _steps(engine: Any, case: Case, rank: int, world_size: int, steps: range) -> list[float]:
    losses = []
    for batch in [global_batches(case, world_size)[s] for s in steps]:
        x, y = micro_batch(batch, 0, rank, world_size, case.micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def _node_local(rank: int, world_size: int, tmp: str) -> list[dict[str, Any]]:
    from zeroshard.checkpoint import CheckpointError

    os.environ["ZEROSHARD_RANKS_PER_NODE"] = "2"
    node = rank // 2
    out = []
    for i, (case, extra, shared) in enumerate(CASES):
        mine, other = (os.path.join(tmp, f"case{i}", "shared" if shared else f"node{n}") for n in (node, 1 - node))
        engine = _engine(case, extra)
        _steps(engine, case, rank, world_size, range(2))
        engine.save_checkpoint(mine, tag="t")
        saved = _params(engine)
        straight = _steps(engine, case, rank, world_size, range(2, 4))
        engine.destroy()
        torch.distributed.barrier()
        engine = _engine(case, extra)
        engine.load_checkpoint(mine)
        resumed = _steps(engine, case, rank, world_size, range(2, 4))
        try:
            engine.load_checkpoint(other)
            refused = ""
        except CheckpointError as e:
            refused = str(e)
        engine.destroy()
        got = {"straight": straight, "resumed": resumed, "files": _files(mine), "refused": refused, "saved": saved}
        out.append(got)
    return out


def _params(engine: Any) -> torch.Tensor:
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return flat_params(engine.module)


def _merged(rank: int, world_size: int, folders: list[str]) -> list[torch.Tensor]:
    """The nodes' folders copied into one load anywhere without the key, at another world size too."""
    out = []
    for (case, extra, _), folder in zip(CASES, folders, strict=True):
        extra = {k: v for k, v in extra.items() if k != "checkpoint"}
        engine = _engine(case, {**extra, "checkpoint": {"use_node_local_storage": False}})
        engine.load_checkpoint(folder)
        out.append(_params(engine))
        engine.destroy()
    return out


def test_each_node_keeps_its_own_files_commits_and_resumes_bit_for_bit(tmp_path) -> None:
    per_rank = run_on_ranks(_node_local, 4, str(tmp_path), timeout=600)
    for i, (case, extra, shared) in enumerate(CASES):
        name = f"{case.name}{extra}"
        for rank, results in enumerate(per_rank):
            got, node = results[i], rank // 2
            assert got["resumed"] == got["straight"], (name, rank, got)
            if shared:  # saved as one checkpoint, which any rank loads
                assert got["refused"] == "" and "t/model/rank00002.safetensors" in got["files"], (name, got)
                assert "t/optim/rank00003.safetensors" in got["files"], (name, got["files"])
                continue
            assert "saved with checkpoint.use_node_local_storage by node" in got["refused"], (name, got["refused"])
            if rank % 2:
                continue
            files = got["files"]
            here, away = (f"rank{r:05d}" for r in (2 * node, 2 * (1 - node)))
            assert "latest" in files and "t/metadata.json" in files and "t/engine_state.pt" in files, (name, files)
            assert all(away not in f and f"rank{2 * (1 - node) + 1:05d}" not in f for f in files), (name, files)
            assert f"t/rng/{here}.json" in files and any(f.startswith(f"t/model/{here}") for f in files), (name, files)
            assert any(f.startswith(f"t/optim/{here}") for f in files), (name, files)
            assert not any(f.startswith("t/.") or f.startswith(".") for f in files), (name, files)  # nothing left
    folders = []
    for i, (_, _, shared) in enumerate(CASES):
        folders.append(str(tmp_path / f"merged{i}"))
        for node in ("shared",) if shared else ("node0", "node1"):
            shutil.copytree(tmp_path / f"case{i}" / node, folders[-1], dirs_exist_ok=True)
    for rank_params in run_on_ranks(_merged, 2, folders):
        for i, params in enumerate(rank_params):
            assert params.equal(per_rank[0][i]["saved"]), CASES[i]


def _half_committed(rank: int, world_size: int, tmp: str) -> list[str]:
    """Tag t saved again with node 1's commit failing: node 0 holds the new save, node 1 the old one."""
    import zeroshard.checkpoint.save as save_module
    from zeroshard.checkpoint import CheckpointError

    os.environ["ZEROSHARD_RANKS_PER_NODE"] = "2"
    case, folder = Case(stage=1, steps=4), os.path.join(tmp, f"node{rank // 2}")
    engine = _engine(case, {})
    messages = []
    for steps in (range(2), range(2, 4)):
        _steps(engine, case, rank, world_size, steps)
        if rank == 2 and steps.start:
            save_module.commit_tag = _failing_commit
        try:
            engine.save_checkpoint(folder, tag="t")
        except CheckpointError as e:
            messages.append(str(e))
    try:
        engine.load_checkpoint(folder, tag="t")
    except CheckpointError as e:
        messages.append(str(e))
    engine.destroy()
    return messages


def _failing_commit(*args: Any) -> str:
    raise OSError("the disk went read-only")


def test_a_save_committed_on_some_nodes_only_does_not_load_mixed(tmp_path) -> None:
    for messages in run_on_ranks(_half_committed, 4, str(tmp_path)):
        assert len(messages) == 2, messages
        assert "failed on 1 of 2 nodes (node 1: the disk went read-only)" in messages[0], messages
        assert "the nodes' folders hold different saves of one tag" in messages[1], messages


def _misplaced(rank: int, world_size: int, tmp: str) -> list[str]:
    """3 ranks as 3 nodes of 1: a layout the ranks count differently, then nodes 0 and 1 sharing a folder that node 2
    does not see: both refused on every rank before anything is written."""
    from zeroshard.checkpoint import CheckpointError

    case = Case(stage=1, steps=4)
    engine = _engine(case, {})
    _steps(engine, case, rank, world_size, range(1))
    messages = []
    for per_node, folder in (("1" if rank == 0 else "3", "a"), ("1", "shared" if rank < 2 else "own")):
        os.environ["ZEROSHARD_RANKS_PER_NODE"] = per_node
        try:
            engine.save_checkpoint(os.path.join(tmp, folder), tag="t")
        except CheckpointError as e:
            messages.append(str(e))
    engine.destroy()
    return messages


def test_a_layout_the_ranks_disagree_on_or_a_partly_shared_folder_is_refused(tmp_path) -> None:
    for messages in run_on_ranks(_misplaced, 3, str(tmp_path)):
        assert len(messages) == 2, messages
        assert "the ranks count [1, 3] ranks per node" in messages[0], messages
        assert "some nodes share" in messages[1] and "[2, 2, 1] nodes' markers" in messages[1], messages
    assert not any(p.name.startswith(".node-local") for p in tmp_path.rglob("*")), list(tmp_path.rglob("*"))
