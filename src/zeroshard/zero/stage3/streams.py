"""The side stream of host-to-device shard copies (offload_param on CUDA).

[Note: host-to-device copies on a side stream]
With offload_param the unit's shard lives on the host and is copied into its slice of the full buffer before the
all-gather. On the compute stream that copy would wait for every kernel queued before it and hold up every kernel
queued after it: a prefetched unit's copy could never run during the current unit's compute (issue 13 measured 100%
of H2D time exposed). It runs on one copy stream per device instead: that stream first waits for the work already
queued on the compute stream (the full buffer may reuse memory those kernels still read), the all-gather is issued
from it (NCCL orders its own stream after the copy), and the compute stream waits for the copy's event only in
`wait_gathered`, when the unit is about to be used (the event is recorded after the gather is issued, so it also
covers a synchronous gather, whose wait orders the copy stream after NCCL's). Only a swapped-out (NVMe) home also
blocks the host there, before it lets the host buffer go. (On the one H100 run so far, a host-bound 120M step, the
exposed share only went from 1.00 to 0.98: docs/benchmarks_gpu.md.)
"""

from __future__ import annotations

import torch

_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream for host-to-device shard copies on `device` ([Note: host-to-device copies on a side
    stream])."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]
