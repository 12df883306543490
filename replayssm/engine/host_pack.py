"""Many small host lists -> device tensors with ONE host-to-device copy.

A step's metadata is a dozen short integer lists. Sent one by one, each costs a tensor build,
a pinned staging allocation and an asynchronous copy on the host (CUDA); packed, the step pays
one staging buffer and one copy, and every list becomes a view of the device buffer. Every
part starts on a 16-byte boundary, so the views are as aligned as fresh allocations (kernels
that specialise on pointer alignment see the same alignment as before). Nothing reads device
memory: on CUDA the copy is non-blocking from pinned memory.
"""

from __future__ import annotations

from array import array

import torch

_ALIGN = 16  # bytes
# array() converts a list of ints ~3x faster than torch.tensor(list); bool and others keep torch.tensor.
_CODES = {torch.int32: "i", torch.int64: "q"}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) for a flat list, through array() when that is exact."""
    code = _CODES.get(dtype)
    if code is not None and values:
        try:
            return torch.frombuffer(array(code, values), dtype=dtype)
        except (TypeError, OverflowError):  # not plain ints: torch.tensor's own conversion (and errors)
            pass
    return torch.tensor(values, dtype=dtype)


class HostPack:
    """Collect lists with `add`, then `send` them; `send` returns the device tensors in add order."""

    def __init__(self) -> None:
        self._parts: list[tuple[torch.Tensor, tuple[int, ...]]] = []

    def add(self, values: list | torch.Tensor, dtype: torch.dtype,
            shape: tuple[int, ...] | None = None) -> int:
        """Queue a flat list (viewed as `shape` after the copy, default 1-D) or a CPU tensor of
        `dtype` (keeps its shape); returns its index."""
        if isinstance(values, torch.Tensor):
            assert values.dtype == dtype and values.device.type == "cpu", (values.dtype, values.device)
            t, shape = values.contiguous().view(-1), tuple(values.shape)
        else:
            t = host_tensor(values, dtype)
            assert t.dim() == 1, "HostPack takes flat lists"
        self._parts.append((t, (t.numel(),) if shape is None else shape))
        return len(self._parts) - 1

    def send(self, device: torch.device) -> list[torch.Tensor]:
        """One copy of every queued list to `device`; the returned tensors share its memory."""
        offsets, total = [], 0
        for t, _ in self._parts:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        cuda = device.type == "cuda"
        buf = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=cuda)
        for (t, _), off in zip(self._parts, offsets):
            if t.numel():
                buf[off:off + t.numel() * t.element_size()].copy_(t.view(torch.uint8))
        if cuda:
            # The caching host allocator keeps the pinned block alive until the copy has run.
            buf = buf.to(device, non_blocking=True)
        elif device.type != "cpu":
            buf = buf.to(device)
        out = []
        for (t, shape), off in zip(self._parts, offsets):
            n = t.numel() * t.element_size()
            out.append(buf[off:off + n].view(t.dtype).view(shape))
        self._parts = []
        return out
