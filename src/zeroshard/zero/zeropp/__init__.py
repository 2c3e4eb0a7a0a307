"""ZeRO++ (Wang et al. 2023) for stage 3: quantized weight gathers (qwZ), a node-local secondary partition for the
backward gathers (hpZ) and two-hop quantized gradient reduction (qgZ). [Note: ZeRO++] in policy.py."""

from zeroshard.zero.zeropp.policy import ZeroPPPolicy

__all__ = ["ZeroPPPolicy"]
