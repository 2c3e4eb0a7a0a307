"""Resident memory of the vocabulary-parallel cross entropy, DeepSpeed 0.19.8's next to zeroshard's, from /proc.

    python -m benchmarks.vocab_ce_memory            # the table: both libraries, fp32 and bf16 logits
    python -m benchmarks.vocab_ce_memory one zeroshard bfloat16 4096 32000

One process per row (world size 1, no tensor-parallel group: the arithmetic per rank is the same), run with
`MALLOC_MMAP_THRESHOLD_=65536` so freed buffers go back to the OS. After the logits are made, VmHWM is reset
(`/proc/self/clear_refs` 5); `vocab_parallel_cross_entropy` forward, then backward. Reported: what forward leaves
held (VmRSS after forward minus before: what the loss saves for backward) and the peak over both (VmHWM minus
before). DeepSpeed saves an fp32 copy of the exponentials; zeroshard recomputes them in backward
([Note: vocabulary-parallel cross entropy]).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from benchmarks.machine import status_mib


def one(library: str, dtype_name: str, rows: int, vocab: int) -> str:
    if library == "deepspeed":
        from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy
    else:
        from zeroshard.sequence.cross_entropy import vocab_parallel_cross_entropy
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab).to(getattr(torch, dtype_name)).requires_grad_(True)
    target = torch.randint(0, vocab, (rows,))
    before = status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    loss = vocab_parallel_cross_entropy(logits, target)
    held = status_mib("VmRSS") - before
    loss.backward()
    peak = status_mib("VmHWM") - before
    size = logits.numel() * logits.element_size() >> 20
    return f"| {library} | {dtype_name} | {size} | {held} | {peak} | {loss.item():.6f} |"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        print(one(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
        return
    rows, vocab = 4096, 32000
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    print(f"{rows} x {vocab} logits, forward then backward, one process")
    print("| library | logits | logits MiB | held after forward MiB | peak above start MiB | loss |")
    print("|---|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        for library in ("deepspeed", "zeroshard"):
            cmd = [sys.executable, "-m", "benchmarks.vocab_ce_memory", "one", library, dtype, str(rows), str(vocab)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
