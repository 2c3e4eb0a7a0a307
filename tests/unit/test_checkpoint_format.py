"""Checkpoint building blocks without a process group: safetensors I/O, metadata, sampler, export planning."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from zeroshard.checkpoint import CheckpointError, ResumableDistributedSampler
from zeroshard.checkpoint import safetensors_io as stio
from zeroshard.checkpoint.export import parse_size, plan_shards
from zeroshard.checkpoint.format import CheckpointMetadata, OptimizerInfo, PieceRef, TensorInfo
from zeroshard.checkpoint.reshard import CheckpointReader
from zeroshard.checkpoint.safetensors_io import SafetensorsReader, SafetensorsWriter, TensorSpec


def _write(path: str, tensors: dict[str, torch.Tensor], chunk: int | None = None) -> int:
    writer = SafetensorsWriter(path, [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    for t in tensors.values():
        flat = t.reshape(-1)
        step = chunk or max(flat.numel(), 1)
        for i in range(0, flat.numel(), step):
            writer.write(flat[i : i + step])
    return writer.close()


TENSORS = {
    "a": torch.randn(3, 5),
    "b": torch.randn(7).to(torch.bfloat16),
    "step": torch.tensor(4.0),
    "empty": torch.zeros(0, 3),
    "ids": torch.arange(10, dtype=torch.int64),
}


def test_roundtrip_chunks_and_safetensors_compatibility(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = str(tmp_path / "x.safetensors")
    _write(path, TENSORS, chunk=4)
    with SafetensorsReader(path) as reader:
        for name, t in TENSORS.items():
            assert torch.equal(reader.read(name), t), name
    with safe_open(path, "pt") as f:  # the reference library reads our files
        for name, t in TENSORS.items():
            assert torch.equal(f.get_tensor(name), t)
    theirs = str(tmp_path / "theirs.safetensors")
    save_file({k: v.contiguous() for k, v in TENSORS.items()}, theirs)
    with SafetensorsReader(theirs) as reader:  # and we read theirs (no CRCs there)
        assert torch.equal(reader.read("b"), TENSORS["b"])


def test_partial_read_converts_dtype_and_checks_crc(tmp_path, monkeypatch):
    monkeypatch.setattr(stio, "CHUNK_BYTES", 8)  # several chunks per tensor
    path = str(tmp_path / "x.safetensors")
    values = torch.randn(37)
    _write(path, {"v": values})
    out = torch.empty(20, dtype=torch.float64)
    with SafetensorsReader(path) as reader:
        reader.read_range("v", 9, 29, out)
        assert torch.equal(out, values[9:29].double())
        assert torch.equal(torch.cat(list(c.clone() for c in reader.stream("v"))), values)


def test_corruption_and_truncation_name_the_file(tmp_path):
    path = str(tmp_path / "x.safetensors")
    size = _write(path, {"v": torch.randn(64)})
    with open(path, "r+b") as f:  # flip one data byte
        f.seek(size - 10)
        byte = f.read(1)
        f.seek(size - 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with SafetensorsReader(path) as reader, pytest.raises(CheckpointError, match="x.safetensors.*checksum mismatch"):
        reader.read("v")
    os.truncate(path, size - 100)
    with pytest.raises(CheckpointError, match="x.safetensors.*truncated"):
        SafetensorsReader(path)
    with pytest.raises(CheckpointError, match="x.safetensors.*metadata says"):
        SafetensorsReader(path, expected_size=size)


def _with_header(path: str, header: object, data: bytes) -> None:
    import json
    import struct

    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("offsets", "shape_b", "extra", "said"),
    [
        ([[0, 16], [8, 24]], [2, 2], b"", "starts at data byte 8, where the previous tensor ends at 16"),  # overlap
        ([[0, 16], [17, 33]], [2, 2], b"\0", "starts at data byte 17"),  # a hole: misaligned
        ([[0, 16], [-16, 0]], [2, 2], b"", "non-negative integers"),  # into the header
        (
            [[0, 16], [16, 32]],
            [3, 2],
            b"",
            "of shape [3, 2] (F32) needs 24 bytes, but its data_offsets [16, 32) hold 16",
        ),
        ([[0, 16], [16, 32]], [2, 2], b"\0" * 8, "the tensors hold 32 bytes but the file has 40"),  # unindexed bytes
    ],
)
def test_a_model_files_header_that_safetensors_refuses_is_refused(tmp_path, offsets, shape_b, extra, said):
    """A model file carries no CRC of its header: overlapping offsets loaded another tensor's bytes, one into the
    header loaded the header's, a misaligned one NaNs, all without a word (safetensors and transformers refuse them)."""
    path = str(tmp_path / "model.safetensors")
    a = {"dtype": "F32", "shape": [2, 2], "data_offsets": offsets[0]}
    b = {"dtype": "F32", "shape": shape_b, "data_offsets": offsets[1]}
    _with_header(path, {"a": a, "b": b}, bytes(32) + extra)
    with pytest.raises(CheckpointError, match="model.safetensors: .*" + re.escape(said)):
        SafetensorsReader(path)
    for header, words in (([1, 2], "header is a JSON list"), ({"a": {"dtype": "F32"}}, "is not {dtype, shape")):
        _with_header(path, header, b"")
        with pytest.raises(CheckpointError, match=re.escape(words)):
            SafetensorsReader(path)


