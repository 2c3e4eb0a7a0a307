"""zeroshard.hf.Accelerator's pieces that need no Accelerator (accelerate's state is process-wide), and the engine
calls accelerate makes under DeepSpeed. The Accelerator itself runs a script in tests/compat/test_scripts.py
(against DeepSpeed 0.19.8 on one process, against accelerate's DDP on 2 ranks)."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate.utils import DummyOptim, DummyScheduler
from accelerate.utils.dataclasses import DeepSpeedPlugin
from transformers import GPT2Config, GPT2LMHeadModel

import zeroshard
from zeroshard.config import parse_config
from zeroshard.errors import ConfigError
from zeroshard.hf.accelerator import EngineWrapper, _check_pairing, _hidden_size_values, _one_plugin


def _plugin(config: dict) -> DeepSpeedPlugin:
    return DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, **config})


def test_optimizer_and_scheduler_pairing_follows_accelerate() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    adamw = torch.optim.AdamW(params)
    dummy = DummyOptim(params)
    with pytest.raises(ConfigError, match="optimizer block and the script passes an optimizer"):
        _check_pairing({"optimizer": {}}, adamw, None)
    with pytest.raises(ConfigError, match="DummyOptim needs an optimizer block"):
        _check_pairing({}, dummy, None)
    with pytest.raises(ConfigError, match="scheduler block and the script passes a scheduler"):
        _check_pairing({"scheduler": {}}, None, torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 1.0))
    with pytest.raises(ConfigError, match="DummyScheduler needs a scheduler block"):
        _check_pairing({}, None, DummyScheduler(dummy))
    with pytest.raises(ConfigError, match="must be a DummyScheduler"):
        _check_pairing({"optimizer": {}}, dummy, torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 1.0))
    _check_pairing({"optimizer": {}, "scheduler": {}}, dummy, DummyScheduler(dummy))
    _check_pairing({}, None, DummyScheduler(dummy, lr_scheduler_callable=lambda opt: None))


def test_auto_buckets_come_from_the_hidden_size() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=32, n_positions=8))
    auto = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}
    values = _hidden_size_values(_plugin({"zero_optimization": auto}), model)
    assert values == {
        "zero_optimization.reduce_bucket_size": 64 * 64,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
    }
    with pytest.raises(ConfigError, match="no config.hidden_size"):
        _hidden_size_values(_plugin({"zero_optimization": auto}), torch.nn.Linear(2, 2))
    assert _hidden_size_values(_plugin({}), torch.nn.Linear(2, 2)) == {}


def test_one_plugin_per_accelerator() -> None:
    plugin = _plugin({})
    assert _one_plugin({"train": plugin}) is plugin
    with pytest.raises(ConfigError, match="2 DeepSpeed plugins given"):
        _one_plugin({"a": plugin, "b": _plugin({})})


def test_steps_per_print_infinity_means_never() -> None:
    """accelerate's plugin sets steps_per_print to inf (DeepSpeed then never prints)."""
    base = {"train_micro_batch_size_per_gpu": 1}
    assert parse_config({**base, "steps_per_print": math.inf}).steps_per_print is None
    assert parse_config({**base, "steps_per_print": 5}).steps_per_print == 5
    with pytest.raises(ConfigError, match="steps_per_print"):
        parse_config({**base, "steps_per_print": -math.inf})


def _engine(stage: int, gas: int, **extra: object) -> zeroshard.Engine:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        **extra,
    }
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    return engine


@pytest.mark.parametrize("managed", [True, False])
def test_set_gradient_accumulation_boundary_decides_where_steps_fall(managed: bool) -> None:
    """accelerate's loop under DeepSpeed: the boundary set before each backward, step() only on it. Three
    micro-batches in a window of gas 2 (accelerate ends a window at the end of the data) step once, after the
    third, on the mean of the three losses over gas. With `managed_gradient_accumulation: false` the wrapper sets no
    boundary (the engine refuses it there) and its step() ends the window."""
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    engine = _engine(stage=0, gas=2, managed_gradient_accumulation=managed)
    wrapper = EngineWrapper(engine)
    for i, x in enumerate(batches):
        wrapper.backward(engine(x).sum(), sync_gradients=i == 2)
        assert engine.global_steps == (i == 2)
    assert engine.global_steps == 1 and engine.was_step_applied()
    reference = _engine(stage=0, gas=2)  # the same initial weights
    loss = sum(reference.module(x).sum() for x in batches) / 2
    grads = torch.autograd.grad(loss, list(reference.module.parameters()))
    for p, q, g in zip(engine.module.parameters(), reference.module.parameters(), grads, strict=True):
        torch.testing.assert_close(p.detach(), q.detach() - 0.1 * g, rtol=1e-6, atol=1e-7)


def test_zero3_consolidated_16bit_state_dict_follows_deepspeed() -> None:
    engine = _engine(stage=3, gas=1)
    assert engine.zero_gather_16bit_weights_on_model_save()
    state = engine._zero3_consolidated_16bit_state_dict()
    assert state is not None and set(state) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert state["0.weight"].shape == (4, 4) and state["0.weight"].device.type == "cpu"  # DeepSpeed's: on the CPU
    torch.testing.assert_close(state, engine.consolidated_state_dict(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="requires ZeRO-3 mode"):
        _engine(stage=1, gas=1)._zero3_consolidated_16bit_state_dict()


def test_parallelism_config_ulysses_with_its_data_parallel_sizes_only() -> None:
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    from zeroshard.hf.accelerator import _ulysses_only

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    sp = ParallelismConfig(sp_backend="deepspeed", sp_size=2, dp_shard_size=2, sp_handler=handler)
    assert _ulysses_only(sp) is sp  # accelerate's ALST script sets dp_shard_size for sp x dp
    assert _ulysses_only(ParallelismConfig(sp_size=1)) is None
    with pytest.raises(ConfigError, match="tp_size or cp_size"):
        _ulysses_only(ParallelismConfig(tp_size=2))


def test_sequence_parallelism_refuses_recurrent_layers() -> None:
    """Linear-attention layers carry a state along the sequence that each rank would restart (accelerate's rule)."""
    from zeroshard.hf.ulysses import _refuse_recurrent_layers

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=32, n_positions=8))
    _refuse_recurrent_layers(model)
    model.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ConfigError, match="linear_attention"):
        _refuse_recurrent_layers(model)


def test_move_to_device_moves_what_has_a_to() -> None:
    from transformers import BatchEncoding

    from zeroshard.runtime.utils import move_to_device

    moved = move_to_device({"a": [torch.zeros(2)], "b": BatchEncoding({"ids": torch.ones(1)}), "n": 3}, "meta")
    assert moved["a"][0].is_meta and moved["b"]["ids"].is_meta and moved["n"] == 3
