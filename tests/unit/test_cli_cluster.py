"""Scheduler environments (Slurm, MPI, Kubernetes) -> this node's place in the job, and the recipes of
docs/cli.md "Clusters" run with their variables simulated (`zeroshard launch --dry-run`)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from zeroshard.cli.main import main
from zeroshard.launcher.cluster import ClusterEnv, detect, expand_nodelist
from zeroshard.launcher.hostfile import LaunchError

ROOT = Path(__file__).resolve().parents[2]
SRUN = {"SLURM_JOB_ID": "917", "SLURM_JOB_NUM_NODES": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "3"}


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu-[8-10]-ib", ["gpu-8-ib", "gpu-9-ib", "gpu-10-ib"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x[009-011],y", ["x009", "x010", "x011", "y"]),
    ],
)
def test_slurm_nodelists_expand(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_slurm_nodelist_errors():
    with pytest.raises(LaunchError, match="not N or N-M"):
        expand_nodelist("node[a-b]")


def test_detects_slurm():
    env = {**SRUN, "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "node[07-09]", "SLURM_GPUS_ON_NODE": "4"}
    assert detect(env) == ClusterEnv("slurm", 3, 2, "node07", 20917, 4, "917")
    assert detect({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"}).master_addr == "10.0.0.1"
    with pytest.raises(LaunchError, match="srun --ntasks-per-node=1"):
        detect({k: v for k, v in env.items() if k != "SLURM_STEP_ID"})  # the batch script itself
    with pytest.raises(LaunchError, match="one task per node"):
        detect({**env, "SLURM_NTASKS": "12"})  # srun started a task per GPU


def test_detects_mpi():
    ompi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert detect({**ompi, "MASTER_ADDR": "n0"}) == ClusterEnv("mpi", 4, 3, "n0", None, None, None)
    assert detect({"PMI_SIZE": "2", "PMI_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "7"}).node_rank == 1
    with pytest.raises(LaunchError, match="ppr:1:node"):
        detect({**ompi, "OMPI_COMM_WORLD_LOCAL_SIZE": "8"})
    # mpirun inside a Slurm allocation: MPI's variables say which process this is
    assert detect({**ompi, **SRUN, "SLURM_NODEID": "0", "MASTER_ADDR": "n0"}).scheduler == "mpi"


def test_detects_kubernetes():
    pet = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}
    assert detect({**pet, "PET_NPROC_PER_NODE": "8"}) == ClusterEnv("kubernetes", 2, 1, "job-master-0", 23456, 8)
    assert detect({**pet, "PET_NPROC_PER_NODE": "auto"}).nproc_per_node is None
    pod = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}
    assert detect(pod) == ClusterEnv("kubernetes", 3, 2, "job-master-0", 23456)
    indexed = {"JOB_COMPLETION_INDEX": "1", "NNODES": "2", "MASTER_ADDR": "j-0.j", "MASTER_PORT": "29500"}
    assert detect(indexed) == ClusterEnv("kubernetes", 2, 1, "j-0.j", 29500)
    assert detect({**pod, "LOCAL_RANK": "0"}) is None  # a torchrun worker, not a pod


def test_explicit_choice():
    assert detect({**SRUN, "SLURM_NODEID": "0"}, "none") is None
    with pytest.raises(LaunchError, match="--cluster mpi: none of its variables"):
        detect({}, "mpi")


def _dry_run(monkeypatch, capsys, env: dict[str, str], argv: list[str]) -> list[str]:
    for key in list(__import__("os").environ):
        if key.startswith(("SLURM_", "OMPI_", "PMI_", "PET_")) or key in {"MASTER_ADDR", "MASTER_PORT", "RANK"}:
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["launch", "--dry-run", *argv]) == 0
    return shlex.split(capsys.readouterr().out.strip().splitlines()[-1])


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _cli_md_block(heading: str) -> str:
    """The first code block under `heading` in docs/cli.md (the recipe the docs show)."""
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text[text.index(heading) :]
    return re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S).group(1)


def test_slurm_recipe(monkeypatch, capsys):
    """--print-sbatch's script, then its srun line as node 1 of `node[01-02]` would run it."""
    assert main(["launch", "--print-sbatch", "--nnodes", "2", "--nproc_per_node", "4", "train.py", "--lr", "1"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "#SBATCH --exclusive" in script and '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in script  # the node's cores
    assert "zeroshard launch --print-sbatch" in _cli_md_block("### Slurm")
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    launch = shlex.split(srun)[shlex.split(srun).index("zeroshard") + 2 :]
    env = {**SRUN, "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1"}
    argv = _dry_run(monkeypatch, capsys, {**env, "SLURM_JOB_NODELIST": "node[01-02]"}, launch)
    assert _flag(argv, "--rdzv_backend") == "c10d" and _flag(argv, "--rdzv_endpoint") == "node01:20917"
    assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--nproc_per_node") == "4"
    assert _flag(argv, "--rdzv_conf") == "is_host=0" and argv[-3:] == ["zeroshard-worker", "--lr", "1"]


def test_mpi_recipe(monkeypatch, capsys):
    """docs/cli.md's mpirun line starts one launcher per node; OpenMPI's variables as node 1 of 2."""
    recipe = _cli_md_block("### MPI")
    assert "--map-by ppr:1:node" in recipe and "-x MASTER_ADDR" in recipe
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    argv = _dry_run(monkeypatch, capsys, {**env, "MASTER_ADDR": "n0"}, ["--nproc_per_node", "8", "train.py"])
    assert _flag(argv, "--rdzv_endpoint") == "n0:29500" and _flag(argv, "--nnodes") == "2"
    env = {"PMI_SIZE": "2", "PMI_RANK": "0", "MASTER_ADDR": "n0", "MASTER_PORT": "6000"}
    argv = _dry_run(monkeypatch, capsys, env, ["--nproc_per_node", "8", "train.py"])
    assert _flag(argv, "--rdzv_endpoint") == "n0:6000" and _flag(argv, "--rdzv_conf") == "is_host=1"


def test_kubernetes_recipes(monkeypatch, capsys):
    """The manifests under deploy/: their container command, with the variables each controller sets."""
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "pytorchjob.yaml").read_text())
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    operator = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"]}
    operator |= {"PET_MASTER_ADDR": "zeroshard-train-master-0", "PET_MASTER_PORT": "23456"}
    argv = _dry_run(monkeypatch, capsys, operator, container["command"][2:])
    assert _flag(argv, "--rdzv_endpoint") == "zeroshard-train-master-0:23456" and _flag(argv, "--nproc_per_node") == "8"
    assert _flag(argv, "--max_restarts") == "3"
    service, indexed = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "indexed-job.yaml").read_text())
    pod = indexed["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]} | {"JOB_COMPLETION_INDEX": "1"}
    argv = _dry_run(monkeypatch, capsys, env, pod["containers"][0]["command"][2:])
    assert _flag(argv, "--rdzv_endpoint") == "zeroshard-train-0.zeroshard-train:29500"
    assert pod["subdomain"] == service["metadata"]["name"] and _flag(argv, "--nnodes") == "2"
    assert "deploy/kubernetes/pytorchjob.yaml" in (ROOT / "docs" / "cli.md").read_text()


def test_multi_node_without_a_master_is_refused(monkeypatch, capsys):
    env = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert main(["launch", "--dry-run", "train.py"]) != 0
    assert "export MASTER_ADDR" in capsys.readouterr().err
