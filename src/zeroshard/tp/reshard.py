"""Load a tensor-parallel checkpoint into another tensor-parallel size: slices concatenated and split at read time.

[Note: tensor-parallel resharding]
A checkpoint saved with `autotp_size=A` holds each split parameter as A slices `<key>.tp<j>of<A>` ([Note:
tensor-parallel checkpoints]); an engine with `autotp_size=B` asks for `<key>.tp<i>of<B>` (or `<key>` whole when
B is 1, and a checkpoint saved without tensor parallelism holds `<key>` whole: A is 1). Every split is an even
split of one dimension d (colwise projections and lm_head: d=0, the output features; rowwise: d=1, the input
features; the vocab-parallel embedding: d=0, the rows), so target slice i is rows [i*S/B, (i+1)*S/B) of the A
source slices concatenated along d. The dimension is derived at load, not recorded: the engine knows its slice's
shape (a DTensor's local shape, or the whole tensor with B=1) and the checkpoint its slices', and two even
splits of one tensor by A != B differ in exactly d (`shard_dim`; anything else is refused by key). Checkpoints
written before this existed therefore load too.

`ReslicingReader` presents the checkpoint under the engine's names (metadata tensors and optimizer groups
renamed), so the generic load path ([Note: resharding at load]) is unchanged: it asks for element ranges of the
target slices (whole slices for module weights, a rank's ZeRO range for master weights and Adam's moments) and
each is assembled from the overlapping element ranges of the source slices (`read_resliced`). Viewing the tensor
as [outer, S, inner] (outer: the dimensions before d), a split of d=0 maps a range to one contiguous range per
overlapping source, read exactly; for d>0 each source contributes a [rows, S/A, inner] block covering the range's
outer rows, read in one call (a stored piece with a CRC is streamed whole per call anyway) and narrowed in memory.
The fsdp2 backend names slices the same way and reads through the same path. DTensor Shard placements are plain
splits by definition; the slices of an mpu's Megatron-marked model (fused qkv and the like) need not be, so a
checkpoint or engine with those is refused when the sizes differ (`caller_split`). A fused layer split in `k`
equal parts ([Note: fused sub-parameters] in tp/plan.py, recorded as `extra["tensor_parallel_blocks"]`) holds a
piece of each part per slice: viewing dim d as [k, S/k], the parts are one more outer dimension ([outer * k, S/k,
inner]) and the pieces plain splits of S/k, so the same reading applies. Both sides must cut the layer into the
same parts (a whole tensor, tp 1, has none); otherwise, and when the parts differ at the same size, the load is
refused by key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import CheckpointMetadata, OptimizerInfo, TensorInfo
from zeroshard.checkpoint.reshard import CheckpointReader
from zeroshard.tp.checkpoint import base_of, slice_name, tp_size_of

ReadSource = Callable[[int, int, int, torch.Tensor], None]  # (source index, begin, end, 1-D out)


@dataclass(frozen=True)
class Reslice:
    """Target slice `position` of `parts` of a tensor of shape `full` split along `dim`, from the checkpoint's
    `sources` (its slices in position order; one source: the whole tensor)."""

    sources: tuple[str, ...]
    full: tuple[int, ...]
    dim: int
    position: int
    parts: int
    blocks: int = 1  # equal parts of `dim` each slice holds a piece of ([Note: fused sub-parameters])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n // self.parts if d == self.dim else n for d, n in enumerate(self.full))


def shard_dim(key: str, source: tuple[int, ...], a: int, target: tuple[int, ...], b: int) -> int:
    """The dimension along which a slice of shape `source` (one of `a`) and one of `target` (one of `b`) split
    the same tensor ([Note: tensor-parallel resharding])."""
    differ = [d for d, (s, t) in enumerate(zip(source, target, strict=False)) if s != t]
    if len(source) != len(target) or len(differ) != 1 or source[differ[0]] * a != target[differ[0]] * b:
        raise CheckpointError(
            f"{key}: the checkpoint's slices have shape {source} (autotp_size={a}) and this engine's {target} "
            f"(autotp_size={b}); they are not even splits of one dimension of the same tensor, so the slices cannot "
            f"be resharded; load it with autotp_size={a}"
        )
    return differ[0]


def read_resliced(r: Reslice, begin: int, end: int, out: torch.Tensor, read: ReadSource) -> None:
    """Elements [begin, end) of target slice `r` (flattened) into the 1-D `out`; `read(j, lo, hi, buf)` reads
    elements [lo, hi) of source j. See [Note: tensor-parallel resharding]. Pure: tested without a checkpoint."""
    if begin >= end:
        return
    outer, size = math.prod(r.full[: r.dim]) * r.blocks, r.full[r.dim] // r.blocks
    inner = math.prod(r.full[r.dim + 1 :])
    a = len(r.sources)
    sa, sb = size // a, size // r.parts
    first, last = r.position * sb, (r.position + 1) * sb  # the target's rows of `dim`, in the whole tensor
    if outer == 1:  # sources are consecutive ranges of the whole flattened tensor
        lo_full, hi_full = first * inner + begin, first * inner + end
        for j in range(a):
            lo, hi = max(lo_full, j * sa * inner), min(hi_full, (j + 1) * sa * inner)
            if lo < hi:
                read(j, lo - j * sa * inner, hi - j * sa * inner, out[lo - lo_full : hi - lo_full])
        return
    row = sb * inner  # elements of one outer row of the target slice
    o0, o1 = begin // row, -(-end // row)
    block = torch.empty((o1 - o0, sb, inner), dtype=out.dtype, device=out.device)
    for j in range(a):
        lo, hi = max(first, j * sa), min(last, (j + 1) * sa)
        if lo >= hi:
            continue
        source = torch.empty((o1 - o0, sa, inner), dtype=out.dtype, device=out.device)
        read(j, o0 * sa * inner, o1 * sa * inner, source.view(-1))
        block[:, lo - first : hi - first].copy_(source[:, lo - j * sa : hi - j * sa])
    out.copy_(block.view(-1)[begin - o0 * row : end - o0 * row])


def plan_reslices(
    meta: CheckpointMetadata,
    infos: Mapping[str, TensorInfo],
    caller_split: bool = False,
    blocks: Mapping[str, int] | None = None,
) -> dict[str, Reslice]:
    """The engine's tensor names whose tensor-parallel slicing differs from the checkpoint's, each with its
    recipe; empty when the sizes agree. `infos`: the engine's tensors (its own and its peers' slices);
    `caller_split`: the engine's slices are an mpu model's own (not DTensors), as are those of a checkpoint whose
    metadata says so: neither is resharded; `blocks`: the engine's fused layers' parts by key, checked against the
    checkpoint's."""
    saved, now = tp_size_of(list(meta.tensors)), tp_size_of(list(infos))
    saved_blocks, now_blocks = dict(meta.extra.get("tensor_parallel_blocks", {})), dict(blocks or {})
    if saved == now:
        if saved != 1 and saved_blocks != now_blocks:
            key = sorted(set(saved_blocks.items()) ^ set(now_blocks.items()))[0][0]
            raise CheckpointError(_blocks_differ(meta.tag, key, saved_blocks, now_blocks))
        return {}
    if caller_split or meta.extra.get("tensor_parallel_caller_split"):
        raise CheckpointError(
            f"checkpoint {meta.tag}: saved with model-parallel size {saved}, this engine has {now}, and "
            f"{'this engine' if caller_split else 'the saving engine'} holds slices of a model split by the caller "
            "(initialize(mpu=...) with Megatron-marked tensors, whose layout zeroshard does not know): not "
            f"resharded; load it with model-parallel size {saved}"
        )
    for sizes, where in ((saved, "checkpoint"), (now, "engine")):
        if isinstance(sizes, list):
            raise CheckpointError(
                f"the {where}'s tensors are sliced for several autotp_size values {sizes}; a checkpoint written by "
                "one zeroshard engine has one, so this one cannot be resharded"
            )
    assert isinstance(saved, int) and isinstance(now, int)  # lists were refused above
    a, b = saved, now
    bases = {base_of(name) for name in [*meta.tensors, *infos] if base_of(name) != name}
    plans: dict[str, Reslice] = {}
    for base in sorted(bases):
        sources = _names(base, a, meta.tensors)
        targets = _names(base, b, infos)
        if not sources or not targets or len(sources) == len(targets):
            continue  # missing on one side (a non-strict load reports it) or sliced alike
        src, tgt = meta.tensors[sources[0]].shape, infos[targets[0]].shape
        dim = shard_dim(base, tuple(src), len(sources), tuple(tgt), len(targets))
        full = tuple(n * len(sources) if d == dim else n for d, n in enumerate(src))
        cuts = [int(saved_blocks.get(base, 1))] if len(sources) > 1 else []  # (a whole tensor has no parts)
        cuts += [int(now_blocks.get(base, 1))] if len(targets) > 1 else []
        if len(set(cuts)) > 1:
            raise CheckpointError(_blocks_differ(meta.tag, base, saved_blocks, now_blocks))
        parts = cuts[0] if cuts else 1
        for i, name in enumerate(targets):
            plans[name] = Reslice(tuple(sources), full, dim, i, len(targets), parts)
    return plans


