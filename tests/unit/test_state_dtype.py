"""fp32 optimizer state over bf16 masters ([Note: bf16 master weights] in optim/state_dtype.py), one process."""

from __future__ import annotations

import pytest
import torch

from zeroshard.config import parse_config
from zeroshard.optim import state_dtype
from zeroshard.precision.policy import PrecisionPolicy

ADAMS = [
    (torch.optim.AdamW, {"fused": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"foreach": True, "amsgrad": True}),
    (torch.optim.AdamW, {"foreach": False, "maximize": True}),
    (torch.optim.Adam, {"fused": True, "weight_decay": 0.1}),  # L2 weight decay
]


def _reference(cls, options, steps: int, grads: list[torch.Tensor], start: torch.Tensor):
    """DeepSpeedCPUAdam's arithmetic spelled out: an fp32 copy of the bf16 weights steps, and is rounded back."""
    weights = start.clone()
    shadow = torch.nn.Parameter(weights.float())
    optimizer = cls([shadow], lr=1e-2, **options)
    for step in range(steps):
        with torch.no_grad():
            shadow.copy_(weights)
        shadow.grad = grads[step].float()
        optimizer.step()
        weights.copy_(shadow.detach())
    return weights, optimizer.state[shadow]


@pytest.mark.parametrize(("cls", "options"), ADAMS)
def test_adam_in_chunks_equals_whole_fp32_copies(monkeypatch, cls, options):
    monkeypatch.setattr(state_dtype, "CHUNK", 128)  # 1000 elements: eight chunks (see CHUNK's comment)
    torch.manual_seed(0)
    start = torch.randn(1000, dtype=torch.bfloat16)
    grads = [torch.randn(1000, dtype=torch.bfloat16) for _ in range(3)]
    master = start.clone()
    optimizer = cls([master], lr=1e-2, **options)
    state_dtype.keep_state_in(optimizer, torch.float32)
    for grad in grads:
        master.grad = grad
        state_dtype.step(optimizer, [master])
    want, want_state = _reference(cls, options, 3, grads, start)
    assert torch.equal(master, want)
    state = optimizer.state[master]
    assert all(v.dtype == torch.float32 for v in state.values())
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key


def test_other_optimizers_step_whole_fp32_copies():
    torch.manual_seed(0)
    start = torch.randn(300, dtype=torch.bfloat16)
    grads = [torch.randn(300, dtype=torch.bfloat16) for _ in range(3)]
    master = start.clone()
    optimizer = torch.optim.SGD([master], lr=1e-2, momentum=0.9)
    state_dtype.keep_state_in(optimizer, torch.float32)
    for grad in grads:
        master.grad = grad
        state_dtype.step(optimizer, [master])
    want, want_state = _reference(torch.optim.SGD, {"momentum": 0.9}, 3, grads, start)
    assert torch.equal(master, want) and master.dtype == torch.bfloat16
    assert torch.equal(optimizer.state[master]["momentum_buffer"], want_state["momentum_buffer"])


def test_load_state_dict_keeps_the_fp32_state():
    """torch casts loaded state to its parameter's dtype (bf16 here); the hooks put the fp32 values back, and the
    next step runs (it failed with a dtype error before)."""
    master = torch.randn(50, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW([master], lr=1e-2, fused=True)
    state_dtype.keep_state_in(optimizer, torch.float32)
    master.grad = torch.randn(50, dtype=torch.bfloat16)
    state_dtype.step(optimizer, [master])
    saved = {k: v.clone() for k, v in optimizer.state[master].items()}
    optimizer.load_state_dict(optimizer.state_dict())
    for key, value in saved.items():
        assert optimizer.state[master][key].dtype == value.dtype and torch.equal(optimizer.state[master][key], value)
    state_dtype.step(optimizer, [master])
    assert int(optimizer.state[master]["step"]) == 2
    low = {k: v.bfloat16() if v.dim() else v for k, v in optimizer.state_dict()["state"][0].items()}
    optimizer.load_state_dict({**optimizer.state_dict(), "state": {0: low}})  # a bf16-state run's, converted
    assert {v.dtype for v in optimizer.state[master].values() if v.dim()} == {torch.float32}
    state_dtype.step(optimizer, [master])


@pytest.mark.parametrize(
    ("bf16", "params", "state"),
    [
        ({"bf16_master_weights_and_grads": True}, {}, torch.float32),
        ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, {}, None),
        ({"bf16_master_weights_and_grads": True}, {"fp32_optimizer_states": False}, None),  # DeepSpeedCPUAdam's key
        ({}, {"fp32_optimizer_states": False}, None),
    ],
)
def test_the_state_dtype_follows_the_keys(bf16, params, state):
    config = {
        "bf16": {"enabled": True, **bf16},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}},
    }
    policy = PrecisionPolicy.from_config(parse_config(config))
    assert policy.optimizer_state_dtype == state
    low = bool(bf16)
    assert policy.master_dtype == (torch.bfloat16 if low else torch.float32)
    assert policy.grad_accum_dtype == (torch.bfloat16 if low else torch.float32)
