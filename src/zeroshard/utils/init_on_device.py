"""`deepspeed.OnDevice` (`deepspeed.utils.init_on_device.OnDevice`): build a model's tensors on a chosen device and
floating-point dtype, such as the meta device to read a model's shapes without allocating it.

[Note: OnDevice without patching torch]
DeepSpeed's `OnDevice` replaces `torch.empty`, `torch.zeros`, `torch.ones`, `torch.full` and `torch.Tensor.__new__`
for the block. Torch has the two mechanisms this needs: `torch.device(...)` is a context manager that gives every
factory call without a `device=` that device (a torch-function mode, so nothing is replaced and it covers every
factory, `torch.randn` and `torch.arange` too), and `torch.set_default_dtype` gives floating-point tensors created
without a `dtype=` the dtype. The default dtype is process-wide state, not a patch, and the block restores the value
it found on exit (also when the block raises). Two differences follow from asking torch rather than patching it:
an explicit `dtype=` (a buffer built as `torch.zeros(n, dtype=torch.float32)`) is kept, where DeepSpeed casts the
four patched factories' floating results; and the legacy constructor `torch.Tensor(n)` is not moved to the device
(DeepSpeed patches `__new__`); it still takes the dtype.
"""

from __future__ import annotations

import contextlib
from types import TracebackType

import torch


class OnDevice:
    """Tensors created inside the block without a `device=` land on `device`, floating ones without a `dtype=` in
    `dtype` (None: the default dtype unchanged); `enabled=False` makes the block do nothing. DeepSpeed's signature
    ([Note: OnDevice without patching torch] for what differs).

    Example:
        >>> import torch
        >>> with OnDevice(dtype=torch.float16, device="meta"):
        ...     layer = torch.nn.Linear(4, 4)
        >>> layer.weight.device.type, layer.weight.dtype
        ('meta', torch.float16)
    """

    def __init__(
        self, dtype: torch.dtype | None, device: str | int | torch.device = "meta", enabled: bool = True
    ) -> None:
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"OnDevice(dtype={dtype}): only a floating-point dtype (or None) can be the default")
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> OnDevice:
        if not self.enabled:
            return self
        if self._stack is not None:
            raise RuntimeError("OnDevice is already entered; nest a new OnDevice(...) instead")
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device(self.device))
        if self.dtype is not None:
            stack.callback(torch.set_default_dtype, torch.get_default_dtype())
            torch.set_default_dtype(self.dtype)
        self._stack = stack
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._stack is None:
            return
        stack, self._stack = self._stack, None
        stack.close()


__all__ = ["OnDevice"]
