"""benchmarks/overlap.py's trace arithmetic (issue 13 item 4), on a hand-made trace: the GPU run needs it right."""

from __future__ import annotations

import pytest

from benchmarks.overlap import classify, exposed, overlap, union


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_union_and_overlap() -> None:
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert overlap([(0, 3), (5, 8)], [(2, 6)]) == pytest.approx(2.0)
    assert overlap([], [(0, 1)]) == 0.0


def test_exposed_fractions_per_kind() -> None:
    trace = {
        "traceEvents": [
            _kernel("ampere_sgemm_128x64", 0, 10),
            _kernel("void at::native::vectorized_elementwise_kernel", 20, 10),
            _kernel("ncclDevKernel_AllGather_RING_LL", 5, 10),  # 5 us under the gemm, 5 us alone
            _kernel("ncclDevKernel_ReduceScatter_Sum_f32", 25, 10),  # 5 under the elementwise, 5 alone
            _kernel("Memcpy HtoD (Pinned -> Device)", 2, 4, cat="gpu_memcpy"),  # hidden
            _kernel("Memcpy DtoH (Device -> Pinned)", 40, 2, cat="gpu_memcpy"),  # exposed
            _kernel("Memset (Device)", 0, 50, cat="gpu_memset"),  # neither
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host side: ignored
        ]
    }
    out = exposed(trace)
    assert out["comm"] == {"busy_us": 20.0, "exposed_us": 10.0, "exposed_fraction": 0.5}
    assert out["h2d"]["exposed_fraction"] == 0.0 and out["d2h"]["exposed_fraction"] == 1.0


def test_classify_ignores_host_and_instant_events() -> None:
    assert classify({"ph": "i", "cat": "kernel", "name": "x", "ts": 0}) is None
    assert classify(_kernel("ncclKernel_AllReduce", 0, 1)) == "comm"


def test_the_host_optimizer_step_counts_as_exposed_while_no_kernel_runs() -> None:
    """The optimizer step's host ranges (main thread and super_offload's worker): exposed where the GPU computes
    nothing meanwhile, and how much of them follows `engine.backward`; other annotations and the GPU-side copies of
    the ranges are not counted."""
    trace = {
        "traceEvents": [
            _kernel("ampere_sgemm_128x64", 0, 10),
            _kernel("zeroshard.speculative_step", 5, 10, cat="user_annotation"),  # 5 us under the gemm
            _kernel("zeroshard.optimizer_step", 30, 10, cat="user_annotation"),  # alone
            _kernel("zeroshard.optimizer_step", 30, 10, cat="gpu_user_annotation"),  # the device's copy: ignored
            _kernel("zeroshard.backward", 0, 12, cat="user_annotation"),  # the worker's step outlasts it by 3 us
            _kernel("zeroshard.forward", 0, 40, cat="user_annotation"),  # another range: ignored
        ]
    }
    out = exposed(trace)["host_step"]
    assert out == {"busy_us": 20.0, "exposed_us": 15.0, "exposed_fraction": 0.75, "after_backward_us": 13.0}
