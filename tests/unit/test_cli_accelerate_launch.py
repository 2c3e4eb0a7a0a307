"""`zeroshard accelerate-launch` ([Note: accelerate launch without DeepSpeed]): accelerate's command line and config
file, read by accelerate, become `zeroshard launch` and the environment `accelerate launch` would set (--dry-run);
and `zeroshard.hf.TrainingArguments` reads that environment ([Note: accelerate launch's DeepSpeed for the Trainer])."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from zeroshard.cli.accelerate_launch import split_argv
from zeroshard.cli.main import main

# what `accelerate config` writes for ZeRO-3 (TRL's examples/accelerate_configs/deepspeed_zero3.yaml)
ZERO3 = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "deepspeed_config": {
        "deepspeed_multinode_launcher": "standard",
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "zero3_init_flag": True,
        "zero3_save_16bit_model": True,
        "zero_stage": 3,
    },
    "distributed_type": "DEEPSPEED",
    "machine_rank": 0,
    "main_training_function": "main",
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 8,
    "main_process_port": 0,  # accelerate picks a free one
    "rdzv_backend": "static",
    "same_network": True,
    "use_cpu": False,
}


@pytest.fixture(autouse=True)
def _no_default_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """accelerate reads ~/.cache/huggingface/accelerate/default_config.yaml when no config is given: not here."""
    import accelerate.commands.launch as launch

    monkeypatch.setattr(launch, "default_config_file", str(tmp_path / "absent.yaml"))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)


def _config(tmp_path: Path, **changes: object) -> str:
    config = {**ZERO3, **changes}
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, str], list[str]]:
    assert main(["accelerate-launch", "--dry-run", *argv]) == 0
    words = shlex.split(capsys.readouterr().out)
    at = words.index("zeroshard")
    env = dict(w.split("=", 1) for w in words[:at])
    return env, words[at + 2 :]  # after "zeroshard launch"


def test_a_zero3_config_file_gives_accelerates_environment_and_the_launch(tmp_path, capsys):
    env, launch = _dry_run(["--config_file", _config(tmp_path), "train.py", "--lr", "1e-4", "--bf16"], capsys)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"] == "true"
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "none"
    assert "mixed_precision" in env["ACCELERATE_CONFIG_DS_FIELDS"].split(",")  # as accelerate launch lists them
    assert launch[:4] == ["--nproc_per_node", "8", "--cluster", "none"], launch
    assert launch[4] == "--master_port" and int(launch[5]) > 0, launch
    assert launch[6:] == ["--no_local_rank", "train.py", "--lr", "1e-4", "--bf16"], launch  # the script's untouched


def test_command_line_options_override_the_file_as_in_accelerate(tmp_path, capsys):
    argv = ["--config_file", _config(tmp_path), "--num_processes", "2", "--zero_stage", "2", "-m", "pkg.train"]
    env, launch = _dry_run(argv, capsys)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2" and launch[1] == "2", (env, launch)
    assert launch[-2:] == ["-m", "pkg.train"], launch
    env, launch = _dry_run(["--use_deepspeed", "--num_processes", "4", "--gradient_clipping", "0.5", "t.py"], capsys)
    assert env["ACCELERATE_GRADIENT_CLIPPING"] == "0.5" and launch[1] == "4", (env, launch)


def test_multi_node_launchers(tmp_path, capsys):
    config = _config(tmp_path, num_machines=2, num_processes=16, machine_rank=1, main_process_ip="10.0.0.1")
    _, launch = _dry_run(["--config_file", config, "train.py"], capsys)
    assert launch[launch.index("--nnodes") :][:6] == ["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1"]
    assert launch[1] == "8", launch  # processes per node
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=8\nworker-1 slots=8\n")
    deepspeed = {**ZERO3["deepspeed_config"], "deepspeed_multinode_launcher": "pdsh", "deepspeed_hostfile": str(hosts)}
    config = _config(tmp_path, num_machines=2, num_processes=16, main_process_ip="10.0.0.1", deepspeed_config=deepspeed)
    _, launch = _dry_run(["--config_file", config, "train.py"], capsys)
    assert launch[launch.index("--hostfile") :][:4] == ["--hostfile", str(hosts), "--master_addr", "10.0.0.1"]
    assert launch[:2] == ["--nproc_per_node", "8"], launch
    deepspeed = {**deepspeed, "deepspeed_exclusion_filter": "worker-1:3"}
    config = _config(tmp_path, num_machines=2, num_processes=16, main_process_ip="10.0.0.1", deepspeed_config=deepspeed)
    _, launch = _dry_run(["--config_file", config, "train.py"], capsys)
    assert "--nproc_per_node" not in launch, launch  # the filter's slots, as DeepSpeed's runner counts them
    assert launch[launch.index("--exclude") + 1] == "worker-1:3", launch


@pytest.mark.parametrize(
    ("changes", "argv", "message"),
    [
        ({"distributed_type": "MULTI_GPU"}, [], "zeroshard takes DeepSpeed's place only"),
        ({}, ["--cpu"], "the arguments select --cpu"),
        ({"num_machines": 2, "num_processes": 16}, [], "set machine_rank and main_process_ip"),
        ({}, ["--num_processes", "0"], "no process count"),
    ],
)
def test_what_accelerate_would_not_run_with_deepspeed_is_one_line(tmp_path, capsys, changes, argv, message):
    if "num_machines" in changes:
        changes = {**changes, "machine_rank": None}
    assert main(["accelerate-launch", "--config_file", _config(tmp_path, **changes), *argv, "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("zeroshard accelerate-launch"), err


def test_deepspeeds_mpi_launchers_are_refused(tmp_path, capsys):
    deepspeed = {**ZERO3["deepspeed_config"], "deepspeed_multinode_launcher": "openmpi"}
    config = _config(tmp_path, num_machines=2, num_processes=16, deepspeed_config=deepspeed)
    assert main(["accelerate-launch", "--config_file", config, "train.py"]) == 2
    assert "'openmpi' starts DeepSpeed's runner" in capsys.readouterr().err


def test_torchrun_options_zeroshard_launch_sets_its_own_way_are_named(tmp_path, capsys, log):
    _dry_run(["--config_file", _config(tmp_path), "--rdzv_backend", "c10d", "train.py"], capsys)
    assert any("--rdzv_backend c10d is not used" in r.getMessage() for r in log.records), log.records


def test_only_what_follows_the_command_goes_to_accelerate():
    plain = ["launch", "--nproc_per_node", "2", "t.py"]
    assert split_argv(plain) == (plain, None)
    assert split_argv(["--debug", "accelerate-launch", "--dry-run", "--config_file", "c.yaml", "t.py", "--debug"]) == (
        ["--debug", "accelerate-launch", "--dry-run"],
        ["--config_file", "c.yaml", "t.py", "--debug"],
    )


def test_the_trainer_arguments_take_the_launchs_deepspeed_settings(monkeypatch):
    """What `accelerate launch` with a ZeRO-3 config sets reaches the Trainer as its zeroshard config; transformers
    and accelerate then see no DeepSpeed (the variable is gone from this process)."""
    import os

    import zeroshard.hf.arguments as arguments
    from zeroshard.hf import TrainingArguments

    monkeypatch.setattr(arguments, "_taken", False)
    for key, value in {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_GRADIENT_CLIPPING": "0.5",
        "ACCELERATE_MIXED_PRECISION": "bf16",
    }.items():
        monkeypatch.setenv(key, value)
    args = TrainingArguments("out", use_cpu=True, report_to=[])
    config = args.zeroshard_config
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["gradient_clipping"] == 0.5 and config["bf16"] == {"enabled": True}
    assert config["train_micro_batch_size_per_gpu"] == "auto"  # the Trainer's "auto" rules fill it
    assert args.deepspeed is None and args.deepspeed_plugin is None
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ
    again = TrainingArguments("out", use_cpu=True, report_to=[])  # a second one of the process: still launched
    assert again.zeroshard_config["zero_optimization"]["stage"] == 3
    from zeroshard.hf.arguments import launched_with_deepspeed

    assert launched_with_deepspeed()  # what zeroshard.hf.Accelerator asks
    explicit = TrainingArguments("out", use_cpu=True, report_to=[], deepspeed={"zero_optimization": {"stage": 1}})
    assert explicit.zeroshard_config == {"zero_optimization": {"stage": 1}}  # an explicit deepspeed= wins
    from zeroshard.hf.arguments import config_source as _config_source

    trainer_own = _config_source(args, {"zero_optimization": {"stage": 2}})  # and a Trainer's zeroshard_config=
    assert trainer_own.zero_optimization.stage == 2


def test_the_launchs_moe_classes_and_precision_reach_the_trainer_config(monkeypatch):
    import zeroshard.hf.arguments as arguments
    from zeroshard.config.zero import LeafModuleConfig
    from zeroshard.hf import TrainingArguments

    monkeypatch.setattr(arguments, "_taken", False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", "MyMoEBlock,OtherMoE")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    config = TrainingArguments("out", use_cpu=True, report_to=[], fp16=False).zeroshard_config
    assert config["zero_optimization"]["leaf_module"]["classes"] == [
        *LeafModuleConfig().classes,
        "MyMoEBlock",
        "OtherMoE",
    ]
    assert config["bf16"] == {"enabled": True}  # no --fp16/--bf16: the launch's precision
