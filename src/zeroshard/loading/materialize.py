"""Meta-device parameters and buffers made real: read from a checkpoint, or initialised by their modules."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import cast

import torch
from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.loading.replay import Replay, bindings, init_after, module_seed, seeded, share_bindings
from zeroshard.loading.weights import StreamedWeights


def initialise(
    modules: dict[str, nn.Module], names: Sequence[str], params: Sequence[nn.Parameter], device: torch.device, seed: int
) -> None:
    """Meta-device parameters become real, initialised by their modules' own reset_parameters() (and a Hugging Face
    root's `_init_weights`) under a seed shared by every rank; stage 3 calls this one unit at a time."""
    if not any(p.is_meta for p in params):
        return
    owners = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n in names})
    with seeded(torch.initial_seed() + seed, device):  # the device's generator put back too (manual_seed reseeds all)
        for owner in owners:
            init_module(modules[owner], modules[""], device)
    for p in params:
        if p.is_meta:
            make_real(p, device, zero=True)


def init_module(module: nn.Module, root: nn.Module, device: torch.device) -> None:
    """A module's own meta-device parameters made real (also those another unit will shard later) and initialised
    as its code did under `zero_init` ([Note: initialisation recorded under zero_init]; a Hugging Face model's
    `_init_weights` included); those without such a record by `reset_parameters()` and the root's `_init_weights`,
    under the module's own seed where it has records (else the unit's). Its
    real parameters keep their values: a weight tied to a module initialised earlier (a head's weight tied to the
    embedding, beside the head's own bias), or values a `GatheredParameters` block kept before initialize. A module
    with nothing on the meta device is left alone."""
    own = {n: p for n, p in module._parameters.items() if p is not None}
    meta = {n: p for n, p in own.items() if p.is_meta}
    if not meta:
        return
    kept = [(p, p.detach().clone()) for p in own.values() if not p.is_meta]
    recorded = bindings(module, meta)
    with swappable(module):
        for p in meta.values():  # zeros, not empty memory, where no initialiser writes (a custom module's parameter)
            make_real(p, device, zero=True)
    unrecorded = len(recorded) < len(meta)
    seed = module_seed(module)
    with seeded(seed, device) if seed is not None else nullcontext():
        reset = getattr(module, "reset_parameters", None)
        if unrecorded and callable(reset):
            reset()
        if recorded:
            Replay(device).fill([(meta[n], b) for n, b in recorded.items()])
        init = getattr(root, "_init_weights", None)
        if callable(init) and (unrecorded or init_after(init)):
            init(module)
    with torch.no_grad():
        for p, value in kept:
            p.copy_(value)


def materialize_adapters(model: nn.Module) -> list[nn.Parameter]:
    """PEFT creates the LoRA adapters of a meta base model (built under `zero_init`) on the meta device too; they
    are small, so they become real here with PEFT's own initialisation (lora_B zero: training starts from the base
    model), the same on every rank (the seed is shared). Left to `initialise`, lora_B got `reset_parameters()`'s
    values and the adapted model started away from its base. Returns the parameters made real."""
    made: list[nn.Parameter] = []
    configs = getattr(model, "peft_config", None)
    if not configs:
        return made
    for module in model.modules():
        tokens = getattr(module, "trainable_tokens_delta", None)
        if isinstance(tokens, nn.ParameterDict) and any(p.is_meta for p in tokens.values()):
            raise ConfigError(
                "PEFT's trainable_token_indices around a model built under zero_init: their deltas start as rows of "
                "the base embedding, which stays on the meta device until initialize (they were zeros); train the "
                "embedding with modules_to_save instead, or build the base model without zero_init"
            )
        reset = getattr(module, "reset_lora_parameters", None)
        if not callable(reset):
            continue
        dora = getattr(module, "lora_magnitude_vector", None)
        if dora is not None and any(p.is_meta for p in dora.parameters()):
            raise ConfigError(
                "LoRA with use_dora=True around a model built under zero_init: DoRA's magnitudes are computed from "
                "the base weights, which stay on the meta device until initialize; build the base model without "
                "zero_init, or use plain LoRA"
            )
        parts = [getattr(module, n, None) for n in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")]
        dicts = [d for d in parts if isinstance(d, nn.ModuleDict | nn.ParameterDict)]
        for name in dict.fromkeys(k for d in dicts for k in d.keys()):
            fresh = [p for d in dicts if name in d for p in _params(d[name]) if p.is_meta]
            if not fresh:
                continue
            for p in fresh:
                make_real(p, torch.device("cpu"), zero=True)
            # the adapter's own `init_lora_weights` (True, "gaussian", or False: the layers' default initialisation)
            init = getattr(configs.get(name), "init_lora_weights", True)
            if isinstance(init, str) and init.lower() != "gaussian":
                raise ConfigError(
                    f"LoRA adapter {name!r} with init_lora_weights={init!r} around a model built under zero_init: "
                    "that initialisation reads the base weights, which stay on the meta device until initialize; "
                    "use True or 'gaussian', or build the base model without zero_init"
                )
            if init is False:
                for d in dicts:
                    if name in d and hasattr(d[name], "reset_parameters"):
                        cast(nn.Linear, d[name]).reset_parameters()
            else:
                reset(name, init)
            made += fresh
    return made


def share_with_saved_copies(model: nn.Module, weights: StreamedWeights | None) -> None:
    """PEFT's `modules_to_save` (a classification head, `lm_head`, `embed_tokens` trained in full beside LoRA) wraps
    the module and trains a `copy.deepcopy` of it, made on the meta device for a `zero_init` model: no checkpoint
    entry or record was the copy's, so it got `reset_parameters()` and trained from random values where PEFT's copy
    starts from the original's. Each copy's meta tensors now read the original's checkpoint tensors, or replay the
    original's records (its modules' seeds too), or take the values a block or a load kept in the original."""
    for wrapper in model.modules():
        original, copies = getattr(wrapper, "original_module", None), getattr(wrapper, "modules_to_save", None)
        if not isinstance(original, nn.Module) or not isinstance(copies, nn.ModuleDict):
            continue
        for copy in copies.values():
            share_bindings(copy, original)
            pairs: list[tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor]]] = []
            pairs += zip(original.named_parameters(), copy.named_parameters(), strict=False)
            pairs += zip(original.named_buffers(), copy.named_buffers(), strict=False)
            for (name, source), (copied_name, target) in pairs:
                if name != copied_name or not target.is_meta or source.shape != target.shape:
                    continue
                if not source.is_meta and isinstance(target, nn.Parameter):  # kept by a block or a load: those values
                    make_real(target, source.device)
                    with torch.no_grad():
                        target.copy_(source)
                elif weights is not None and weights.covers(source):
                    weights.alias(target, source)


