"""Export of a checkpoint that does not fit or is damaged: `load_state_dict_from_zero_checkpoint` refuses with the
model untouched, a failed conversion leaves an earlier export whole ([Note: export commit]), and the command lines
print one line, not a traceback. One small stage-2 checkpoint, saved in this process, serves every test."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers.parity import TINY
from zeroshard.checkpoint import (
    CheckpointError,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from zeroshard.checkpoint.safetensors_io import SafetensorsReader
from zeroshard.models.gpt import GPT, GPTConfig

TAG = "global_step1"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A stage-2 AdamW checkpoint of `GPT(TINY)` after one step, on one rank."""
    import torch.distributed as dist

    import zeroshard
    from zeroshard.utils import groups

    root = str(tmp_path_factory.mktemp("export") / "ckpt")
    had = dist.is_initialized()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zeroshard.initialize(model=GPT(TINY), config={**config, "zero_optimization": {"stage": 2}})
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
    engine.backward(engine(idx, idx))
    engine.step()
    engine.save_checkpoint(root)
    engine.destroy()
    if not had:
        groups.publish(None)
        dist.destroy_process_group()
    yield root


def _damaged(ckpt: str, tmp_path: Path) -> str:
    """A copy of `ckpt` whose master weights of `ln_f.weight` (the module's last tensor) fail their checksum: every
    other tensor reads fine, and is read first."""
    copy = str(tmp_path / "damaged")
    shutil.copytree(ckpt, copy)
    path = os.path.join(copy, TAG, "optim", "rank00000.safetensors")
    with SafetensorsReader(path) as reader:
        entry = next(e for n, e in reader.entries.items() if n.startswith("master:ln_f.weight"))
    with open(path, "r+b") as f:
        f.seek(entry.begin)
        data = f.read(4)
        f.seek(entry.begin)
        f.write(bytes(b ^ 0xFF for b in data))
    return copy


def _model(config: GPTConfig = TINY) -> tuple[GPT, dict[str, torch.Tensor]]:
    torch.manual_seed(3)
    model = GPT(config)
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_load_state_dict_refuses_other_shapes_naming_them(ckpt: str) -> None:
    """DeepSpeed's `load_state_dict(strict=False)` raises torch's size mismatch; a silent skip left the model random."""
    model, before = _model(replace(TINY, n_embd=48))
    with pytest.raises(CheckpointError, match=r"wte\.weight \(64, 48\) in the model, \(64, 32\) in the checkpoint"):
        load_state_dict_from_zero_checkpoint(model, ckpt)
    assert _unchanged(model, before)
    model, before = _model(replace(TINY, vocab_size=128))
    with pytest.raises(CheckpointError, match=r"nothing was loaded: wte\.weight .*; lm_head\.weight \(128, 32\)"):
        load_state_dict_from_zero_checkpoint(model, ckpt)
    assert _unchanged(model, before)
    model, _ = _model(replace(TINY, n_layer=3))  # strict=False: a layer the checkpoint lacks keeps its values
    fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    loaded = load_state_dict_from_zero_checkpoint(model, ckpt).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in fp32.items())


def test_load_state_dict_changes_nothing_when_a_later_tensor_fails(ckpt: str, tmp_path: Path) -> None:
    model, before = _model()
    with pytest.raises(CheckpointError, match="ln_f.weight.*checksum mismatch|checksum mismatch.*ln_f.weight"):
        load_state_dict_from_zero_checkpoint(model, _damaged(ckpt, tmp_path))
    assert _unchanged(model, before)


@pytest.mark.parametrize("max_shard_size", ["5GB", "30KB"])
def test_a_failed_convert_leaves_the_earlier_export_whole(ckpt: str, tmp_path: Path, max_shard_size: str) -> None:
    """A conversion that fails removes its own temporaries only: the earlier export (one file, or shards and the
    index naming them) and the user's files stay as they were."""
    out = tmp_path / "hf"
    files = convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size=max_shard_size)
    assert (files == ["model.safetensors"]) == (max_shard_size == "5GB"), files  # else shards and an index
    (out / "README.md").write_text("mine")
    earlier = _listing(out)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        convert_zero_checkpoint_to_fp32_state_dict(_damaged(ckpt, tmp_path), out, max_shard_size=max_shard_size)
    assert _listing(out) == earlier


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_command_lines_print_one_line_for_a_damaged_checkpoint(ckpt: str, tmp_path: Path, capsys) -> None:
    """`python ckpt/zero_to_fp32.py ckpt out` (its `main`) and `python -m zeroshard.checkpoint.export`."""
    from zeroshard.checkpoint.export import convert_main
    from zeroshard.utils.zero_to_fp32 import main

    damaged = _damaged(ckpt, tmp_path)
    assert main([damaged, str(tmp_path / "bin")]) != 0
    err = capsys.readouterr().err
    assert err.startswith("zero_to_fp32.py: error: ") and "checksum mismatch" in err and _one_line(err), err
    assert convert_main([damaged, str(tmp_path / "hf")]) != 0
    err = capsys.readouterr().err
    assert err.startswith("zeroshard convert: error: ") and "checksum mismatch" in err and _one_line(err), err
    assert not (tmp_path / "bin").exists() and not (tmp_path / "hf").exists()


def test_convert_names_a_missing_folder_and_what_exports_a_deepspeed_one(tmp_path: Path, capsys) -> None:
    """A folder that does not exist is named as such (not "no 'latest' file"); a DeepSpeed checkpoint gets advice that
    leads to an export (DeepSpeed's zero_to_fp32, or a resume here and a save), not a resume alone."""
    from zeroshard.cli.main import main

    def refusal(*argv: str) -> str:
        assert main(["convert", *argv, str(tmp_path / "out")]) != 0
        err = capsys.readouterr().err
        assert _one_line(err), err
        return err

    assert "nowhere: does not exist" in refusal(str(tmp_path / "nowhere"))
    deepspeed = tmp_path / "ds"
    (deepspeed / "global_step2" / "zero").mkdir(parents=True)
    (deepspeed / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (deepspeed / "latest").write_text("global_step2")
    err = refusal(str(deepspeed))
    assert "a DeepSpeed checkpoint, which zeroshard's export does not read" in err, err
    assert f"python -m deepspeed.utils.zero_to_fp32 {deepspeed} OUT -t global_step2" in err, err
    assert "save_checkpoint, and export" in err, err
    (deepspeed / "global_step2" / "zero" / "optimizer_state.pt").write_bytes(b"")  # ds_to_universal's output
    err = refusal(str(deepspeed / "global_step2"))
    assert "a DeepSpeed universal checkpoint" in err and '"load_universal": true}, save_checkpoint' in err, err
    assert not (tmp_path / "out").exists()


def test_a_new_export_leaves_nothing_of_an_earlier_one_a_loader_would_read(ckpt: str, tmp_path: Path) -> None:
    """As save_pretrained: the earlier export's shards the new one lacks, and the other form's single file or index
    (which from_pretrained reads first, or mixes in), go; the user's files stay."""
    out = tmp_path / "hf"
    shards = convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size="20KB")
    assert len(shards) > 3, shards
    (out / "README.md").write_text("mine")
    fewer = convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size="40KB")
    assert 1 < len(fewer) < len(shards) and _listing(out).keys() == {*fewer, "README.md"}, _listing(out)
    single = convert_zero_checkpoint_to_fp32_state_dict(ckpt, out)
    assert single == ["model.safetensors"] and _listing(out).keys() == {"model.safetensors", "README.md"}
    again = convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size="40KB")
    assert _listing(out).keys() == {*again, "README.md"}  # the single file would shadow the shards