def _metadata(pieces: dict[str, list[PieceRef]]) -> CheckpointMetadata:
    return CheckpointMetadata(
        tag="t",
        world_size=2,
        zero_stage=2,
        compute_dtype="bfloat16",
        library_version="0",
        torch_version="0",
        batch={"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
        counters={"global_steps": 1, "global_samples": 8, "micro_steps": 1, "skipped_steps": 0},
        tensors={"w": TensorInfo((2, 5), "float32", "param", True, True)},
        aliases={"w2": "w"},
        excluded=[],
        model_pieces=pieces,
        optim_pieces={},
        optimizer=OptimizerInfo(
            "AdamW", {"exp_avg": "float32"}, [{"options": {"lr": 0.1}, "params": ["w"], "scalars": {}}]
        ),
        files={f: {"bytes": 0} for f in {p.file for refs in pieces.values() for p in refs}},
    )


def test_metadata_json_roundtrip_and_version_check():
    meta = _metadata({"w": [PieceRef("model/rank00001.safetensors", 4, 10), PieceRef("m0", 0, 4)]})
    again = CheckpointMetadata.from_json(meta.to_json(), "metadata.json")
    assert again == meta
    unchecked = "\n".join(line for line in meta.to_json().splitlines() if "metadata_crc32" not in line)
    assert CheckpointMetadata.from_json(unchecked, "metadata.json") == meta  # written before the checksum existed
    newer = unchecked.replace('"format_version": 1', '"format_version": 99')
    with pytest.raises(CheckpointError, match="newer"):
        CheckpointMetadata.from_json(newer, "metadata.json")
    with pytest.raises(CheckpointError, match="metadata.json: not valid JSON"):
        CheckpointMetadata.from_json(meta.to_json()[:50], "metadata.json")
    # a key a load reads only after writing tensors (an edit that also dropped the checksum): refused at once
    lacking = unchecked.replace('"global_steps": 1, ', "")
    with pytest.raises(CheckpointError, match=r"metadata.json: metadata is incomplete .*counters\.global_steps"):
        CheckpointMetadata.from_json(lacking, "metadata.json")


def test_changed_metadata_is_refused_by_its_checksum(tmp_path):
    """[Note: metadata checksum]: one changed byte (an lr) or random bytes are refused, naming the file."""
    from zeroshard.checkpoint.format import read_metadata

    text = _metadata({"w": [PieceRef("m0", 0, 10)]}).to_json()
    assert '"lr": 0.1' in text
    with pytest.raises(CheckpointError, match="metadata.json: checksum mismatch"):
        CheckpointMetadata.from_json(text.replace('"lr": 0.1', '"lr": 0.9'), "metadata.json")
    (tmp_path / "metadata.json").write_bytes(os.urandom(64) + b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"metadata\.json: (not UTF-8|not valid JSON)"):
        read_metadata(str(tmp_path))


def test_reader_assembles_ranges_across_pieces(tmp_path):
    """The resharding primitive: a range spanning pieces of two files (stored in bf16, read as fp32)."""
    values = torch.randn(10).to(torch.bfloat16)
    os.makedirs(tmp_path / "model")
    files = {}
    for rel, (b, e) in {"model/r0.safetensors": (0, 4), "model/r1.safetensors": (4, 10)}.items():
        size = _write(str(tmp_path / rel), {f"w[{b}:{e}]": values[b:e]})
        files[rel] = {"bytes": size}
    meta = _metadata({"w": [PieceRef("model/r1.safetensors", 4, 10), PieceRef("model/r0.safetensors", 0, 4)]})
    meta.files = files
    with CheckpointReader(str(tmp_path), meta) as reader:
        out = torch.empty(6)
        reader.read_range("model", "w", 2, 8, out)
        assert torch.equal(out, values[2:8].float())
        assert torch.equal(reader.read_tensor("model", "w"), values.view(2, 5))


def test_sampler_resumes_at_any_world_size():
    """After c global samples on N ranks, M ranks draw exactly the rest of the epoch's permutation."""
    data = range(53)

    def draw(world: int, per_rank: int | None, state=None) -> tuple[list[int], dict]:
        samplers = [ResumableDistributedSampler(data, num_replicas=world, rank=r, seed=7) for r in range(world)]
        drawn, iters = [], []
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
            iters.append(iter(s))
        count = len(samplers[0]) if per_rank is None else per_rank
        for _ in range(count):
            drawn.extend(next(it) for it in iters)  # ranks draw in lock step
        return drawn, samplers[0].state_dict()

    plain = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, seed=7)
    assert list(ResumableDistributedSampler(data, num_replicas=2, rank=1, seed=7)) == list(plain)
    whole, _ = draw(1, None)
    first, state = draw(2, 5)
    assert state["consumed"] == 10 and first == whole[:10]
    for world in (1, 2, 4):
        rest, _ = draw(world, None, state)
        unseen = whole[10:]  # then, as DistributedSampler does, padding repeats the epoch's first samples
        assert rest[: len(unseen)] == unseen[: len(rest)] and len(rest) > len(unseen) - world


