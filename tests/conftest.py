import importlib.metadata
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # `helpers` is importable here and in spawned ranks
os.environ.setdefault("ZEROSHARD_LOG_LEVEL", "WARNING")
# DeepSpeed (the parity reference, tests only) otherwise probes for accelerators on import and warns on a
# CPU-only machine; the reference math it provides is host-side, so it runs on the CPU everywhere.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_report_header() -> str:
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed (the DeepSpeed-parity tests fail; see tests/helpers/deepspeed_reference.py)"
    return f"deepspeed reference: {version}"


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest's hook signature
    """Tests marked `cuda` (the GPU suite, tests/gpu) are skipped on a machine without CUDA."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `make test-gpu` on a GPU machine (issue 13)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
