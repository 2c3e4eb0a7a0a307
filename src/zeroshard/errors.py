"""Exceptions raised by zeroshard. Every message names what was wrong and what to do."""


class ZeroshardError(RuntimeError):
    """Base class of every error zeroshard raises on purpose."""


class ConfigError(ZeroshardError, ValueError):
    """A ds_config key is unknown, mistyped, out of range or inconsistent with another key."""


class LossScaleError(ZeroshardError):
    """fp16 dynamic loss scaling cannot continue (the scale sits at its minimum and keeps overflowing)."""


class CollectiveMismatchError(ZeroshardError):
    """Ranks were about to issue collectives that do not match; raised instead of hanging."""


class CollectiveTimeoutError(ZeroshardError):
    """A collective waited longer than `zeroshard.collective_timeout_s` for some rank (stalled or gone)."""


class UnusedParameterError(ZeroshardError, AssertionError):
    """A trainable parameter got no gradient with `ignore_unused_parameters: false` (an AssertionError, as in
    DeepSpeed, so scripts that catch DeepSpeed's assertion catch it)."""
