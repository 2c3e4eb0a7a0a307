"""A damaged DeepSpeed universal checkpoint ([Note: universal checkpoints]) is refused naming the file: a
per-parameter file of another shape, a missing master-weight or optimizer-state file ([Note: a universal
checkpoint's missing files]), a model-states file that is not a pickle. The checkpoint is written here in
ds_to_universal's layout (DeepSpeed's own output is tested in tests/compat/test_universal.py, `-m slow`)."""

from __future__ import annotations

import os
import re
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from helpers.parity import TINY
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.format import MASTER
from zeroshard.checkpoint.reshard import OPTIM
from zeroshard.checkpoint.universal import UniversalReader
from zeroshard.models.gpt import GPT

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _universal(root: Path, flat: bool = False) -> Path:
    """ds_to_universal's output for `GPT(TINY)` (tied head) after 2 Adam steps at ZeRO-2 (`flat`: ZeRO-3's flat
    per-parameter tensors)."""
    torch.manual_seed(0)
    module = GPT(TINY).state_dict()
    trainable = OrderedDict((n, t.shape) for n, t in module.items() if n != "lm_head.weight")
    tag_dir = root / "global_step2_universal"
    torch.save(
        {
            "module": module,
            "buffer_names": [],
            "param_shapes": [trainable],
            "frozen_param_shapes": OrderedDict(),
            "shared_params": {"lm_head.weight": "wte.weight"},
            "lr_scheduler": None,
            "global_steps": 2,
            "global_samples": 4,
            "skipped_steps": 0,
            "dp_world_size": 1,
            "mp_world_size": 1,
            "ds_config": {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}},
            "ds_version": "0.19.8",
        },
        _path(tag_dir / "mp_rank_00_model_states.pt"),
    )
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}]
    torch.save(
        {"zero_stage": 2, "param_groups": groups, "loss_scaler": None}, _path(tag_dir / "zero" / "optimizer_state.pt")
    )
    for name in trainable:
        for k, state in enumerate(STATES):
            value = module[name].float() + k
            torch.save(
                {"cat_dim": 0, "param": value.reshape(-1) if flat else value}, _path(_file(tag_dir, name, state))
            )
        torch.save(torch.tensor(2.0), _file(tag_dir, name, "step"))
    (root / "latest_universal").write_text(tag_dir.name)
    return tag_dir


def _path(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _file(tag_dir: Path, name: str, state: str) -> Path:
    return tag_dir / "zero" / name / f"{state}.pt"


def _master(tag_dir: Path, name: str) -> torch.Tensor:
    reader = UniversalReader(str(tag_dir))
    out = torch.empty(reader.metadata.tensors[name].numel)
    reader.read_range(OPTIM, name, 0, out.numel(), out, state=MASTER)
    return out


def test_a_per_parameter_file_of_another_shape_is_refused_naming_it(tmp_path: Path) -> None:
    """wte's fp32.pt over wpe's loaded wte's first rows; a file of the same size and another shape loaded its values
    in the wrong order. ZeRO-3's flat files (same number of elements) load."""
    tag_dir = _universal(tmp_path / "u")
    torch.manual_seed(0)
    assert torch.equal(_master(tag_dir, "wpe.weight"), GPT(TINY).state_dict()["wpe.weight"].reshape(-1))
    shutil.copy(_file(tag_dir, "wte.weight", "fp32"), _file(tag_dir, "wpe.weight", "fp32"))
    wpe = re.escape(str(_file(tag_dir, "wpe.weight", "fp32")))
    with pytest.raises(
        CheckpointError, match=rf"^{wpe}: a tensor of shape \(64, 32\) where the parameter has \(16, 32\)"
    ):
        _master(tag_dir, "wpe.weight")
    mlp = "blocks.0.mlp.{}.weight"
    shutil.copy(_file(tag_dir, mlp.format(2), "exp_avg"), _file(tag_dir, mlp.format(0), "exp_avg"))
    reader = UniversalReader(str(tag_dir))
    with pytest.raises(CheckpointError, match=r"mlp\.0\.weight/exp_avg\.pt: a tensor of shape \(32, 128\) where"):
        reader.read_range(OPTIM, mlp.format(0), 0, 8, torch.empty(8), state="exp_avg")
    flat = _universal(tmp_path / "zero3", flat=True)
    stored = torch.load(_file(flat, "wpe.weight", "fp32"), weights_only=False)["param"]
    assert stored.dim() == 1 and torch.equal(_master(flat, "wpe.weight"), stored)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("fp32", "where every trainable parameter has one"),
        ("exp_avg", "where the other parameters of its group have one"),
    ],
    ids=["fp32", "exp_avg"],
)
def test_a_missing_state_file_is_refused_before_anything_is_read(tmp_path: Path, state: str, message: str) -> None:
    """DeepSpeed's loader reads whatever files a folder holds: a deleted fp32.pt kept the module's weights, a deleted
    exp_avg.pt a zero moment. Refused at open, which `load_checkpoint` reports as nothing loaded."""
    tag_dir = _universal(tmp_path)
    os.remove(_file(tag_dir, "blocks.1.mlp.0.weight", state))
    missing = re.escape(str(_file(tag_dir, "blocks.1.mlp.0.weight", state)))
    with pytest.raises(CheckpointError, match=rf"^{missing}: missing, {message}; .*ds_to_universal"):
        UniversalReader(str(tag_dir))