def _blocks_differ(tag: str, key: str, saved: Mapping[str, int], now: Mapping[str, int]) -> str:
    return (
        f"checkpoint {tag}: {key} was split in {saved.get(key, 1)} equal part(s) per slice and this engine splits it "
        f"in {now.get(key, 1)} ([Note: fused sub-parameters]); the slices cannot be matched: load it with the "
        "saving engine's layer specs (tensor_parallel.partition_config)"
    )


def _names(base: str, tp: int, names: Mapping[str, TensorInfo]) -> list[str]:
    sliced = [slice_name(base, j, tp) for j in range(tp)]
    if tp > 1 and all(name in names for name in sliced):
        return sliced
    return [base] if base in names else []


def _renamed(meta: CheckpointMetadata, plans: dict[str, Reslice]) -> CheckpointMetadata:
    """`meta` with the engine's slice names for the planned tensors (shapes, optimizer groups); pieces and files
    keep the stored names the reader reads."""
    sources = {s for plan in plans.values() for s in plan.sources}
    tensors = {name: info for name, info in meta.tensors.items() if name not in sources}
    targets_of: dict[str, list[str]] = {}
    for name, plan in plans.items():
        tensors[name] = dataclasses.replace(meta.tensors[plan.sources[0]], shape=plan.shape)
        targets_of.setdefault(plan.sources[0], []).append(name)
    optimizer = meta.optimizer
    if optimizer is not None:
        groups = []
        for group in optimizer.groups:
            params = [t for p in group["params"] for t in targets_of.get(p, [] if p in sources else [p])]
            groups.append({**group, "params": params})
        optimizer = OptimizerInfo(optimizer.cls, dict(optimizer.elementwise), groups)
    return dataclasses.replace(meta, tensors=tensors, optimizer=optimizer)