def _params(entry: nn.Module | nn.Parameter) -> list[nn.Parameter]:
    return [entry] if isinstance(entry, nn.Parameter) else list(entry.parameters())


@contextmanager
def swappable(module: nn.Module) -> Iterator[None]:
    """torch's RNN layers hold weak references to their weights, which `swap_tensors` refuses ("Cannot swap t1
    because it has weakref"): dropped for the swap and made again after, as the layers' own `_apply` does."""
    if not isinstance(module, nn.RNNBase):
        yield
        return
    module._flat_weight_refs = []
    try:
        yield
    finally:
        module._init_flat_weights()


def make_real(param: nn.Parameter, device: torch.device, zero: bool = False) -> None:
    """Give a meta parameter real storage in place: the Python object (and every reference to it,
    tied weights included) stays the same; `.data =` cannot change a tensor's device type. Without `zero` the
    memory is not touched (a large allocation costs no resident memory until written)."""
    alloc = torch.zeros if zero else torch.empty
    swap_keeping_attributes(param, alloc(param.shape, dtype=param.dtype, device=device))


def swap_keeping_attributes(param: nn.Parameter, value: torch.Tensor) -> None:
    """`param` becomes a parameter over `value` (another device type, meta included) in place. torch's
    `swap_tensors` exchanges the objects' `__dict__` too: the attributes set on the parameter (Megatron's
    `tensor_model_parallel`, DeepSpeed's `ds_*`) are put back on it."""
    real = nn.Parameter(value, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, real)
    param.__dict__.update(real.__dict__)


def load_parameters(params: Sequence[nn.Parameter], weights: StreamedWeights | None) -> None:
    """Real parameters the checkpoint has are overwritten with its values (after `initialise`: those it lacks
    keep their initialisation, as transformers does for missing keys)."""
    if weights is not None:
        weights.read_whole([(p, p) for p in params if weights.covers(p)])


def materialize_parameters(root: nn.Module, weights: StreamedWeights | None, device: torch.device) -> None:
    """Stages 0-2 keep every parameter: each rank reads the whole checkpoint into real parameters; those the
    checkpoint lacks are initialised as `initialise` does (every rank alike)."""
    named = [(n, p) for n, p in root.named_parameters() if p.is_meta]
    loaded = [p for _, p in named if weights is not None and weights.covers(p)]
    for p in loaded:
        make_real(p, device)
    if weights is not None:
        weights.read_whole([(p, p) for p in loaded])
    rest = [(n, p) for n, p in named if p.is_meta]
    if rest:
        initialise(dict(root.named_modules()), [n for n, _ in rest], [p for _, p in rest], device, 0)


def materialize_buffers(root: nn.Module, weights: StreamedWeights | None, device: torch.device) -> None:
    """Buffers are small: real now, on every rank. From the checkpoint when it has them; else as the model's code
    computed them under `zero_init` ([Note: initialisation recorded under zero_init]: a causal mask, a BatchNorm's
    running variance, a rotary embedding's `inv_freq`); a parameter-less module's buffers without such a record by
    its init (and by `_init_weights` after the replay where transformers' initialisation could not be recorded);
    others are zeros until their unit's `initialise`."""
    computed: list[nn.Module] = []
    replay = Replay(device)
    after = init_after(getattr(root, "_init_weights", None))
    for module in root.modules():
        named = {n: b for n, b in module._buffers.items() if b is not None}
        recorded = bindings(module, {n: b for n, b in named.items() if b.is_meta})
        fills = []
        for name, buf in named.items():
            if buf.device == device:
                continue
            if not buf.is_meta:
                setattr(module, name, buf.to(device))
                continue
            real = torch.zeros_like(buf, device=device)
            if weights is not None and weights.covers(buf):
                weights.read_whole([(buf, real)])
            else:
                if name in recorded:
                    fills.append((real, recorded[name]))
                own = any(p is not None for p in module._parameters.values())
                if (name not in recorded or after) and not own and module not in computed:
                    computed.append(module)
            setattr(module, name, real)
        replay.fill(fills)
    init = getattr(root, "_init_weights", None)
    for module in computed:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        elif callable(init):
            init(module)