def test_parse_size_and_shard_plan():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(100) == 100
    with pytest.raises(ValueError):
        parse_size("5 parsecs")
    plan = plan_shards([("a", 40), ("b", 40), ("huge", 500), ("c", 30), ("d", 10)], 100)
    assert plan == [["huge"], ["a", "b"], ["c", "d"]]


def test_convert_of_a_refused_checkpoint_leaves_nothing_behind(tmp_path, capsys):
    from zeroshard.cli.main import main

    bad = tmp_path / "ckpt" / "t"
    bad.mkdir(parents=True)
    (bad / "metadata.json").write_text('{"format": "something else"}')
    out = tmp_path / "hf"
    assert main(["convert", str(bad), str(out)]) != 0
    err = capsys.readouterr().err
    assert "metadata.json" in err and "not a zeroshard checkpoint" in err, err
    assert not out.exists()
    assert main(["convert", str(tmp_path / "nowhere"), str(out)]) == 2  # a wrong path: bad input, as argparse's
    assert f"{tmp_path / 'nowhere'}: does not exist; name a checkpoint folder" in capsys.readouterr().err
    assert not out.exists()
    (tmp_path / "afile").write_text("")  # a file where a folder goes, either side: one line (a raw FileExistsError)
    assert main(["convert", str(tmp_path / "afile"), str(out)]) == 2
    assert f"{tmp_path / 'afile'}: is a file; name a checkpoint folder" in capsys.readouterr().err
    assert main(["convert", str(bad), str(tmp_path / "afile")]) == 2
    assert f"{tmp_path / 'afile'}: cannot write there (File exists)" in capsys.readouterr().err


def test_a_deepspeed_checkpoint_is_named_with_the_command_that_converts_it(tmp_path) -> None:
    """A DeepSpeed checkpoint loaded as a zeroshard one, or an unconverted one loaded as universal, fails with one
    line that gives ds_to_universal's command ([Note: universal checkpoints])."""
    from zeroshard.checkpoint.errors import CheckpointError
    from zeroshard.checkpoint.format import read_metadata
    from zeroshard.checkpoint.universal import UniversalReader

    tag_dir = tmp_path / "global_step3"
    tag_dir.mkdir()
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="a DeepSpeed checkpoint.*ds_to_universal.*load_universal"):
        read_metadata(str(tag_dir))
    with pytest.raises(CheckpointError, match="not a DeepSpeed universal checkpoint.*ds_to_universal"):
        UniversalReader(str(tag_dir))


def test_a_universal_checkpoints_micro_steps_follow_who_ended_the_windows():
    """DeepSpeed's checkpoint keeps no micro-step count: gradient_accumulation_steps per step for a managed run, one
    per step() when the script ended its windows (`managed_gradient_accumulation: false`)."""
    from zeroshard.checkpoint.universal import UniversalReader

    reader = UniversalReader.__new__(UniversalReader)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    reader._states = {"global_steps": 3, "ds_config": config}
    assert reader._counters()["micro_steps"] == 12
    reader._states = {"global_steps": 3, "ds_config": {**config, "managed_gradient_accumulation": False}}
    assert reader._counters()["micro_steps"] == 3


def test_threads_sharing_a_reader_read_their_own_bytes(tmp_path):
    """The streaming loader's threads share one reader per file: reads of tensors with CRCs are positional (a seek
    then a read let one thread read another's bytes, which the CRC then refused as a checksum mismatch)."""
    from concurrent.futures import ThreadPoolExecutor

    path = str(tmp_path / "x.safetensors")
    tensors = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(8)}  # 1 MiB each: several chunks
    _write(path, tensors)
    with SafetensorsReader(path) as reader:
        assert all(reader.entry(n).crc32 is not None for n in tensors)

        def read(name: str) -> bool:
            out = torch.empty(4, dtype=torch.bfloat16)  # not the stored dtype: the chunked path
            reader.read_range(name, 1000, 1004, out)
            return bool((out == tensors[name][:4].to(torch.bfloat16)).all())

        with ThreadPoolExecutor(4) as pool:
            for _ in range(10):
                assert all(pool.map(read, list(tensors) * 4))


