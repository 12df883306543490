"""Argument checks shared by the public ops: each raises ValueError naming the bad argument.

Range checks on index tensors run only for CPU tensors: on CUDA they would cost a host sync
every decode step, and the kernels must stay capturable in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _fmt_shape(shape: Sequence[int | None]) -> str:
    inner = ", ".join("*" if s is None else str(s) for s in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def check_tensor(
    name: str,
    t: object,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> None:
    """Check that `t` is a tensor with the given shape (None = any size), dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and (
        t.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, t.shape))
    ):
        raise ValueError(f"{name}: expected shape {_fmt_shape(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: dtype {t.dtype} not allowed (expected one of {allowed})")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on device {t.device}, expected {device} like the other tensors")


def check_indices(
    name: str,
    idx: object,
    shape: Sequence[int | None],
    upper: int,
    device: torch.device,
    *,
    allow_padding: bool = True,
    unique: bool = False,
) -> None:
    """Check an int32 index tensor: values in [0, upper) (or -1 when padding is allowed).

    unique: the non-padding values must be distinct (two rows writing one slot is a caller bug).
    """
    check_tensor(name, idx, shape, (torch.int32,), device)
    assert isinstance(idx, torch.Tensor)
    if idx.device.type != "cpu" or idx.numel() == 0:
        return
    low = -1 if allow_padding else 0
    if int(idx.min()) < low or int(idx.max()) >= upper:
        raise ValueError(f"{name}: values must lie in [{low}, {upper}), got {idx.tolist()}")
    if unique:
        valid = idx[idx >= 0]
        if valid.unique().numel() != valid.numel():
            raise ValueError(f"{name}: a slot appears twice, got {idx.tolist()}")


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Check a Python int in [low, high] (high None = no upper bound)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}: must be {bound}, got {value}")


def check_group_count(name: str, num_heads: int, num_groups: int) -> None:
    """Heads must split evenly over groups (head h uses group h // (H // G))."""
    if num_groups < 1 or num_heads % num_groups != 0:
        raise ValueError(f"{name}: {num_groups} groups do not divide {num_heads} heads")


def check_params(A: object, D: object, dt_bias: object | None, num_heads: int, device: torch.device) -> None:
    """A, D, dt_bias: fp32 per head, shape (H,)."""
    check_tensor("A", A, (num_heads,), (torch.float32,), device)
    check_tensor("D", D, (num_heads,), (torch.float32,), device)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, (num_heads,), (torch.float32,), device)
