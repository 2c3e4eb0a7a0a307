"""offload/states.py without a process group: DeepSpeed's names, the checks of `include` and `device`, and a copy
that fails part way ([Note: offloaded states])."""

from __future__ import annotations

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.errors import ZeroshardError
from zeroshard.offload.states import KINDS, StateOffloader, offload_device, offload_kinds
from zeroshard.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum


def test_the_enums_are_deepspeeds():
    import_deepspeed()
    from deepspeed.runtime.zero import offload_config

    for ours, theirs in (
        (OffloadStateTypeEnum, offload_config.OffloadStateTypeEnum),
        (OffloadDeviceEnum, offload_config.OffloadDeviceEnum),
    ):
        assert [(m.name, m.value, str(m), m == m.value) for m in ours] == [
            (m.name, m.value, str(m), m == m.value) for m in theirs
        ]


def test_include_and_device_are_checked():
    assert offload_kinds(None) == KINDS
    assert offload_kinds([OffloadStateTypeEnum.lp_grads, "optim_states"]) == ("optim_states", "lp_grads")
    assert offload_kinds("hp_params") == ("hp_params",)
    with pytest.raises(ZeroshardError, match="unknown state lp_param; the states are optim_states"):
        offload_kinds(["lp_param"])
    assert offload_device("cpu") == torch.device("cpu") == offload_device(OffloadDeviceEnum.cpu)
    assert offload_device(OffloadDeviceEnum.none) is None
    for device in (OffloadDeviceEnum.nvme, "cuda:1"):
        with pytest.raises(ZeroshardError, match="host memory only"):
            offload_device(device)


class _FailingSecond(StateOffloader):
    """The second host copy cannot be made (host memory exhausted)."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def _host(self, base: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
        self.made += 1
        if self.made == 2:
            raise RuntimeError("out of host memory")
        return super()._host(base, device, pin)


def test_a_copy_that_fails_part_way_moves_nothing():
    first, second = torch.arange(6.0), torch.ones(4)
    offloader = _FailingSecond()
    with pytest.raises(RuntimeError, match="out of host memory"):
        offloader.offload({"optim_states": [first, second]}, KINDS, torch.device("cpu"), False, False)
    assert not offloader.active and offloader.kinds == frozenset()
    assert first.untyped_storage().nbytes() == 24 and torch.equal(first, torch.arange(6.0))
    moved = offloader.offload({"optim_states": [first], "lp_grads": []}, KINDS, torch.device("cpu"), False, False)
    assert moved == {"optim_states"} and first.untyped_storage().nbytes() == 0
    assert offloader.host_bytes() == {"optim_states": 24}
    offloader.reload()
    assert torch.equal(first, torch.arange(6.0)) and not offloader.active


def test_a_parameters_host_copy_is_reused_only_once_no_one_holds_it():
    """The parameters view their host copies while away: a state_dict() taken then keeps a view, and the copy is not
    handed to another tensor's offload until it is dropped (its values would change under it)."""
    offloader = StateOffloader()
    copy = torch.zeros(8)
    offloader._viewed.add(id(copy))
    assert offloader._free(copy)
    held = copy[2:]  # what a state_dict() taken while offloaded holds
    assert not offloader._free(copy)
    del held
    assert offloader._free(copy) and offloader._free(torch.zeros(8))  # (state no one viewed: always)
