"""`zeroshard estimate --autoep-size N`: the experts split over N ranks ([Note: AutoEP]), stages 1-3 without NVMe."""

from __future__ import annotations

import json

import pytest

from helpers.hf_moe import tiny_moe
from helpers.hf_trainer import tiny_llama
from zeroshard.cli.estimate.formulas import Cluster, Option, Precision, zeroshard_states
from zeroshard.cli.estimate.rows import estimate_rows
from zeroshard.cli.estimate.shapes import from_hf_config
from zeroshard.cli.main import main

BF16 = Precision(param_bytes=2, grad_bytes=4, optimizer_bytes=8)


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("mixtral")
    tiny_moe("mixtral").config.save_pretrained(folder)
    return str(folder)


def test_the_experts_are_counted_as_autoep_finds_them() -> None:
    model = tiny_moe("mixtral")
    info = from_hf_config("tiny", model.config)
    fused = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert (info.experts, info.num_experts) == (fused, 4)
    assert from_hf_config("llama", tiny_llama().config).experts == 0


def test_rows_hold_the_dense_part_over_all_ranks_and_each_expert_over_its_group() -> None:
    info = from_hf_config("tiny", tiny_moe("mixtral").config)
    rows = estimate_rows(info, Cluster(4), BF16, 16, 1, autoep=2)
    assert [r.option for r in rows] == [
        Option(1),
        Option(1, "cpu"),
        Option(2),
        Option(2, "cpu"),
        Option(3),
        Option(3, "cpu"),
        Option(3, "cpu", "cpu"),
    ]
    dense = info.params - info.experts
    cluster = Cluster(4)
    for row in rows:  # the whole model in fp32 at stages 1-2 (built without zero_init); at stage 3 streamed
        whole = row.cpu_bytes_per_node >= 4 * info.params * cluster.gpus_per_node
        assert whole if row.option.stage < 3 else (row.option != Option(3) or not whole), row.option
        want = [zeroshard_states(dense, row.option, BF16, 4), zeroshard_states(info.experts // 2, row.option, BF16, 2)]
        assert row.states.total == sum(s.total for s in want), row.option
        assert row.states.gpu == sum(s.gpu for s in want) and row.deepspeed is None
    lora = estimate_rows(info, Cluster(4), BF16, 16, 1, trainable=1000, autoep=2)[2]  # a LoRA: experts frozen
    want = zeroshard_states(1000, Option(2), BF16, 4, frozen=dense - 1000).total + 2 * info.experts // 2
    assert lora.states.total == want


def test_offloaded_masters_never_alias_the_parameters() -> None:
    """One rank (or an expert-data-parallel group of one) at stages 1-2 with offload_optimizer cpu: the masters
    are a host copy, as the engine holds them (it was counted as aliasing the device's fp32 parameters)."""
    fp32 = Precision(param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert zeroshard_states(1000, Option(2, "cpu"), fp32, 1).master_weights == 4000
    assert zeroshard_states(1000, Option(2), fp32, 1).master_weights == 0


def test_cli_prints_the_expert_parallel_block(mixtral_folder: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", mixtral_folder, "--gpus", "4", "--autoep-size", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["stage"] for row in rows} == {1, 2, 3}
    chosen = next(row["recommendation"] for row in rows if row["recommended"])
    assert chosen["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    assert main(["estimate", "--model", mixtral_folder, "--gpus", "4", "--autoep-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "split over 2 ranks" in text and '"expert_parallel": {"enabled": true, "autoep_size": 2}' in text


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--gpus", "4", "--autoep-size", "3"], "--autoep-size 3 must divide the ranks (4)"),
        (["--gpus", "8", "--autoep-size", "8"], "and the experts per layer (4)"),
    ],
)
def test_cli_refusals(mixtral_folder: str, argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", mixtral_folder, *argv]) != 0
    assert words in capsys.readouterr().err


def test_cli_refuses_a_model_without_experts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7e9", "--gpus", "2", "--autoep-size", "2"]) != 0
    assert "needs a model with fused experts" in capsys.readouterr().err


def test_the_stage_3_gather_buffer_is_the_largest_unit_with_the_experts_split() -> None:
    """At stage 3 each experts module is a unit holding its 1/autoep of the experts ([Note: experts at stage 3]): the
    gathered-unit buffer is the larger of that and the largest dense layer, not the whole experts module."""
    model = tiny_moe("mixtral")
    info = from_hf_config("tiny", model.config)
    experts = max(
        sum(p.numel() for p in m.parameters(recurse=False)) for n, m in model.named_modules() if n.endswith("experts")
    )
    assert info.largest_layer == info.largest_experts == experts and info.largest_dense < experts // 2
    assert info.largest_unit(1) == experts and info.largest_unit(2) == experts // 2
    whole, split = (
        next(r for r in estimate_rows(info, Cluster(4), BF16, 16, 1, autoep=ep) if r.option == Option(3))
        for ep in (1, 2)
    )
    assert whole.buffer_bytes - split.buffer_bytes == 2 * BF16.param_bytes * (experts - experts // 2)
