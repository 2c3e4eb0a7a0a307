"""`initialize`'s tensor-parallel path: the `tensor_parallel` block, the refusals, the mesh, the split model.

[Note: tensor_parallel config]
DeepSpeed's AutoTP training block is `"tensor_parallel": {"autotp_size": N}`: N ranks split each layer, the
world's other dimension is data-parallel ([Note: tensor-parallel mesh]). zeroshard reads `autotp_size`, accepts
DeepSpeed's `tp_overlap_comm: false` and `keep_module_on_host` (which only affect DeepSpeed's own injection), and
reads its own `loss_parallel` ([Note: vocab-parallel loss] in tp/plan.py), DeepSpeed's `vocab_parallel_lm_head` and
`vocab_parallel_ce_backend` ([Note: vocabulary-parallel LM head]), and `partition_config` / `preset_model`
(the layer specs that replace the Hugging Face plan, [Note: autotp layer specs] in tp/specs.py); other keys are
refused by name. Tensor
parallelism composes with ZeRO stages 0-2 on the "zero" backend (ZeRO over the data-parallel dimension,
[Note: tensor-parallel norm]) and with the fsdp2 backend at its stages ([Note: tensor parallelism on fsdp2]);
stage 3 on the zero backend, offload, autotp_size with a PipelineModule (an mpu's split layers in one are
3D parallelism: [Note: 3D mesh] in pipe/three_d.py) and MoE layers with ep_size > 1 are refused before any work,
each in one line. An `initialize(mpu=...)` beside autotp_size (DeepSpeed's AutoTP training example passes both) is
taken where its groups are the autotp mesh's, and refused naming the groups otherwise (`autotp_mpu`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.config import ZeroshardConfig
from zeroshard.config.parse import misspelt
from zeroshard.errors import ConfigError
from zeroshard.tp.mesh import TensorParallelContext

KEYS = {
    "autotp_size",
    "tp_overlap_comm",
    "keep_module_on_host",
    "loss_parallel",
    "vocab_parallel_lm_head",
    "vocab_parallel_ce_backend",
    "partition_config",
    "preset_model",
}


def autotp_size(block: Mapping[str, Any] | None) -> int:
    """`tensor_parallel.autotp_size` (1 without the block), after checking the block's keys."""
    block = dict(block or {})
    unknown = sorted(set(block) - KEYS)
    if unknown:
        raise ConfigError(
            misspelt("tensor_parallel", unknown, KEYS)
            or f"tensor_parallel: keys {unknown} are not supported; zeroshard reads autotp_size, loss_parallel, "
            "vocab_parallel_lm_head, vocab_parallel_ce_backend, partition_config and preset_model (tp_overlap_comm: "
            "false and keep_module_on_host are accepted)"
        )
    if block.get("tp_overlap_comm"):
        raise ConfigError("tensor_parallel.tp_overlap_comm=true is not supported; set it to false")
    size = block.get("autotp_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ConfigError(f"tensor_parallel.autotp_size={size!r}: expected a positive int (the ranks per layer)")
    return max(size, 1)  # DeepSpeed's default 0 means no tensor parallelism


def loss_parallel_of(block: Mapping[str, Any] | None) -> bool:
    """`tensor_parallel.loss_parallel` (ours, default false): [Note: vocab-parallel loss]."""
    value = dict(block or {}).get("loss_parallel", False)
    if not isinstance(value, bool):
        raise ConfigError(f"tensor_parallel.loss_parallel={value!r}: expected true or false")
    return value


def local_vocab_head_of(block: Mapping[str, Any] | None) -> bool:
    """`tensor_parallel.vocab_parallel_lm_head` (DeepSpeed's; null, its default, is false here: DeepSpeed turns it
    on by itself only for a tied output head, which zeroshard refuses to split) and `vocab_parallel_ce_backend`,
    checked together with `loss_parallel`: [Note: vocabulary-parallel LM head]."""
    block = dict(block or {})
    value = block.get("vocab_parallel_lm_head")
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"tensor_parallel.vocab_parallel_lm_head={value!r}: expected true, false or null")
    backend = block.get("vocab_parallel_ce_backend", "torch")
    if backend not in ("torch", "liger"):
        raise ConfigError(f'tensor_parallel.vocab_parallel_ce_backend={backend!r}: expected "torch" or "liger"')
    if backend != "torch" and not value:
        raise ConfigError(
            f'tensor_parallel.vocab_parallel_ce_backend="{backend}" needs vocab_parallel_lm_head true (it is the loss '
            "of a no-gather vocabulary-parallel head); drop the key or set vocab_parallel_lm_head true"
        )
    if value and loss_parallel_of(block):
        raise ConfigError(
            "tensor_parallel: vocab_parallel_lm_head and loss_parallel both keep the logits vocabulary-sharded "
            "(local tensors with DeepSpeed's loss, or DTensors with torch's); set one of them"
        )
    return bool(value)


def tp_degree(cfg: ZeroshardConfig, mpu: Any) -> int:
    """The model-parallel degree the batch arithmetic divides the world by."""
    if mpu is not None:
        from zeroshard.tp.mpu import check_mpu

        check_mpu(mpu)
        return int(mpu.get_model_parallel_world_size())
    return autotp_size(cfg.tensor_parallel)


