"""Activation checkpointing: Hugging Face's gradient checkpointing under ZeRO-3 against a non-checkpointed
single-process reference, and `zeroshard.checkpointing`'s ways of keeping inputs (plain, partitioned, CPU,
contiguous) against the same function without checkpointing, with the activation bytes each keeps."""

from __future__ import annotations

import functools

import torch
from torch import nn

from helpers.harness import run_on_ranks

MODES = ("none", "hf_nonreentrant", "hf_reentrant", "call_nonreentrant", "call_reentrant", "call_zeroshard")
STEPS, MICRO, SEQ = 3, 2, 16


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


class _CheckpointCall(nn.Module):
    """Checkpoints the layer's `__call__`, so its hooks run again in the recompute (transformers 5 checkpoints
    `forward`, keeping module hooks outside; older versions, Megatron and hand-written loops do not)."""

    def __init__(self, layer: nn.Module, fn: object):
        super().__init__()
        self.layer, self.fn = layer, fn

    def forward(self, hidden: torch.Tensor, **kwargs: object) -> object:
        return self.fn(functools.partial(self.layer.__call__, **kwargs), hidden)  # type: ignore[operator]


def _with_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    from torch.utils.checkpoint import checkpoint

    from zeroshard import checkpointing

    if mode.startswith("hf_"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "hf_reentrant"})
    elif mode.startswith("call_"):
        fn = {
            "call_nonreentrant": functools.partial(checkpoint, use_reentrant=False),
            "call_reentrant": functools.partial(checkpoint, use_reentrant=True),
            "call_zeroshard": checkpointing.checkpoint,
        }[mode]
        model.model.layers = nn.ModuleList([_CheckpointCall(layer, fn) for layer in model.model.layers])
    return model.train()


def _batches(world_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (MICRO * world_size, SEQ), generator=g) for _ in range(STEPS)]


def _stage3(rank: int, world_size: int) -> dict[str, list]:
    import zeroshard
    from zeroshard.utils import safe_get_full_grad

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,  # every unit is released after use: re-gathers are visible
            "stage3_prefetch_bucket_size": 20_000,
        },
    }
    results: dict[str, list] = {}
    for mode in MODES:
        engine, _, _, _ = zeroshard.initialize(model=_with_checkpointing(_llama(), mode), config=config)
        units = engine.strategy.units
        steps = []
        for ids in _batches(world_size):
            mine = ids[MICRO * rank : MICRO * (rank + 1)]
            before, gathers = engine.comm_stats.snapshot(), [u.gathers for u in units]
            loss = engine(input_ids=mine, labels=mine, use_cache=False).loss
            engine.backward(loss)
            calls = engine.comm_stats.snapshot()["all_gather"]["calls"] - before["all_gather"]["calls"]
            per_unit = [u.gathers - g for u, g in zip(units, gathers, strict=True)]
            named = engine.module.named_parameters()
            grads = {n.replace(".layer.", "."): safe_get_full_grad(p).clone() for n, p in named}
            engine.step()
            steps.append((loss.item(), grads, calls, per_unit, list(engine.strategy.schedule.trace.recorded or [])))
        engine.destroy()
        results[mode] = steps
    return results


def _reference(world_size: int) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    model = _llama().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for ids in _batches(world_size):
        opt.zero_grad()
        losses = []
        for r in range(world_size):
            mine = ids[MICRO * r : MICRO * (r + 1)]
            loss = model(input_ids=mine, labels=mine, use_cache=False).loss
            (loss / world_size).backward()
            losses.append(loss.item())
        out.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


def test_hf_llama_gradient_checkpointing_under_stage3_matches_reference():
    reference = _reference(2)
    results = run_on_ranks(_stage3, 2)
    for rank, by_mode in enumerate(results):
        plain_calls = [s[2] for s in by_mode["none"]]
        for mode, steps in by_mode.items():
            for step, ((loss, grads, calls, per_unit, _), (ref_losses, ref_grads)) in enumerate(
                zip(steps, reference, strict=True)
            ):
                assert abs(loss - ref_losses[rank]) <= 1e-6 * abs(ref_losses[rank]), (mode, step, loss)
                assert grads.keys() == ref_grads.keys(), mode
                for name, grad in grads.items():
                    rel = (grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30)
                    assert rel <= 1e-6, (mode, step, name, float(rel))
                # one gather for forward, one shared by the recompute and the backward: as without checkpointing
                assert per_unit == [2] * len(per_unit), (mode, step, per_unit)
                assert calls == plain_calls[step], (mode, step, calls, plain_calls)
            # the recorded trace (recompute included) is what later steps follow: it stays the same
            assert steps[1][4] == steps[2][4], mode
        reentrant_trace = by_mode["call_reentrant"][2][4]
        layer_unit = 1
        assert reentrant_trace.count(layer_unit) == 3, reentrant_trace  # forward, recompute, backward


