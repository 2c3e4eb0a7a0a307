"""ds_config errors caught before any work, by `resolve_config` (which `initialize` and `zeroshard validate-config`
both call) and `check_world`: values that would only fail inside training, the blocks other modules read ([Note:
blocks checked by their readers] in config/blocks.py), empty files."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from helpers.config_checks import log, warnings_of  # noqa: F401  (the fixture)
from zeroshard.cli.main import main
from zeroshard.config import check_world, parse_config, resolve_config
from zeroshard.errors import ConfigError

BASE = {"train_micro_batch_size_per_gpu": 1}


def _resolve_error(source: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(parse_config({**BASE, **source}), world_size=1)
    return str(info.value)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        # the loss scaler's and the readers' refusals, which came after the model was sharded
        (
            {"fp16": {"enabled": True, "initial_scale_power": 1100}},
            "fp16.initial_scale_power: 1100 is out of range; the loss is multiplied by 2**power in fp32",
        ),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis: 0 is out of range"),
        (
            {"tensor_parallel": {"autotp_sise": 2}},
            "tensor_parallel.autotp_sise: unknown key; did you mean autotp_size?",
        ),
        ({"tensor_parallel": {"autotp_size": "2"}}, "tensor_parallel.autotp_size='2': expected a positive int"),
        # a misspelt "enabled" left AutoEP off without a word
        (
            {"expert_parallel": {"enabeld": True, "autoep_size": 2}},
            "expert_parallel.enabeld: unknown key; did you mean",
        ),
        ({"expert_parallel": {"enabled": "yes"}}, "expert_parallel.enabled='yes': expected true or false"),
        (
            {"zeroshard": {"backend": "fsdp2"}, "zero_optimization": {"stage": 1}},
            '"zeroshard": {"backend": "fsdp2"} runs ZeRO stages 2 and 3',
        ),
        (
            {"comms_logger": {"enabled": True, "prof_ops": ["allreduce_typo"]}},
            "comms_logger.prof_ops: unknown collective(s) ['allreduce_typo']",
        ),
        (
            {"activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True}},
            "activation_checkpointing.contiguous_memory_optimization needs number_checkpoints",
        ),
    ],
)
def test_resolve_refuses_what_initialize_would_after_building(source: dict[str, Any], message: str) -> None:
    assert _resolve_error(source).startswith(message)


def test_auto_hpz_size_resolves_instead_of_crashing() -> None:
    """`zero_hpz_partition_size: "auto"` was a TypeError from int() while the config was still being parsed."""
    cfg = parse_config({**BASE, "zero_optimization": {"stage": 2, "zero_hpz_partition_size": "auto"}})
    assert resolve_config(cfg, world_size=1).zero_optimization.zero_hpz_partition_size == 1


def test_a_disabled_autoep_block_is_not_read_but_for_a_misspelt_switch() -> None:
    """DeepSpeed reads nothing else of a block that is off (a "_comment" key included)."""
    block = {"enabled": False, "autoep_size": 4, "_comment": "off for now"}
    resolve_config(parse_config({**BASE, "expert_parallel": block}), world_size=1)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"stages": "two"}, "pipeline.stages='two': expected \"auto\" or a positive int"),
        ({"stages": 2.5}, "pipeline.stages=2.5: expected"),  # was truncated to 2
        ({"schedle": "gpipe"}, "pipeline.schedle: unknown key; did you mean schedule?"),
        ({"activation_checkpoint_interval": -1}, "pipeline.activation_checkpoint_interval=-1: expected an int >= 0"),
        ({"activation_checkpoint_interval": "2"}, "pipeline.activation_checkpoint_interval='2': expected"),
        ({"use_reentrant": "false"}, "pipeline.use_reentrant='false': expected true or false"),
    ],
)
def test_the_pipeline_block_is_checked_in_one_line(block: dict[str, Any], message: str) -> None:
    """With a PipelineModule (DeepSpeed reads the block only then): `stages` of another type was a ValueError or
    TypeError from int(), a float truncated."""
    from zeroshard.pipe.context import check_pipeline_block

    with pytest.raises(ConfigError) as info:
        check_pipeline_block(block)
    assert str(info.value).startswith(message)
    resolve_config(parse_config({**BASE, "pipeline": block}), world_size=1)  # a model without stages ignores it


def test_hpz_partitions_must_tile_the_world_before_any_work() -> None:
    """The check initialize runs on the launched world (it came after the units were built), and validate-config
    on --world-size."""
    cfg = resolve_config(
        parse_config({**BASE, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}), world_size=4
    )
    with pytest.raises(ConfigError, match="zero_hpz_partition_size 3 does not divide the 4 ranks"):
        check_world(cfg, 4)
    check_world(cfg, 6)
    check_world(cfg, 1)  # one rank: hpZ has nothing to do, as DeepSpeed
    stage2 = resolve_config(
        parse_config({**BASE, "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 3}}), world_size=4
    )
    check_world(stage2, 4)  # ignored below stage 3, with a warning at parse


def test_validate_config_refuses_what_initialize_would(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}'
    )
    assert main(["validate-config", str(path), "--world-size", "4"]) != 0
    assert "zero_hpz_partition_size 3 does not divide the 4 ranks" in capsys.readouterr().err
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_sise": 2}}')
    assert main(["validate-config", str(path)]) != 0
    assert "did you mean autotp_size?" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "   \n", "// nothing yet\n# still nothing\n"])
def test_an_empty_config_file_is_refused(tmp_path: pathlib.Path, text: str) -> None:
    """hjson reads an empty (truncated, never written) file as {}: it trained with every default."""
    pytest.importorskip("hjson")
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"ds_config file .*ds\.json is empty \(or holds only comments\)"):
        parse_config(str(path))
    path.write_text("{}")  # written on purpose: DeepSpeed's defaults
    assert parse_config(str(path)).zero_optimization.stage == 0


def test_allgather_size_ignored_with_zero_off_says_so(log: pytest.LogCaptureFixture) -> None:  # noqa: F811
    cfg = parse_config({**BASE, "zero_optimization": False, "allgather_size": 100})
    assert cfg.zero_optimization.stage == 0
    assert any("allgather_size is ignored with zero_optimization=false" in w for w in warnings_of(log))


def test_a_switched_off_unimplemented_block_does_not_warn(log: pytest.LogCaptureFixture) -> None:  # noqa: F811
    parse_config({**BASE, "data_efficiency": {"enabled": False, "data_sampling": {"enabled": False}}})
    assert warnings_of(log) == []
    parse_config({**BASE, "data_efficiency": {"enabled": False, "data_routing": {"random_ltd": {"enabled": True}}}})
    assert any("data_efficiency" in w for w in warnings_of(log))  # DeepSpeed runs random-LTD on its own switch
    log.clear()
    parse_config({**BASE, "data_efficiency": {"enabled": True}})
    assert any("data_efficiency" in w and "not implemented" in w for w in warnings_of(log))


def test_the_collective_timeout_is_the_configs_else_deepspeeds_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.config.features import collective_timeout

    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert collective_timeout() == collective_timeout({}) == 300.0
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "2")  # minutes, read when the config leaves the key unset
    assert collective_timeout() == collective_timeout({"zeroshard": {}}) == 120.0
    assert collective_timeout({"zeroshard": {"collective_timeout_s": 300}}) == 300.0  # set, even to the default
    with pytest.raises(ConfigError, match="zeroshard.collective_timeout_s"):
        collective_timeout({"zeroshard": {"collective_timeout_s": 0}})


@pytest.mark.parametrize("stage", [0, 2])
def test_autocast_safe_module_classes_import_before_any_work_at_every_stage(stage: int) -> None:
    """Stage 0 ignored a class that does not import, stages 1-2 refused it once the strategy was built; DeepSpeed
    imports them at initialize. `zeroshard validate-config` leaves them to initialize (a script's own classes import
    only in the script's process)."""
    import torch
    import torch.distributed as dist

    import zeroshard

    had = dist.is_initialized()
    model = torch.nn.Linear(4, 4)
    before = model.weight.detach().clone()
    autocast = {"enabled": True, "dtype": "bf16", "lower_precision_safe_modules": ["torch.nn.Linearr"]}
    config = {**BASE, "zero_optimization": {"stage": stage}, "torch_autocast": autocast}
    try:
        with pytest.raises(ConfigError, match="lower_precision_safe_modules: cannot import 'torch.nn.Linearr'"):
            zeroshard.initialize(model=model, config=config)
        assert torch.equal(model.weight, before)
        resolve_config(parse_config(config), world_size=1)  # no import at resolve
    finally:
        if not had and dist.is_initialized():
            dist.destroy_process_group()
