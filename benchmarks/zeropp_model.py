"""ZeRO++ step time on real interconnects, as a model fed with measured bytes.

    python -m benchmarks.zeropp_model [--out docs/benchmarks_zeropp.md] [--no-measure]

[Note: ZeRO++ time model]
What is measured: (1) on 4 gloo ranks acting as 2 nodes x 2, the bytes one stage-3 bf16 step sends per phase and
per scope (engine.comm_stats, [Note: scopes]), with ZeRO++ off and with qwZ + hpZ + qgZ on, turned into bytes per
trainable parameter per ring fraction (the coefficients below); (2) the quantize and dequantize throughput of
zero/quant.py on this machine's device; (3) on CUDA, a bf16 GEMM's achieved FLOP/s. What is modeled: a step of a
7B and a 70B model on M nodes of L = 8 GPUs, bf16, T tokens per GPU per step:

    inter = c_gather * P * (N-1)/N  +  c_grad * P * (N-1)/N                                 (ZeRO-3)
    inter = q_gather * P * (N-1)/N  +  q_grad * P * (M-1)/(M*L)                             (ZeRO++)
    intra = 0                                                                               (ZeRO-3)
    intra = h_gather * P * (L-1)/L  +  q_grad * P * (L-1)/L                                 (ZeRO++)
    t_comm = inter / B_inter + intra / B_intra (+ quantized bytes / quantizer throughput, when measured on a GPU)
    t_compute = 6 * P * T / F;    step = t_compute + t_comm (no overlap)  and  max(t_compute, t_comm) (full overlap)

with N = M * L ranks, P parameters, B_inter the network bandwidth per GPU (one NIC per GPU), B_intra NVLink's,
F the achieved bf16 FLOP/s. A group that spans nodes is counted wholly at the network's bandwidth: a ring runs at
its slowest link. The coefficients c, q, h are bytes per parameter per unit ring fraction, read from the
measurement (fp16/bf16 2, qwZ/qgZ 1 + 4/256 per element, hpZ 2): the model is only as right as this algebra,
not a measured multi-node run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

GBIT = 1e9 / 8
NETWORKS = {"25 Gb/s Ethernet": 25 * GBIT, "100 Gb/s InfiniBand": 100 * GBIT, "400 Gb/s InfiniBand": 400 * GBIT}
NVLINK = 450e9  # bytes/s per GPU, one direction (H100 NVLink 4)
SHAPES = {"7B": 7e9, "70B": 70e9}
NODES = (4, 16)
PER_NODE = 8
TOKENS_PER_GPU = 8 * 4096
ASSUMED_FLOPS = 400e12  # bf16 FLOP/s when no GPU is at hand: about 40% of an H100's dense peak
ALL_THREE = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
FORMULA = {"c_gather": 4.0, "c_grad": 2.0, "q_gather": 1 + 4 / 256, "h_gather": 2.0, "q_grad": 1 + 4 / 256}


def _measure_rank(rank: int, world_size: int) -> dict[str, float]:
    """Bytes per trainable parameter per ring fraction of one bf16 step, per phase and scope (2 nodes x 2)."""
    import zeroshard
    from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups

    os.environ["ZEROSHARD_RANKS_PER_NODE"] = "2"
    out: dict[str, float] = {}
    for name, extra in (("off", {}), ("on", ALL_THREE)):
        case = Case(stage=3, dtype="bf16", steps=2)
        model = build_model(case)
        cfg = ds_config(case)
        cfg["zero_optimization"].update(extra)
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=cfg)
        psi = engine.strategy.trainable_numel
        for batch in global_batches(case, world_size):  # the last step is measured (the first records the trace)
            x, y = micro_batch(batch, 0, rank, world_size, case.micro)
            engine.comm_stats.reset()
            engine.backward(engine(x, y))
            step = engine.comm_stats.scope_snapshot()
            engine.step()
        engine.destroy()
        world_fraction, node_fraction, peer_fraction = 3 / 4, 1 / 2, 1 / 4  # (N-1)/N, (L-1)/L, (M-1)/(M*L)
        inter, intra = step["inter_node"], step["intra_node"]
        if name == "off":
            out["c_gather"] = inter["all_gather"]["bus_bytes"] / psi / world_fraction
            out["c_grad"] = inter["reduce_scatter"]["bus_bytes"] / psi / world_fraction
        else:
            out["q_gather"] = inter["all_gather"]["bus_bytes"] / psi / world_fraction
            out["h_gather"] = intra["all_gather"]["bus_bytes"] / psi / node_fraction
            out["q_grad"] = inter["all_to_all"]["bus_bytes"] / psi / peer_fraction
    return out


def quantizer_throughput(numel: int = 1 << 24) -> tuple[str, float, float]:
    """(device, quantize GB/s, dequantize GB/s) of zero/quant.py, counted in bf16 input/output bytes."""
    from zeroshard.zero.quant import BlockQuantizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quantizer = BlockQuantizer()
    x = torch.randn(numel, device=device, dtype=torch.bfloat16)
    packed = torch.empty(quantizer.packed_bytes(numel), dtype=torch.uint8, device=device)

    def best(fn: Any) -> float:
        fn()
        times = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    pack_s = best(lambda: quantizer.pack(x, packed))
    unpack_s = best(lambda: quantizer.unpack(packed, numel, torch.bfloat16))
    return device.type, 2 * numel / pack_s / 1e9, 2 * numel / unpack_s / 1e9


def gemm_flops() -> float | None:
    """Achieved bf16 FLOP/s of a 8192^3 GEMM on CUDA; None on the CPU."""
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start)


def model_rows(coef: dict[str, float], flops: float, quant_bps: float | None) -> list[str]:
    """One markdown row per shape, node count and network: modeled step seconds without and with ZeRO++."""
    rows = []
    for shape, params in SHAPES.items():
        compute = 6 * params * TOKENS_PER_GPU / flops
        for nodes in NODES:
            ranks = nodes * PER_NODE
            world, node, peer = (ranks - 1) / ranks, (PER_NODE - 1) / PER_NODE, (nodes - 1) / ranks
            base_inter = (coef["c_gather"] + coef["c_grad"]) * params * world
            pp_inter = coef["q_gather"] * params * world + coef["q_grad"] * params * peer
            pp_intra = coef["h_gather"] * params * node + coef["q_grad"] * params * node
            quant = 0.0 if quant_bps is None else 3 * 2 * params / quant_bps  # pack+unpack of weights, grads twice
            for network, bandwidth in NETWORKS.items():
                base = base_inter / bandwidth
                plus = pp_inter / bandwidth + pp_intra / NVLINK + quant
                base_step = f"{compute + base:.2f} / {max(compute, base):.2f}"
                plus_step = f"{compute + plus:.2f} / {max(compute, plus):.2f}"
                rows.append(
                    f"| {shape} | {nodes} x {PER_NODE} | {network} | {compute:.2f} | {base:.2f} | {plus:.2f} | "
                    f"{base_step} | {plus_step} |"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks_zeropp.md")
    parser.add_argument("--no-measure", action="store_true", help="use the formula's coefficients")
    args = parser.parse_args()
    coef = dict(FORMULA)
    if not args.no_measure:
        from helpers.harness import run_on_ranks

        measured = run_on_ranks(_measure_rank, 4, timeout=600)[0]
        coef.update({k: v for k, v in measured.items() if k in FORMULA})
    device, pack_gbs, unpack_gbs = quantizer_throughput()
    measured_flops = gemm_flops()
    flops = measured_flops or ASSUMED_FLOPS
    quant_bps = 1e9 * min(pack_gbs, unpack_gbs) if device == "cuda" else None
    lines = [
        "# ZeRO++: modeled step time from measured bytes",
        "",
        "Written by `python -m benchmarks.zeropp_model` ([Note: ZeRO++ time model] in that file holds the formula).",
        "A model, not a multi-node measurement: bytes per parameter are measured on 4 gloo ranks acting as",
        "2 nodes x 2, and scaled to N = M x 8 ranks with the ring fractions.",
        "",
        "Bytes per parameter per unit ring fraction, measured over a whole bf16 step (formula in brackets):",
        "",
        *[f"- `{k}` = {v:.4f} ({FORMULA[k]:.4f})" for k, v in coef.items()],
        "",
        f"Quantizer (zero/quant.py, plain torch ops) on {device}: quantize {pack_gbs:.2f} GB/s, dequantize "
        f"{unpack_gbs:.2f} GB/s of bf16 values"
        + ("; in the model." if quant_bps else "; not in the model (no GPU at hand: a CPU rate says nothing of one)."),
        f"Compute: {flops / 1e12:.0f} TFLOP/s bf16 "
        + ("(a measured 8192^3 GEMM)" if measured_flops else "(assumed: no GPU at hand, ~40% of an H100's peak)")
        + f", {TOKENS_PER_GPU} tokens per GPU per step; NVLink {NVLINK / 1e9:.0f} GB/s per GPU.",
        "",
        "| model | nodes x GPUs | network per GPU | compute s | ZeRO-3 comm s | ZeRO++ comm s | ZeRO-3 step s "
        "(serial / overlapped) | ZeRO++ step s (serial / overlapped) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *model_rows(coef, flops, quant_bps),
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
