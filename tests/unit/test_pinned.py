"""[Note: pinned memory without rounding]: exactly sized, zero-filled host tensors, locked while any view of them
lives and unlocked once (a stand-in registry here; the CUDA runtime's on a GPU, tests/gpu/test_cuda.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from zeroshard.errors import ZeroshardError
from zeroshard.offload.pinned import EXACT_FROM, HostRegistry, pinned_zeros


class Registry:
    def __init__(self, refuse: bool = False):
        self.locked: dict[int, int] = {}
        self.unlocked: list[int] = []
        self.refuse = refuse

    def registry(self) -> HostRegistry:
        return HostRegistry(self.register, self.unregister)

    def register(self, address: int, nbytes: int) -> str | None:
        if self.refuse:
            return "out of memory"
        self.locked[address] = nbytes
        return None

    def unregister(self, address: int) -> None:
        self.unlocked.append(address)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_size_zero_filled_and_unlocked_after_the_last_view(dtype):
    fake = Registry()
    numel = EXACT_FROM // dtype.itemsize * 3 + 7  # not a page multiple, far from a power of two
    tensor = pinned_zeros(numel, dtype, fake.registry())
    assert tensor.dtype == dtype and tensor.numel() == numel and not tensor.any()
    assert tensor.untyped_storage().nbytes() == numel * dtype.itemsize
    ((address, nbytes),) = fake.locked.items()
    assert address == tensor.data_ptr() and address % 4096 == 0 and nbytes == numel * dtype.itemsize
    tensor.add_(1)
    view = tensor.narrow(0, 5, 10)  # as the stage-3 pieces view a master shard
    del tensor
    gc.collect()
    assert fake.unlocked == [] and view.sum().item() == 10
    del view
    gc.collect()
    assert fake.unlocked == [address]


def test_refused_registration_falls_back_to_torch_with_one_warning(log: pytest.LogCaptureFixture):
    """Never worse than before exact pinning: torch's allocator pins it instead (here, without CUDA, torch's own
    refusal shows it was asked), with the cause named once; without the fallback (`zeroshard report`), an error."""
    with pytest.raises(ZeroshardError, match=r"registering .* GiB .*out of memory.*ulimit -l"):
        pinned_zeros(EXACT_FROM, torch.float32, Registry(refuse=True).registry(), fallback=False)
    for _ in range(2):
        try:
            pinned = pinned_zeros(EXACT_FROM, torch.float32, Registry(refuse=True).registry())
            assert pinned.is_pinned()  # a machine with CUDA: torch pinned it
        except RuntimeError:
            pass  # no CUDA here: torch cannot pin
    warnings = [r.getMessage() for r in log.records if r.name == "zeroshard.offload.pinned"]
    assert len(warnings) == 1 and "out of memory" in warnings[0] and "torch's allocator" in warnings[0]


def test_torch_allocator_on_request(monkeypatch):
    """ZEROSHARD_PINNED=torch: torch's pinned allocator serves (here, without CUDA, its refusal shows it was asked)."""
    monkeypatch.setenv("ZEROSHARD_PINNED", "torch")
    fake = Registry()
    try:
        pinned_zeros(EXACT_FROM, torch.float32, fake.registry())
    except RuntimeError:
        pass  # no CUDA here: torch cannot pin
    assert fake.locked == {}


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by pinned buffers: the other tests of
# this file
@pytest.mark.slow
def test_quiet_at_interpreter_exit():
    """State still referenced when the interpreter exits (an engine in a global) is left to the driver, which
    unlocks at process exit: no finalizer noise, no call into a half-torn-down CUDA runtime."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from zeroshard.offload.pinned import EXACT_FROM, HostRegistry, pinned_zeros\n"
        "def unregister(address):\n"
        "    print('unlocked', flush=True)\n"
        "registry = HostRegistry(lambda address, nbytes: None, unregister)\n"
        "KEPT = [pinned_zeros(EXACT_FROM, torch.float32, registry) for _ in range(3)]\n"
        "freed = pinned_zeros(EXACT_FROM, torch.float32, registry)\n"
        "del freed\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["unlocked"], done.stdout  # the one freed while running
    assert "Exception ignored" not in done.stderr, done.stderr


def test_zeroshard_report_checks_exact_pinning(monkeypatch):
    """`zeroshard report` on a GPU machine tries what offloaded state will use, and says when it cannot."""
    import zeroshard.offload.pinned as pinned
    from zeroshard.cli.report import _exact_pinning

    def refused(numel, dtype, fallback=True):
        assert not fallback  # the report wants the refusal, not torch's pinning
        raise ZeroshardError("registering 0.06 GiB of host memory for offloaded state failed (out of memory)")

    monkeypatch.setattr(pinned, "pinned_zeros", refused)
    check = _exact_pinning()
    assert check.ok is False and "out of memory" in check.detail
    monkeypatch.setattr(pinned, "pinned_zeros", lambda numel, dtype, fallback: torch.zeros(numel, dtype=dtype))
    assert _exact_pinning().ok is False  # not pinned: reported as such


def test_nvme_staging_buffers_are_pinned_at_their_exact_size(monkeypatch: pytest.MonkeyPatch):
    """A staging buffer of 8 MiB (block_size x queue_depth) asked torch's pinned allocator for 8 MiB + 4096 for the
    alignment, which it rounds to 16 MiB: now the exact, page-aligned pinned pages."""
    from zeroshard.offload import buffers

    fake = Registry()
    monkeypatch.setattr(buffers, "pinned_zeros", lambda n, dtype: pinned_zeros(n, dtype, fake.registry()))
    buffer = buffers.aligned_empty(8 << 20, pin=True)
    assert buffer.numel() == 8 << 20 and buffer.data_ptr() % 4096 == 0
    assert buffer.untyped_storage().nbytes() == 8 << 20 and fake.locked == {buffer.data_ptr(): 8 << 20}
