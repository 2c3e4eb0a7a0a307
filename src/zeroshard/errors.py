"""Exceptions raised by zeroshard. Every message names what was wrong and what to do."""


class ZeroshardError(RuntimeError):
    """Base class of every error zeroshard raises on purpose."""


class ConfigError(ZeroshardError, ValueError):
    """A ds_config key is unknown, mistyped, out of range or inconsistent with another key."""


class LossScaleError(ZeroshardError):
    """fp16 dynamic loss scaling cannot continue (the scale sits at its minimum and keeps overflowing)."""


class CollectiveMismatchError(ZeroshardError):
    """Ranks were about to issue collectives that do not match; raised instead of hanging."""


SAME_MODULES = (
    "Every rank must run the same modules in the same order (a module skipped or added on some ranks only); at "
    "stage 3 a module whose children run for some inputs only (the experts of a mixture-of-experts block) is "
    "gathered whole once it is a leaf: zero_optimization.leaf_module, or deepspeed.utils.set_z3_leaf_modules. "
    "Calls that gather on the caller's behalf are collectives too: every rank makes them (state_dict() at stage 3, "
    "GatheredParameters, safe_get_full_*, save_checkpoint; `if rank == 0: safe_get_full_fp32_param(p)` stops here)."
)


class CollectiveTimeoutError(ZeroshardError):
    """A collective waited longer than `zeroshard.collective_timeout_s` for some rank (stalled or gone)."""


class UnusedParameterError(ZeroshardError, AssertionError):
    """A trainable parameter got no gradient with `ignore_unused_parameters: false` (an AssertionError, as in
    DeepSpeed, so scripts that catch DeepSpeed's assertion catch it)."""