def autotp_mpu(cfg: ZeroshardConfig, mpu: Any) -> Any:
    """The mpu `initialize` goes on with where the config also sets `tensor_parallel.autotp_size` > 1, as DeepSpeed's
    AutoTP training example passes both: an mpu whose groups are the autotp mesh's ([Note: tensor-parallel mesh]:
    consecutive ranks per tensor-parallel group, every autotp_size-th rank per data-parallel one) says the same thing
    twice, and AutoTP splits the model over that mesh (None); any other mpu is refused, naming the groups.
    Collective-free; every rank decides alike when every rank's mpu describes the same layout."""
    tp = autotp_size(cfg.tensor_parallel)
    if mpu is None or tp == 1:
        return mpu
    import torch.distributed as dist

    from zeroshard.tp.mesh import TensorParallelGrid
    from zeroshard.tp.mpu import check_mpu

    check_mpu(mpu)
    grid, rank = TensorParallelGrid(tp, dist.get_world_size()), dist.get_rank()
    want = (grid.tp_ranks(grid.dp_index(rank)), grid.dp_ranks(grid.tp_index(rank)))
    got = tuple(_ranks(group) for group in (mpu.get_model_parallel_group(), mpu.get_data_parallel_group()))
    if got != want:
        raise ConfigError(
            f"initialize(mpu=...) with tensor_parallel.autotp_size {tp}: the mpu's tensor-/data-parallel groups of "
            f"rank {rank} are {got[0]} / {got[1]}, not the autotp mesh's {want[0]} / {want[1]}; pass one of them "
            "(the mpu's model already split, or autotp_size to split a Hugging Face model)"
        )
    return None


def _ranks(group: Any) -> list[int] | None:
    import torch.distributed as dist

    try:
        return list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, AttributeError, TypeError, KeyError):  # (not a process group)
        return None


def refuse_unsupported(cfg: ZeroshardConfig, model: nn.Module, tp: int, mpu: Any) -> None:
    """[Note: tensor_parallel config] one line per combination not implemented, before any work."""
    stage, what = int(cfg.zero_optimization.stage), ("initialize(mpu=...)" if mpu is not None else "")
    what = what or f"tensor_parallel.autotp_size={tp}"
    fsdp2 = str(cfg.zeroshard.backend) == "fsdp2"
    if stage == 3 and not fsdp2:
        raise ConfigError(
            f'{what} with zero_optimization.stage 3 on the "zero" backend: not implemented; set "zeroshard": '
            '{"backend": "fsdp2"} (FSDP2 over the data-parallel dimension) or use stage 1 or 2'
        )
    if fsdp2 and mpu is not None:
        raise ConfigError(
            'initialize(mpu=...) with zeroshard.backend "fsdp2": FSDP2 needs the tensor-parallel device mesh; use '
            'tensor_parallel.autotp_size, or the "zero" backend with the mpu'
        )
    z = cfg.zero_optimization
    if str(z.offload_optimizer.device) != "none" or str(z.offload_param.device) != "none":
        raise ConfigError(f"{what} does not combine with offload_optimizer / offload_param yet; set their device none")
    from zeroshard.moe.zero import moe_layers
    from zeroshard.pipe.module import PipelineModule

    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(
            f"{what} with a model on the meta device (built under zeroshard.zero_init()): build it with real "
            "weights (from_pretrained without zero_init) so the tensor-parallel plan can split them"
        )
    if isinstance(model, PipelineModule) and mpu is None:
        raise ConfigError(
            f"{what} with a PipelineModule: autotp x pp is not implemented; split the layers yourself and pass "
            "initialize(mpu=...) ([Note: 3D mesh]), or use one of them"
        )
    if any(layer.ep_size > 1 for layer in moe_layers(model)):
        raise ConfigError(f"{what} with MoE layers of ep_size > 1: tp x ep is not implemented; use one of them")


def build_tp(
    cfg: ZeroshardConfig, model: nn.Module, world: Collectives, device: torch.device, mpu: Any, stages: int = 1
) -> TensorParallelContext | None:
    """None without tensor parallelism; else this rank's mesh context, the model split in place (autotp) or
    taken as the mpu split it ([Note: mpu groups]; `stages` > 1 with a PipelineModule: [Note: 3D mesh]).
    Collective: every rank, the same config."""
    tp = tp_degree(cfg, mpu)
    if mpu is None and tp == 1:
        return None
    refuse_unsupported(cfg, model, tp, mpu)
    if mpu is not None:
        from zeroshard.tp.mpu import context_from_mpu

        return context_from_mpu(mpu, world, stages)
    from zeroshard.tp.plan import apply_tensor_parallel, model_plan
    from zeroshard.tp.vocab_head import install_vocab_parallel_loss, local_logits

    loss_parallel, local_head = loss_parallel_of(cfg.tensor_parallel), local_vocab_head_of(cfg.tensor_parallel)
    plan = model_plan(model, tp, cfg.tensor_parallel, loss_parallel or local_head)  # refuses before the mesh exists
    if local_head:
        plan = local_logits(model, plan)
    context = TensorParallelContext.create(world, tp, device, loss_parallel)
    assert context.tp_mesh is not None
    apply_tensor_parallel(model, context.tp_mesh, loss_parallel or local_head, plan)
    if local_head:
        install_vocab_parallel_loss(model, context.tp_comm, dict(cfg.tensor_parallel or {}))
    return context


def follow_split(
    model: nn.Module, names: dict[int, str], optimizer: Any, model_parameters: Iterable[Any] | None
) -> Iterable[Any] | None:
    """`parallelize_module` replaced the model's parameter objects with DTensors: a client optimizer's groups and
    `model_parameters` that hold the old objects (`names`: id -> name before the split) now hold the new ones.
    Returns `model_parameters` remapped (the optimizer is remapped in place)."""
    current = dict(model.named_parameters())

    def new(params: Any) -> list[Any]:
        items = [params] if isinstance(params, torch.Tensor) else list(params)
        return [current[names[id(p)]] if id(p) in names else p for p in items]

    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            group["params"] = new(group["params"])
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if items and all(isinstance(item, Mapping) for item in items):
        return [{**item, "params": new(item["params"])} for item in items]
    return new(items)