def test_a_latest_file_that_names_nothing_or_a_missing_tag_says_so(tmp_path):
    from zeroshard.checkpoint.load import resolve_tag_dir

    (tmp_path / "latest").write_text("\n")
    with pytest.raises(CheckpointError, match=r"latest: empty, it names no checkpoint; write a tag"):
        resolve_tag_dir(str(tmp_path), None)
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(
        CheckpointError, match=r"global_step9: checkpoint directory does not exist \(named by .*latest\)"
    ):
        resolve_tag_dir(str(tmp_path), None)
    with pytest.raises(CheckpointError, match=r"global_step9: checkpoint directory does not exist$"):
        resolve_tag_dir(str(tmp_path), "global_step9")


def test_a_universal_folder_loaded_as_a_zeroshard_one_says_how_to_load_it(tmp_path):
    """ds_to_universal's output holds model-states files too: the advice to convert it again would loop."""
    from zeroshard.checkpoint.format import read_metadata

    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "optimizer_state.pt").write_bytes(b"")
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r'a DeepSpeed universal checkpoint; load it with "checkpoint": \{"load_'):
        read_metadata(str(tmp_path))


def test_pieces_beyond_their_tensor_are_refused_when_the_reader_opens(tmp_path):
    """An edited metadata (its checksum made again) whose shape is smaller than its pieces: refused at once, not read
    into a tensor of the smaller size."""
    from zeroshard.checkpoint.reshard import CheckpointReader

    meta = _metadata({"w": [PieceRef("m0", 0, 10)]})
    with pytest.raises(CheckpointError, match=r"model pieces of 'w' reach elements \[0, 10\) of a tensor of 6;"):
        CheckpointReader(
            str(tmp_path), dataclasses.replace(meta, tensors={"w": TensorInfo((2, 3), "float32", "param", True, True)})
        )
    CheckpointReader(str(tmp_path), meta).close()


def test_a_save_removes_an_earlier_runs_leftovers_and_keeps_what_may_still_be_written(tmp_path):
    """`remove_leftovers`: temporary folders older than this process (an earlier run's interrupted saves) go, of any
    tag; one made since it started (another engine's decoupled save, still writing) stays, as does the old copy of a
    tag that is missing (loading falls back to it); an old copy whose tag is back goes."""
    import os

    from zeroshard.checkpoint.atomic import remove_leftovers

    names = [".tmp.step100.0123456789ab", ".tmp.actor.aaaaaaaaaaaa", ".old.gone.bbbbbbbbbbbb", ".old.here.cccccccccccc"]
    for name in [*names, "here", ".tmp.mine.dddddddddddd", ".tmp.notours"]:
        (tmp_path / name).mkdir()
    os.utime(tmp_path / ".tmp.step100.0123456789ab", (0, 0))  # an earlier run's
    remove_leftovers(str(tmp_path), keep="dddddddddddd")
    left = sorted(os.listdir(tmp_path))
    assert left == [
        ".old.gone.bbbbbbbbbbbb",
        ".tmp.actor.aaaaaaaaaaaa",
        ".tmp.mine.dddddddddddd",
        ".tmp.notours",
        "here",
    ]


def test_scalar_optimizer_state_keeps_its_shape() -> None:
    """A client optimizer's one-element state of shape (1,) (DeepSpeed's test_hybrid_optimizer_state) comes back as
    (1,), a 0-dim step as 0-dim, a Python number as that number; a record written before shapes were kept: 0-dim."""
    from zeroshard.checkpoint.load_optim import _scalar
    from zeroshard.checkpoint.rank_files import split_optimizer_state

    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.state[param] = {"integer_step": 2, "tensor_step": torch.full((1,), 2.0), "step": torch.tensor(5)}
    elementwise, scalars = split_optimizer_state(optimizer, param)
    back = {key: _scalar(record, None, torch.device("cpu")) for key, record in scalars.items()}
    assert not elementwise and back["integer_step"] == 2
    assert back["tensor_step"].shape == (1,) and back["tensor_step"].item() == 2.0
    assert back["step"].shape == () and back["step"].dtype == torch.int64 and back["step"].item() == 5
    assert _scalar({"value": 1.5, "tensor": "float32"}, None, torch.device("cpu")).shape == ()
