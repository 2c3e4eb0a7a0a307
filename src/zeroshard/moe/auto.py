"""`expert_parallel` (DeepSpeed's AutoEP): a Hugging Face MoE model's experts split over expert-parallel ranks.

[Note: AutoEP]
`"expert_parallel": {"enabled": true, "autoep_size": N}` splits every experts module of a transformers 5 MoE
model (Mixtral, Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS, GLM-4-MoE, ...: the fused `[E, ...]` experts
that transformers' `use_experts_implementation` marks) over N consecutive ranks; each expert stays
data-parallel over the `world / N` ranks that hold it ([Note: expert groups], "D + E" with
`use_data_before_expert_parallelism`). Where DeepSpeed swaps the whole MoE block for its own router and experts
(per-model presets that re-implement the routing; GPT-OSS has none), zeroshard keeps the model's router, shared
experts and experts code and moves only the routed rows ([Note: routed rows] in moe/parallel_experts.py): the
losses are the single-process model's, and state_dict keys stay the Hugging Face names ([Note: expert
checkpoints] in moe/checkpoint.py). Then the experts train as `MoE` layers' do ([Note: experts under ZeRO]; ZeRO 1-2,
`offload_optimizer` cpu too; at ZeRO-3 [Note: experts at stage 3] in moe/stage3.py).
- Read: enabled, autoep_size; preset_model (checked against `config.model_type`), moe_layer_pattern (a
  `fullmatch` on block names; without it every marked experts module), expert_pattern (the block's experts
  child, "experts"), router_pattern / shared_experts_pattern / shared_experts_gate_pattern / expert_w1-3 (checked
  to exist), num_experts_attr / top_k_attr / top_k (checked against the model).
- Routing overrides (score_func, score_apply, route_norm, route_scale, routed_scaling_factor, expert groups,
  expert_activation, has_shared_experts) would change the model's routing: accepted at their "auto"/unset
  defaults and where they state what the model does (DeepSpeed's preset values for it), refused otherwise;
  load_balance_coeff and expert_tensor_parallel_size != 1 are refused, as DeepSpeed refuses them. A block the
  pattern matches that has no experts (DeepSeek's dense first layers) is skipped, as DeepSpeed skips it.
- Every forward of every rank must call each split experts module (the exchanges are collective): a block that
  calls its experts for some batches only (Ernie-4.5-VL's vision experts run when the batch holds image tokens)
  needs `moe_layer_pattern` naming the blocks every forward runs. `generate()` keeps the ranks in step
  ([Note: generation at stage 3]). An engine without an optimizer is refused (it would checkpoint this rank's
  experts as if they were all).
- DeepSpeed's kernel and transport choices (grouped GEMM, Triton, DeepEP, its split-plan overlap) select code
  zeroshard does not have; set to other than their defaults they get one warning naming them (the model's own
  `experts_implementation` computes the experts).

[Note: AutoEP under zero_init]
Built whole, every rank of a Mixtral-8x7B holds all 47B parameters before its experts are split. Built under
`zeroshard.zero_init()` from a checkpoint (`from_pretrained(folder)`), the experts are meta tensors that know their
checkpoint tensor ([Note: weights of a meta model] in loading/weights.py): the split keeps this rank's rows as
a meta slice and tells the checkpoint to read those rows (`StreamedWeights.keep_rows`: an element offset into the
whole tensor, fused from per-expert tensors where the file stores them apart). At stage 3 each experts unit then
reads only its shard of those rows ([Note: streaming load]); at stages 1-2 each rank reads its experts' rows and the
rest of the model whole. A meta model built from a config has nothing to read its experts from: refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from zeroshard.config.parse import misspelt
from zeroshard.errors import ConfigError
from zeroshard.loading.weights import weights_covering
from zeroshard.moe.groups import ExpertGroups
from zeroshard.moe.parallel_experts import ParallelExperts
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

_READ = {
    "enabled",
    "autoep_size",
    "preset_model",
    "moe_layer_pattern",
    "expert_pattern",
    "router_pattern",
    "shared_experts_pattern",
    "shared_experts_gate_pattern",
    "expert_w1",
    "expert_w2",
    "expert_w3",
    "num_experts_attr",
    "top_k_attr",
    "top_k",
}
# the model's routing decides these; DeepSpeed's re-implementation can override them
_ROUTING = {
    "score_func": "auto",
    "score_apply": "auto",
    "route_norm": None,
    "route_scale": 1.0,
    "routed_scaling_factor": "auto",
    "num_expert_groups": None,
    "num_limited_groups": None,
    "expert_activation": None,
    "has_shared_experts": None,
}
_KERNELS = {
    "use_grouped_mm": True,
    "disable_triton_grouped_mm": False,
    "gate_up_impl": "separate",
    "combine_impl": "auto",
    "row_weighting_impl": "auto",
    "comm_backend": "comm",
    "comm_num_sm": 12,
    "comm_qp_margin": 4,
    "comm_max_tokens_per_rank": 0,
    "async_split_plan": False,
    "validate_folding_routing": False,
}
# DeepSpeed 0.19.8's presets and the model types each accepts (module_inject/auto_ep_presets)
PRESETS = {
    "mixtral": ("mixtral",),
    "qwen3_moe": ("qwen3_moe", "qwen2_moe"),
    "qwen3_5_moe": ("qwen3_5_moe_text",),
    "deepseek_v2": ("deepseek_v2",),
    "deepseek_v3": ("deepseek_v3",),
    "minimax_m3": ("minimax_m3_vl_text",),
}


@dataclass(frozen=True)
class AutoEp:
    """The `expert_parallel` block as read ([Note: AutoEP])."""

    size: int
    block: Mapping[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.block.get(key, default)


def autoep_of(block: Mapping[str, Any] | None, quiet: bool = False) -> AutoEp | None:
    """The block, checked; None without it or when not enabled. Pure but for a warning (none when `quiet`: the
    check `resolve_config` makes, [Note: blocks checked by their readers])."""
    block = dict(block or {})
    known = _READ | set(_ROUTING) | set(_KERNELS) | {"expert_tensor_parallel_size", "load_balance_coeff", "enabled"}
    unknown = sorted(set(block) - known)
    typo = "enabled" not in block and misspelt("expert_parallel", unknown, {"enabled"})
    if typo:  # a misspelt "enabled" would turn AutoEP off unnoticed (other keys of a block that is off: ignored)
        raise ConfigError(typo)
    if block.get("load_balance_coeff") is not None:  # DeepSpeed refuses it even when disabled
        raise ConfigError(
            "expert_parallel.load_balance_coeff is not supported (as in DeepSpeed): the model's own "
            "router_aux_loss_coef adds the load-balancing loss; remove the key"
        )
    enabled = block.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"expert_parallel.enabled={enabled!r}: expected true or false")
    if not enabled:
        return None
    if unknown:
        raise ConfigError(
            misspelt("expert_parallel", unknown, known)
            or f"expert_parallel: unknown keys {unknown}; see DeepSpeed's AutoEP config for the names"
        )
    size = block.get("autoep_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"expert_parallel.autoep_size={size!r}: expected a positive int (ranks per set of experts)")
    if block.get("expert_tensor_parallel_size", 1) != 1:
        raise ConfigError("expert_parallel.expert_tensor_parallel_size must be 1 (as in DeepSpeed); remove the key")
    preset = block.get("preset_model")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"expert_parallel.preset_model={preset!r}: expected one of {sorted(PRESETS)} or null")
    top_k = block.get("top_k", "auto")
    if top_k != "auto" and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ConfigError(f'expert_parallel.top_k={top_k!r}: expected "auto" or a positive int')
    for key in ("moe_layer_pattern", "expert_pattern", "router_pattern", "shared_experts_pattern"):
        if key in block and block[key] is not None and (not isinstance(block[key], str) or not block[key]):
            raise ConfigError(f"expert_parallel.{key}={block[key]!r}: expected a non-empty string")
    for key in ("expert_pattern", "router_pattern", "shared_experts_pattern", "shared_experts_gate_pattern"):
        if "." in str(block.get(key) or ""):
            raise ConfigError(f"expert_parallel.{key}={block[key]!r}: a child attribute name, without dots")
    kernels = sorted(k for k, default in _KERNELS.items() if k in block and block[k] != default)
    if kernels and not quiet:
        log_rank(
            logger,
            30,
            f"expert_parallel: {', '.join(kernels)} choose DeepSpeed's own kernels or transport, which zeroshard does "
            "not have: the model's experts_implementation computes the experts and torch.distributed's all-to-all "
            "moves the rows ([Note: AutoEP])",
        )
    return AutoEp(size, block)


@dataclass(frozen=True)
class Surroundings:
    """What else the engine is built with, for `refuse_combinations`."""

    stage: int
    backend: str
    offload: str  # offload_optimizer.device
    world: int
    tp: int = 1
    sp: int = 1
    has_optimizer: bool = True
    node_local: bool = False  # checkpoint.use_node_local_storage
    autocast: bool = False  # torch_autocast.enabled


def refuse_combinations(autoep: AutoEp, around: Surroundings, model: nn.Module) -> None:
    """What AutoEP does not train with here, in one line, before any work."""
    from zeroshard.pipe.module import PipelineModule

    if autoep.size == 1:
        return
    what = f"expert_parallel.autoep_size={autoep.size}"
    backend, tp, sp = around.backend, around.tp, around.sp
    if around.offload == "nvme":
        raise ConfigError(f'{what} does not combine with offload_optimizer "nvme" yet; use "cpu"')
    if around.world % autoep.size:
        raise ConfigError(f"{what} must divide the number of ranks ({around.world})")
    if around.node_local:
        raise ConfigError(
            f"{what} with checkpoint.use_node_local_storage: not supported (each node's leader would write its own "
            "experts only); save to a folder every node sees, or remove the key"
        )
    if around.autocast:  # (zero/from_config.py refuses it for every split strategy at stages 1-2)
        raise ConfigError(f"{what} with torch_autocast: not implemented; use bf16 or fp16 mixed precision")
    if not around.has_optimizer:
        raise ConfigError(
            f"{what} without an optimizer: an engine for inference only would save and load this rank's experts "
            "as if they were all; give the config an optimizer, or build the model without expert_parallel"
        )
    if backend == "fsdp2":
        raise ConfigError(f'{what} with zeroshard.backend "fsdp2": not implemented; use the "zero" backend')
    if tp > 1:
        raise ConfigError(f"{what} with tensor parallelism (autotp_size or an mpu): tp x ep is not implemented")
    if sp > 1:
        raise ConfigError(f"{what} with sequence parallelism: not implemented; use one of them")
    if isinstance(model, PipelineModule):
        raise ConfigError(f"{what} with a PipelineModule: give MoE layers (zeroshard.moe.MoE) as LayerSpecs instead")
    meta = any(p.is_meta for p in model.parameters())
    experts = (
        [p for *_, module in find_experts(model, autoep) for p in module.parameters(recurse=False)] if meta else []
    )
    if any(p.is_meta and weights_covering(p) is None for p in experts):
        raise ConfigError(
            f"{what} with a model built on the meta device (zeroshard.zero_init()) whose experts no checkpoint holds "
            "(built from a config, or layers the checkpoint lacks): its experts can be split only as they are read "
            "from a checkpoint; build it with from_pretrained(folder) of a checkpoint with every expert, or without "
            "zero_init"
        )


def is_fused_experts(module: nn.Module) -> bool:
    """transformers 5's `use_experts_implementation` marks its experts classes (fused `[E, ...]` weights, called
    with `(hidden_states, top_k_index, top_k_weights)`)."""
    return hasattr(module, "is_concatenated") and isinstance(getattr(module, "num_experts", None), int)


def find_experts(model: nn.Module, autoep: AutoEp) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """(block name, block, experts attribute, experts module) of every MoE block to split."""
    pattern, attr = autoep.get("moe_layer_pattern"), autoep.get("expert_pattern") or "experts"
    found = []
    for name, block in model.named_modules():
        experts = block._modules.get(attr)
        if pattern is not None:
            if not re.fullmatch(pattern, name):
                continue
            if experts is None:  # a dense layer the pattern also matches (DeepSeek's first): skipped, as DeepSpeed
                continue
            if not isinstance(getattr(experts, "num_experts", None), int):
                raise ConfigError(
                    f"expert_parallel: {name}.{attr} (matched by moe_layer_pattern) has no int num_experts; set "
                    "expert_pattern to the block's experts attribute"
                )
        elif experts is None or not is_fused_experts(experts):
            continue
        found.append((name, block, attr, experts))
    if not found:
        where = f"matching moe_layer_pattern {pattern!r}" if pattern is not None else f"with an experts child {attr!r}"
        raise ConfigError(
            f"expert_parallel: no MoE block {where} in {type(model).__name__}: AutoEP splits transformers 5's fused "
            "experts modules (Mixtral, Qwen-MoE, DeepSeek, GPT-OSS, ...); for your own layers use zeroshard.moe.MoE"
        )
    return found


def _check_model(model: nn.Module, autoep: AutoEp, found: list[tuple[str, nn.Module, str, nn.Module]]) -> None:
    config = getattr(model, "config", None)
    preset = autoep.get("preset_model")
    model_type = getattr(config, "model_type", None)
    if preset is not None and model_type not in PRESETS[preset]:
        raise ConfigError(
            f"expert_parallel.preset_model={preset!r} is for model types {list(PRESETS[preset])}, the model is "
            f"{model_type!r}; remove preset_model (zeroshard finds the experts itself) or fix it"
        )
    for key in ("num_experts_attr", "top_k_attr"):
        attr = autoep.get(key)
        if attr is not None and not hasattr(config, attr):
            raise ConfigError(f"expert_parallel.{key}={attr!r}: the model's config has no such attribute")
    for name, block, _, experts in found:
        routing = _model_routing(config, block)
        for key, default in _ROUTING.items():
            value, stated = autoep.get(key, default), routing.get(key)
            if value in (default, "auto") or value == stated:
                continue
            does = f"routes with {stated!r}" if stated is not None else "has no such setting zeroshard can read"
            raise ConfigError(
                f"expert_parallel.{key}={value!r}, but {name} {does}: zeroshard routes with the model's own router "
                "and experts ([Note: AutoEP]); set it in the model's config, or remove the key"
            )
        for key in ("router_pattern", "shared_experts_pattern", "shared_experts_gate_pattern"):
            child = autoep.get(key)
            if child is not None and child not in block._modules:
                raise ConfigError(f"expert_parallel.{key}={child!r}: block {name!r} has no such child")
        for key in ("expert_w1", "expert_w2", "expert_w3"):
            weight = autoep.get(key)
            if weight is not None and weight not in experts._parameters:
                raise ConfigError(f"expert_parallel.{key}={weight!r}: {name}'s experts have no such parameter")
        expected = getattr(config, autoep.get("num_experts_attr") or "", experts.num_experts)
        if expected != experts.num_experts:
            raise ConfigError(
                f"expert_parallel: {name} has {experts.num_experts} experts, config."
                f"{autoep.get('num_experts_attr')} says {expected}"
            )
        model_k = _model_top_k(config, block)
        for key, value in (("top_k", autoep.get("top_k", "auto")), ("top_k_attr", autoep.get("top_k_attr"))):
            if value in ("auto", None):
                continue
            stated = getattr(config, value, None) if key == "top_k_attr" else value
            if model_k is None or stated != model_k:
                routes = f"routes each token to {model_k} experts" if model_k else "has a router whose top-k is unknown"
                raise ConfigError(
                    f"expert_parallel.{key}={value!r} (top-k {stated}) but {name} {routes}; zeroshard routes with "
                    'the model\'s router: set num_experts_per_tok in its config, or remove the key (top_k "auto")'
                )


_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu_tanh"}
# how the routers of transformers 5's families score (read from their modeling files); others are not known here
_SCORING = {"deepseek_v3": "sigmoid", "glm4_moe": "sigmoid", "dots1": "sigmoid"}
_SCORING |= dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "olmoe", "gpt_oss"), "softmax")


def _model_routing(config: Any, block: nn.Module) -> dict[str, Any]:
    """What the model's own routing does, in DeepSpeed's AutoEP terms (None: not known here)."""
    scale = getattr(config, "routed_scaling_factor", 1.0)
    activation = _ACTIVATIONS.get(getattr(config, "hidden_act", ""))
    if hasattr(config, "swiglu_limit"):  # GPT-OSS's clamped GLU
        activation = "swiglu_oai"
    groups = {"num_expert_groups": getattr(config, "n_group", None)}
    groups["num_limited_groups"] = getattr(config, "topk_group", None)
    return {
        "score_func": getattr(config, "scoring_func", _SCORING.get(str(getattr(config, "model_type", "")))),
        "score_apply": "post",  # transformers' experts weight each expert's output
        "route_norm": getattr(config, "norm_topk_prob", True),
        "route_scale": scale,
        "routed_scaling_factor": scale,
        "expert_activation": activation,
        "has_shared_experts": any(k in block._modules for k in ("shared_expert", "shared_experts")),
        **groups,
    }


def _model_top_k(config: Any, block: nn.Module) -> int | None:
    """How many experts the block's router picks per token: the router's (or the block's) own `top_k`, else the
    config's `num_experts_per_tok` (None: not known here)."""
    routers = [block._modules.get(name) for name in ("gate", "router")]
    for holder in (*routers, block):
        value = getattr(holder, "top_k", None) if holder is not None else None
        if isinstance(value, int):
            return value
    value = getattr(config, "num_experts_per_tok", None)
    return value if isinstance(value, int) else None


def apply_autoep(model: nn.Module, autoep: AutoEp, data_first: bool) -> list[ParallelExperts]:
    """[Note: AutoEP] Split every MoE block's experts over `autoep.size` ranks, in place: each rank keeps its
    experts' rows of every `[E, ...]` parameter (the same `Parameter` objects) and the block calls a
    `ParallelExperts` in the experts' place. Collective (the groups): every rank, the same model."""
    found = find_experts(model, autoep)
    _check_model(model, autoep, found)
    for name, _, attr, experts in found:
        _check_experts(f"{name}.{attr}" if name else attr, experts, autoep.size)
    if autoep.size == 1:
        log_rank(logger, 20, f"expert_parallel: autoep_size 1, {len(found)} MoE block(s) stay data-parallel")
        return []
    groups = ExpertGroups(autoep.size)
    groups.use_topology(data_first)  # [Note: expert groups]: which experts this rank holds depends on it
    rank = groups.mesh.ep_rank(groups.rank)
    split = []
    for _, block, attr, experts in found:
        total = num_experts(experts)
        local = total // autoep.size
        for param in experts.parameters(recurse=False):
            if param.is_meta:  # [Note: AutoEP under zero_init]: these rows are what will be read
                weights = weights_covering(param)
                assert weights is not None, "refuse_combinations refused experts no checkpoint gives"
                weights.keep_rows(param, rank * local, local)
            param.data = param.data[rank * local : (rank + 1) * local].clone()  # the whole tensor is freed
        for buffer_name, buffer in list(experts.named_buffers(recurse=False)):
            if buffer.dim() and buffer.shape[0] == total:
                setattr(experts, buffer_name, buffer[rank * local : (rank + 1) * local].clone())
        setattr(experts, "num_experts", local)  # noqa: B010 - its own forward loops over its local experts
        wrapper = ParallelExperts(experts, groups, total)
        setattr(block, attr, wrapper)
        split.append(wrapper)
    log_rank(
        logger,
        20,
        f"expert_parallel: {len(split)} MoE block(s), {split[0].num_experts} experts split over {autoep.size} ranks "
        f"({split[0].num_local_experts} each), data-parallel over {groups.mesh.edp_size}",
    )
    return split


def num_experts(experts: nn.Module) -> int:
    """An experts module's `num_experts` (transformers' attribute)."""
    return int(getattr(experts, "num_experts"))  # noqa: B009 - not a Module attribute mypy knows


def _check_experts(name: str, experts: nn.Module, size: int) -> None:
    total = num_experts(experts)
    if total < size or total % size:
        raise ConfigError(
            f"expert_parallel.autoep_size={size} must divide the {total} experts of {name} (as in DeepSpeed: every "
            "rank holds the same number of experts)"
        )
    if any(child_params for child in experts.children() for child_params in child.parameters()):
        raise ConfigError(
            f"expert_parallel: {name} ({type(experts).__name__}) holds parameters in submodules; AutoEP splits "
            "fused [num_experts, ...] weights only"
        )
    for pname, param in experts.named_parameters(recurse=False):
        if param.dim() == 0 or param.shape[0] != total:
            raise ConfigError(
                f"expert_parallel: {name}.{pname} has shape {tuple(param.shape)}, not [{total}, ...]: AutoEP splits "
                "fused [num_experts, ...] weights only"
            )
