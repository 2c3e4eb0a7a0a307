"""DeepSpeed's `get_state_devices(engine, state)`: the host while `offload_states()` holds a kind away, else where
its tensors are (here on the meta device, to tell them from the host)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zeroshard.errors import ZeroshardError
from zeroshard.offload.states import StateOffloader
from zeroshard.runtime.zero.offload_states import OffloadStateTypeEnum, get_state_devices


def test_state_devices_follow_the_offloader_and_the_tensors() -> None:
    moments = [torch.zeros(4)]
    tensors = {"optim_states": moments, "lp_params": [torch.empty(2, device="meta")]}
    engine = SimpleNamespace(strategy=SimpleNamespace(offloadable=lambda: tensors), _offloader=StateOffloader())
    assert get_state_devices(engine, OffloadStateTypeEnum.lp_params) == {torch.device("meta")}
    assert get_state_devices(engine, "contiguous_grad_buffer") == set()
    engine._offloader.offload(tensors, ["optim_states"], torch.device("cpu"), False, False)
    assert engine._offloader.holds("optim_states") and not engine._offloader.holds("lp_params")
    assert get_state_devices(engine, OffloadStateTypeEnum.optim_states) == {torch.device("cpu")}
    with pytest.raises(ZeroshardError, match="unknown state"):
        get_state_devices(engine, "everything")
    with pytest.raises(ZeroshardError, match="holds no training state"):
        get_state_devices(SimpleNamespace(strategy=None), OffloadStateTypeEnum.hp_params)