class ReslicingReader(CheckpointReader):
    """[Note: tensor-parallel resharding] a checkpoint read under another tensor-parallel size's names."""

    def __init__(self, inner: CheckpointReader, plans: dict[str, Reslice]):
        super().__init__(inner.tag_dir, _renamed(inner.metadata, plans))
        self._files = inner._files  # shares the open files: the caller's `with` on `inner` closes them
        self.plans = plans

    def has(self, store: str, name: str) -> bool:
        plan = self.plans.get(name)
        if plan is None:
            return super().has(store, name)
        return all(super(ReslicingReader, self).has(store, s) for s in plan.sources)

    def read_range(
        self, store: str, name: str, begin: int, end: int, out: torch.Tensor, state: str | None = None
    ) -> None:
        plan = self.plans.get(name)
        if plan is None:
            super().read_range(store, name, begin, end, out, state)
            return

        def read(j: int, lo: int, hi: int, buf: torch.Tensor) -> None:
            super(ReslicingReader, self).read_range(store, plan.sources[j], lo, hi, buf, state)

        read_resliced(plan, begin, end, out, read)

    def stored_dtype(self, store: str, name: str, state: str | None = None) -> torch.dtype:
        plan = self.plans.get(name)
        return super().stored_dtype(store, plan.sources[0] if plan is not None else name, state)

    def stream(self, store: str, name: str, state: str | None = None) -> Iterator[torch.Tensor]:
        plan = self.plans.get(name)
        if plan is None:
            yield from super().stream(store, name, state)
            return
        numel, step = math.prod(plan.shape), _STREAM_ELEMENTS
        buffer = torch.empty(min(step, numel), dtype=self.stored_dtype(store, name, state))
        for begin in range(0, numel, step):
            end = min(begin + step, numel)
            self.read_range(store, name, begin, end, buffer[: end - begin], state)
            yield buffer[: end - begin]


_STREAM_ELEMENTS = 1 << 22  # a resliced tensor streamed in chunks of this many elements (the export's bound)


def whole_reader(reader: CheckpointReader) -> CheckpointReader:
    """`reader` with each tensor-parallel slice set joined into the whole tensor under its own name, for the offline
    export ([Note: tensor-parallel resharding] at autotp_size 1); `reader` itself without slices. A checkpoint that
    does not record its split dimensions (written before they were, or an mpu's Megatron slices) is refused."""
    meta = reader.metadata
    tp = tp_size_of(list(meta.tensors))
    if tp == 1:
        return reader
    dims = meta.extra.get("tensor_parallel_dims")
    if isinstance(tp, list) or meta.extra.get("tensor_parallel_caller_split") or not isinstance(dims, dict):
        raise CheckpointError(
            f"{reader.tag_dir}: a tensor-parallel checkpoint (slices of autotp_size {tp}) that does not record how its "
            "slices join (an mpu's own split, or written before zeroshard recorded it): load it into an engine (any "
            "autotp_size) and call engine.save_16bit_model(...), or save it again from an engine without "
            "tensor_parallel"
        )
    infos: dict[str, TensorInfo] = {}
    for name, info in meta.tensors.items():
        base = base_of(name)
        if base != name and base not in infos:
            dim = int(dims[base])
            whole = tuple(n * tp if d == dim else n for d, n in enumerate(info.shape))
            infos[base] = dataclasses.replace(info, shape=whole)
    return ReslicingReader(reader, plan_reslices(meta, infos))


def tensor_parallel_reader(
    reader: CheckpointReader,
    infos: Mapping[str, TensorInfo],
    caller_split: bool = False,
    blocks: Mapping[str, int] | None = None,
) -> CheckpointReader:
    """`reader` itself when the checkpoint's tensor-parallel slicing is the engine's, else a `ReslicingReader`."""
    plans = plan_reslices(reader.metadata, infos, caller_split, blocks)
    return ReslicingReader(reader, plans) if plans else reader
