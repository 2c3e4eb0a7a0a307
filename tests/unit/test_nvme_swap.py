"""NvmeSwapper: bit-identical round trips, ordering and concurrency, the buffer bound, cleanup, preflight."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import zeroshard.offload.buffers as buffers
from zeroshard.config import AioConfig
from zeroshard.errors import ConfigError
from zeroshard.offload import IoMode, NvmeSwapError, NvmeSwapper, aligned_zeros, preflight
from zeroshard.offload.aio import pread_exact, probe_io_mode

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
NUMELS = [0, 1, 7, 1023, 4097, 70_001]
# Small blocks and buffers, so that tensors span several chunks and segments, with a partial last chunk.
AIO = AioConfig(block_size=8192, queue_depth=2, intra_op_parallelism=2)
BUFFER_BYTES = 20_000  # rounded up to 20480 = 2.5 blocks


def swapper(root: Path, mode: IoMode | None = None, count: int = 3, aio: AioConfig = AIO) -> NvmeSwapper:
    return NvmeSwapper(root, aio, buffer_count=count, buffer_bytes=BUFFER_BYTES, pin=True, mode=mode)


def random_tensor(numel: int, dtype: torch.dtype, alloc: str = "plain") -> torch.Tensor:
    """Random bit patterns (NaNs and infinities included) in a tensor allocated as `alloc` says."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        bits = bits % 2
    if alloc == "aligned":
        out = aligned_zeros(numel, dtype)
    elif alloc == "unaligned":  # a view 8 bytes past a 4096-aligned address
        out = aligned_zeros(numel + 8, dtype)[8 // itemsize :][:numel]
    else:
        out = torch.empty(numel, dtype=dtype)
    out.view(torch.uint8).copy_(bits)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def modes(root: Path) -> list[IoMode]:
    return [IoMode.BUFFERED] + ([IoMode.DIRECT] if probe_io_mode(root) is IoMode.DIRECT else [])


# -- round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("alloc", ["plain", "aligned", "unaligned"])
def test_round_trip_is_bit_identical_for_every_dtype_and_size(tmp_path: Path, alloc: str) -> None:
    for mode in modes(tmp_path):
        with swapper(tmp_path, mode) as sw:
            assert sw.io_mode is mode
            cases = {f"{dtype}-{n}": random_tensor(n, dtype, alloc) for dtype in DTYPES for n in NUMELS}
            for key, x in cases.items():
                sw.swap_out(key, x)
            sw.wait_all()
            outs = {key: torch.zeros_like(x) for key, x in cases.items()}
            handles = [sw.swap_in(key, outs[key]) for key in cases]
            for handle in handles:
                handle.wait()
            for key, x in cases.items():
                assert same_bits(x, outs[key]), (mode, key)


def test_views_scalars_and_non_contiguous_tensors(tmp_path: Path) -> None:
    base = random_tensor(64 * 33, torch.bfloat16).view(64, 33)
    cases = {
        "slice": base[3:40],  # storage offset
        "transposed": base.t(),  # non-contiguous source
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "param": torch.nn.Parameter(torch.randn(5, 7)),  # requires grad
    }
    with swapper(tmp_path) as sw:
        for key, x in cases.items():
            sw.swap_out(key, x).wait()
        for key, x in cases.items():
            out = torch.zeros(x.t().shape, dtype=x.dtype).t() if key == "transposed" else torch.zeros_like(x)
            sw.swap_in(key, out).wait()
            assert same_bits(x.detach(), out.detach()), key


def test_rewrite_with_another_size_and_the_file_layout(tmp_path: Path) -> None:
    with swapper(tmp_path) as sw:
        sw.swap_out("k", random_tensor(10_000, torch.float32)).wait()
        (file,) = sw.directory.iterdir()
        assert file.stat().st_size == 40_960 and sw.disk_bytes == 40_960
        y = random_tensor(5, torch.int64)
        sw.swap_out("k", y).wait()
        assert file.stat().st_size == 4096
        out = torch.empty_like(y)
        sw.swap_in("k", out).wait()
        assert same_bits(y, out)
        assert sw.directory.name.startswith(f"zeroshard_swap_{os.getpid()}_")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_go_through_pinned_buffers(tmp_path: Path) -> None:
    with swapper(tmp_path) as sw:
        assert sw._engine.pool.pinned
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # produced on a side stream: the swapper must wait for it
            x = torch.randn(300_001, device="cuda").to(torch.bfloat16) * 3
            h = sw.swap_out("x", x)
        h.wait()
        out = torch.empty_like(x)
        sw.swap_in("x", out).wait()
        assert same_bits(x.cpu(), out.cpu())


# -- ordering, concurrency, the buffer bound -------------------------------------------------------
def test_requests_on_one_key_run_in_order(tmp_path: Path) -> None:
    a, c = random_tensor(50_000, torch.float32), random_tensor(50_000, torch.float32)
    b, d = torch.empty_like(a), torch.empty_like(c)
    with swapper(tmp_path) as sw:
        sw.swap_out("k", a)
        sw.swap_in("k", b)
        sw.swap_out("k", c)
        sw.swap_in("k", d)
        sw.wait_all()
    assert same_bits(a, b) and same_bits(c, d)


def test_concurrent_swaps_from_several_threads(tmp_path: Path) -> None:
    tensors = {f"t{i}": random_tensor(1000 + 4099 * i, torch.float16, "unaligned") for i in range(24)}
    outs = {key: torch.empty_like(x) for key, x in tensors.items()}
    with swapper(tmp_path, count=2) as sw:

        def worker(keys: list[str]) -> None:
            for key in keys:
                sw.swap_out(key, tensors[key])
            for key in keys:
                sw.swap_in(key, outs[key])

        keys = list(tensors)
        threads = [threading.Thread(target=worker, args=(keys[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sw.wait_all()
    assert all(same_bits(tensors[k], outs[k]) for k in tensors)


def test_never_more_than_buffer_count_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    allocations = []
    real = buffers.aligned_empty

    def counting(nbytes: int, pin: bool = False) -> torch.Tensor:
        allocations.append(nbytes)
        return real(nbytes, pin)

    # Unaligned host tensors all go through staging buffers; 16 of them, each several buffers long.
    xs = [random_tensor(30_000, torch.float32, "unaligned") for _ in range(16)]
    monkeypatch.setattr(buffers, "aligned_empty", counting)
    with swapper(tmp_path, count=2) as sw:
        for i, x in enumerate(xs):
            sw.swap_out(str(i), x)
        sw.wait_all()
        for i, x in enumerate(xs):
            out = torch.empty_like(x)
            sw.swap_in(str(i), out).wait()
            assert same_bits(x, out)
        assert sw.buffers_allocated == 2 == len(allocations)
        assert sw._engine.pool.high_water == 2


def test_aligned_host_tensors_need_no_staging_buffer(tmp_path: Path) -> None:
    with swapper(tmp_path, IoMode.DIRECT if IoMode.DIRECT in modes(tmp_path) else None) as sw:
        x = random_tensor(100_000, torch.float32, "aligned")  # 400000 bytes: a multiple of 4096 plus a tail
        sw.swap_out("x", x).wait()
        out = aligned_zeros(100_000)
        sw.swap_in("x", out).wait()
        assert same_bits(x, out)
        assert sw.buffers_allocated == (1 if sw.io_mode is IoMode.DIRECT else 0)  # only for the 2816-byte tail


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_events_off_still_round_trips(tmp_path: Path, overlap: bool) -> None:
    aio = AioConfig(block_size=4096, queue_depth=1, intra_op_parallelism=1, overlap_events=overlap)
    with swapper(tmp_path, aio=aio) as sw:
        x = random_tensor(25_000, torch.float32, "unaligned")
        sw.swap_out("x", x).wait()
        out = torch.empty_like(x)
        sw.swap_in("x", out).wait()
        assert same_bits(x, out)


# -- errors ----------------------------------------------------------------------------------------
def test_truncated_or_missing_swap_file_names_the_file(tmp_path: Path) -> None:
    with swapper(tmp_path) as sw:
        sw.swap_out("a", random_tensor(10_000, torch.float32)).wait()
        sw.swap_out("b", random_tensor(10_000, torch.float32)).wait()
        file_a, file_b = sorted(sw.directory.iterdir())
        os.truncate(file_a, 8192)
        with pytest.raises(NvmeSwapError, match=rf"{file_a}.*has 8192 bytes, expected 40960.*truncated"):
            sw.swap_in("a", torch.empty(10_000)).wait()
        file_b.unlink()
        with pytest.raises(NvmeSwapError, match=rf"{file_b}.*missing"):
            sw.swap_in("b", torch.empty(10_000)).wait()


def test_short_read_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "short.swp"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EOFError, match=rf"{path} ends at byte 100"):
            pread_exact(fd, memoryview(bytearray(4096)), 0, path)
    finally:
        os.close(fd)


def test_bad_requests_fail_at_submission(tmp_path: Path) -> None:
    with swapper(tmp_path) as sw:
        with pytest.raises(KeyError, match="no NVMe swap file for key 'nope'"):
            sw.swap_in("nope", torch.empty(3))
        sw.swap_out("k", torch.zeros(10)).wait()
        with pytest.raises(ValueError, match="44 bytes, but 40 bytes were swapped out"):
            sw.swap_in("k", torch.empty(11))


def test_failed_write_is_reported_and_not_read_back(tmp_path: Path) -> None:
    with swapper(tmp_path) as sw:
        shutil.rmtree(sw.directory)  # the disk went away under us
        with pytest.raises(NvmeSwapError, match=r"swap_out of key 'k'.*zeroshard_swap_"):
            sw.swap_out("k", torch.ones(1000)).wait()
        with pytest.raises(NvmeSwapError, match="last swap_out .* failed"):
            sw.swap_in("k", torch.empty(1000)).wait()
        sw.swap_out("j", torch.ones(10))
        with pytest.raises(NvmeSwapError):
            sw.wait_all()


def test_sizes_below_one_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="aio.block_size must be >= 1"):
        NvmeSwapper(tmp_path, AioConfig(block_size=0), 1, 4096, pin=False)
    with pytest.raises(ConfigError, match="buffer_count must be >= 1"):
        NvmeSwapper(tmp_path, AioConfig(), 0, 4096, pin=False)
    assert list(tmp_path.iterdir()) == []


# -- cleanup ---------------------------------------------------------------------------------------
def test_close_and_remove_delete_files_idempotently(tmp_path: Path) -> None:
    sw = swapper(tmp_path)
    sw.swap_out("a", torch.ones(100))
    sw.swap_out("b", torch.ones(100))
    sw.remove("a")
    sw.remove("a")
    sw.remove("never-swapped")
    assert "a" not in sw and "b" in sw
    assert len(list(sw.directory.iterdir())) == 1
    sw.close()
    sw.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(NvmeSwapError, match="closed"):
        sw.swap_out("c", torch.ones(1))


def test_garbage_collection_removes_the_directory(tmp_path: Path) -> None:
    sw = swapper(tmp_path)
    sw.swap_out("a", torch.ones(100)).wait()
    del sw
    gc.collect()
    assert list(tmp_path.iterdir()) == []


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by swap directories:
# test_preflight_counts_every_rank_of_the_node_and_removes_stale_swap_directories
@pytest.mark.slow
def test_interpreter_exit_removes_the_directory(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import torch
        from zeroshard.config import AioConfig
        from zeroshard.offload import NvmeSwapper
        idle = NvmeSwapper({str(tmp_path)!r}, AioConfig(), 2, 1 << 20, pin=False)
        idle.swap_out("a", torch.ones(1000)).wait()
        busy = NvmeSwapper({str(tmp_path)!r}, AioConfig(), 2, 1 << 20, pin=False)
        for i in range(8):
            busy.swap_out(str(i), torch.randn(1 << 18))  # still in flight at exit
        print(len(list(idle.directory.iterdir())), flush=True)
        """
    )
    env = dict(os.environ, ZEROSHARD_LOG_LEVEL="WARNING")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"
    assert list(tmp_path.iterdir()) == []


# -- preflight -------------------------------------------------------------------------------------
KEY = "zero_optimization.offload_optimizer.nvme_path"


def test_preflight_accepts_a_writable_directory_with_room(tmp_path: Path) -> None:
    preflight(tmp_path, 1 << 20, key=KEY)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: (p / "file").touch() or p / "file", "is not a directory"),
        (lambda p: None, "is not set"),
    ],
)
def test_preflight_rejects_bad_paths(tmp_path: Path, make: Callable[[Path], Path | None], message: str) -> None:
    path = make(tmp_path)
    with pytest.raises(ConfigError, match=message) as info:
        preflight(path, 123_456, key=KEY)
    assert KEY in str(info.value) and "123456 bytes" in str(info.value)
    if path is not None:
        assert str(path) in str(info.value)


def test_preflight_rejects_a_read_only_directory(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root writes through permission bits; /sys refuses new files even to root
        readonly = Path("/sys")
        if _can_create(readonly):
            pytest.skip("no read-only directory available to root here")
    else:
        readonly = tmp_path / "ro"
        readonly.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="is not writable") as info:
        preflight(readonly, 4096, key="zero_optimization.offload_param.nvme_path")
    assert "zero_optimization.offload_param.nvme_path" in str(info.value) and str(readonly) in str(info.value)


def _can_create(directory: Path) -> bool:
    try:
        (directory / ".zeroshard_probe").touch()
    except OSError:
        return False
    (directory / ".zeroshard_probe").unlink()
    return True


def test_preflight_rejects_too_little_free_space(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ConfigError, match="free, but the NVMe swap files need") as info:
        preflight(tmp_path, free + (1 << 40), key=KEY)
    text = str(info.value)
    assert KEY in text and str(tmp_path) in text and str(free + (1 << 40)) in text


def test_preflight_counts_every_rank_of_the_node_and_removes_stale_swap_directories(tmp_path):
    """[Note: stale swap directories]: a killed rank's files are removed at the next start, others' are kept."""
    import json
    import shutil
    import socket
    import subprocess
    import sys

    from zeroshard.errors import ConfigError
    from zeroshard.offload import preflight
    from zeroshard.offload.nvme_files import make_swap_directory

    free = shutil.disk_usage(tmp_path).free
    preflight(tmp_path, free // 3, sharing_ranks=2)
    with pytest.raises(ConfigError, match="for each of the 4 ranks of this node"):
        preflight(tmp_path, free // 3, sharing_ranks=4)
    # a process that made its directory and died without cleaning up (as under SIGKILL)
    code = "import sys, os; from zeroshard.offload.nvme_files import make_swap_directory as m; d = m(sys.argv[1]);"
    code += "(d / '000000_k.swp').write_bytes(b'x' * 8192); os._exit(0)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    mine = make_swap_directory(tmp_path)  # alive: kept
    elsewhere = tmp_path / "zeroshard_swap_1_abcdef01"  # another host's process (a shared filesystem): kept
    elsewhere.mkdir()
    record = {"host": socket.gethostname() + "-other", "pid": 1}
    (tmp_path / "zeroshard_swap_1_abcdef01.owner").write_text(json.dumps(record))
    assert len([d for d in tmp_path.glob("zeroshard_swap_*") if d.is_dir()]) == 3
    preflight(tmp_path, 1 << 20)
    assert sorted(d for d in tmp_path.glob("zeroshard_swap_*") if d.is_dir()) == sorted([mine, elsewhere])
    assert len(list(tmp_path.glob("zeroshard_swap_*.owner"))) == 2  # the dead process's record went with it


def test_stale_directories_are_removed_by_one_rank_and_kept_on_record_when_they_cannot_be(tmp_path, monkeypatch):
    """The ranks of a node remove stale directories at once: each directory goes to the one rank whose claim on its
    record succeeds (another died reading sizes of files being deleted); a claim left by a rank that died is taken
    back; a directory that cannot be removed whole keeps its record, so a later run retries, and is named."""
    import json
    import logging
    import shutil
    import socket

    from zeroshard.offload import nvme_files

    def stale(name: str, pid: int = 999_999_999) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "000000_k.swp").write_bytes(b"x" * 4096)
        (tmp_path / f"{name}.owner").write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
        return directory

    first, second = stale("zeroshard_swap_1_aaaaaaaa"), stale("zeroshard_swap_1_bbbbbbbb")
    (tmp_path / "zeroshard_swap_1_bbbbbbbb.owner").rename(tmp_path / "zeroshard_swap_1_bbbbbbbb.owner.999999998")
    removed = nvme_files.remove_stale_swap_directories(tmp_path)
    assert sorted(removed) == [(first, 4096), (second, 4096)] and not list(tmp_path.iterdir())
    assert nvme_files.remove_stale_swap_directories(tmp_path) == []  # nothing left to claim

    stuck = stale("zeroshard_swap_1_cccccccc")
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(nvme_files.shutil, "rmtree", lambda path, ignore_errors=False: None)  # (EBUSY, NFS files)
    logging.getLogger("zeroshard").addHandler(handler := logging.Handler())
    seen: list[str] = []
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    try:
        assert nvme_files.remove_stale_swap_directories(tmp_path) == []
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
        monkeypatch.setattr(nvme_files.shutil, "rmtree", real_rmtree)
    assert stuck.is_dir() and (tmp_path / "zeroshard_swap_1_cccccccc.owner").is_file()  # on record for a retry
    assert any(f"{stuck} could not be removed whole" in line for line in seen), seen
    assert [d for d, _ in nvme_files.remove_stale_swap_directories(tmp_path)] == [stuck]


@pytest.mark.parametrize(
    ("block", "aio", "named"),
    [
        ({"buffer_count": 0}, {}, "zero_optimization.offload_optimizer.buffer_count = 0"),
        ({}, {"queue_depth": 0}, "aio.queue_depth = 0"),
    ],
)
def test_zero_nvme_buffers_are_refused_naming_the_key(tmp_path, capsys, block, aio, named):
    """0 passes the schema (as DeepSpeed's); NVMe offload needs one of each: refused naming the key (it said
    "buffer_count must be >= 1" without saying which block's), by `validate-config` too (it called such a config
    valid)."""
    from zeroshard.cli.main import main
    from zeroshard.config import parse_config
    from zeroshard.errors import ConfigError
    from zeroshard.zero.from_config import _nvme_store_factory

    offload = {"device": "nvme", "nvme_path": str(tmp_path), **block}
    raw = {"train_batch_size": 1, "zero_optimization": {"stage": 2, "offload_optimizer": offload}, "aio": aio}
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        _nvme_store_factory(
            parse_config(raw), "offload_optimizer", {str(tmp_path): 1}, int(offload.get("buffer_count", 4)), False
        )
    (tmp_path / "ds.json").write_text(json.dumps(raw))
    assert main(["validate-config", str(tmp_path / "ds.json")]) == 2
    assert named in capsys.readouterr().err
    # an offload_param block below stage 3 is ignored (with a warning), its sizes too, as DeepSpeed ignores them
    zero = {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 0}}
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 1, "zero_optimization": zero}))
    assert main(["validate-config", str(tmp_path / "ds.json")]) == 0