class _MPU:
    """Both ranks form one model-parallel group (as tensor-parallel replicas holding the same activation)."""

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def get_model_parallel_group(self) -> object:
        return None

    def get_data_parallel_rank(self) -> int:
        return 0


KEEPING = {
    "checkpoint": {},
    "partitioned": {"partition_activations": True},
    "cpu": {"checkpoint_in_cpu": True},
    "partitioned_cpu": {"partition_activations": True, "checkpoint_in_cpu": True},
    "contiguous": {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 4},
}
HIDDEN, TOKENS, BLOCKS = 64, 96, 4  # 96 x 64 fp32: 24 KiB per checkpointed input


def _blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * HIDDEN, HIDDEN))
        for _ in range(BLOCKS)
    )


def _run(blocks: nn.ModuleList, checkpoint: object | None) -> tuple[dict[str, torch.Tensor], int]:
    from helpers.activations import saved_activation_bytes

    torch.manual_seed(5)  # dropout: the recompute must draw the same mask
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    blocks.zero_grad()
    with saved_activation_bytes(blocks) as saved:
        h = x
        for block in blocks:
            h = h + (checkpoint(block, h) if checkpoint is not None else block(h))  # type: ignore[operator]
    h.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in blocks.named_parameters()}
    grads["input"] = x.grad.clone()
    return grads, saved.total


def _keeping(rank: int, world_size: int) -> dict[str, tuple]:
    import zeroshard
    from zeroshard import checkpointing

    zeroshard.init_distributed()
    blocks = _blocks()
    plain, plain_bytes = _run(blocks, None)
    out: dict[str, tuple] = {"plain": (plain, plain_bytes, 0, 0)}
    for name, options in KEEPING.items():
        checkpointing.configure(_MPU(), **options)
        checkpointing.reset()
        grads, saved = _run(blocks, checkpointing.checkpoint)
        stats = checkpointing.stats()
        assert stats.device_bytes == 0 and stats.host_bytes == 0, name  # all restored in backward
        out[name] = (grads, saved, stats.peak_device_bytes, stats.peak_host_bytes)
    # initialize configures checkpointing from the config's block (over its mpu: test_tensor_parallel.py)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "activation_checkpointing": {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True},
    }
    zeroshard.initialize(model=nn.Linear(2, 2), config=config)
    settings = checkpointing.settings()
    assert settings.cpu_checkpointing and settings.synchronize_checkpoint_boundary
    assert not settings.partition_activations
    return out


def test_checkpoint_modes_give_the_plain_gradients_and_keep_what_they_say():
    results = run_on_ranks(_keeping, 2)
    per_input = TOKENS * HIDDEN * 4
    for by_mode in results:
        plain = by_mode["plain"][0]
        for mode, (grads, _, _, _) in by_mode.items():
            for name, grad in grads.items():
                rel = (grad - plain[name]).norm() / plain[name].norm()
                assert rel <= 1e-6, (mode, name, float(rel))
        kept = {mode: (saved, device, host) for mode, (_, saved, device, host) in by_mode.items()}
        # measured per mode: (saved by autograd, kept on the device, kept in host memory)
        assert kept["plain"][0] >= BLOCKS * per_input * 8, kept  # pre- and post-GELU, mask, ... per block
        assert kept["checkpoint"] == (0, BLOCKS * per_input, 0), kept  # each block's input, whole
        assert kept["partitioned"] == (0, BLOCKS * per_input // 2, 0), kept  # half of it on each of 2 ranks
        assert kept["cpu"] == (0, 0, BLOCKS * per_input), kept
        assert kept["partitioned_cpu"] == (0, 0, BLOCKS * per_input // 2), kept
        assert kept["contiguous"] == (0, BLOCKS * per_input // 2, 0), kept