def test_a_checkpoint_without_moments_still_loads_its_master_weights(tmp_path: Path) -> None:
    """Another optimizer's run (ds_to_universal extracts Adam's moments only) has none anywhere: as before, the
    master weights load and the optimizer state starts fresh."""
    tag_dir = _universal(tmp_path)
    for path in (tag_dir / "zero").glob("*/exp_avg*.pt"):
        path.unlink()
    reader = UniversalReader(str(tag_dir))
    assert reader.metadata.optimizer is not None and reader.metadata.optimizer.elementwise == {}
    assert _master(tag_dir, "ln_f.weight").numel() == 32


def test_a_model_states_file_that_is_not_a_pickle_is_named(tmp_path: Path) -> None:
    tag_dir = _universal(tmp_path)
    path = tag_dir / "mp_rank_00_model_states.pt"
    path.write_bytes(b"\x80\x04garbage")
    with pytest.raises(
        CheckpointError, match=rf"^{re.escape(str(path))}: cannot be read \(UnpicklingError: .*\); the file is corrupt"
    ):
        UniversalReader(str(tag_dir))


def test_load_checkpoint_refuses_a_missing_moment_with_nothing_loaded(tmp_path: Path) -> None:
    """Through `load_checkpoint` (`load_universal`, one rank, in this process): the whole checkpoint loads its
    moments; without one parameter's exp_avg.pt it is refused, nothing loaded, instead of training on a zero one."""
    import zeroshard
    from zeroshard.utils.tensor_fragment import safe_get_full_optimizer_state

    tag_dir = _universal(tmp_path)
    torch.manual_seed(5)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    config |= {"zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": True}}
    engine, *_ = zeroshard.initialize(model=GPT(TINY), config=config)
    engine.load_checkpoint(str(tmp_path))
    wpe = dict(engine.module.named_parameters())["wpe.weight"]
    saved = torch.load(_file(tag_dir, "wpe.weight", "exp_avg"), weights_only=False)["param"]
    assert torch.equal(safe_get_full_optimizer_state(wpe, "exp_avg"), saved)
    os.remove(_file(tag_dir, "wpe.weight", "exp_avg"))
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"refused, nothing was loaded: .*wpe\.weight/exp_avg\.pt: missing"):
        engine.load_checkpoint(str(tmp_path))
    assert all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
    engine.destroy()
