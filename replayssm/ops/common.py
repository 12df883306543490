"""Small pieces of Mamba-2 math shared by the SSM ops (PyTorch, any device)."""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from replayssm.ops.rounding import resolve_seed, round_states

# Above this, softplus(v) == v in fp32; every Mamba-2 kernel skips the softplus there.
SOFTPLUS_THRESHOLD = 20.0


def softplus_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_softplus: bool = True) -> torch.Tensor:
    """Δ = softplus(dt + dt_bias) in fp32 (identity above 20); plain dt + dt_bias if not dt_softplus.

    dt (..., H) any float dtype; dt_bias (H,). Returns (..., H) fp32.
    """
    v = dt.float() + dt_bias.float()
    if not dt_softplus:
        return v
    return torch.where(v > SOFTPLUS_THRESHOLD, v, F.softplus(v))


def group_of_head(num_heads: int, num_groups: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(H,) int64: the B/C group used by each head (head h uses group h // (H // G))."""
    assert num_heads % num_groups == 0, (num_heads, num_groups)
    return torch.arange(num_heads, device=device) // (num_heads // num_groups)


def heads_from_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Expand a per-group tensor (..., G, N) to per-head (..., H, N) (no copy of the math, just a gather)."""
    num_groups = t.shape[-2]
    return t.repeat_interleave(num_heads // num_groups, dim=-2)


def store_states(state: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                 rand_seed: torch.Tensor | None) -> None:
    """state[slots] = values, with stochastic rounding when the pool is fp16/bf16.

    state (S, H, P, N); slots (n,) int64, distinct, all valid; values (n, H, P, N) fp32;
    rand_seed: one-element int64 tensor on state's device, read there (None: seed 0).
    """
    if slots.numel() == 0:
        return
    if state.dtype == torch.float32:
        state[slots] = values
    else:
        # Random bits depend on (seed, destination element) only: see ops/rounding.py.
        state[slots] = round_states(values, slots, state.dtype, resolve_seed(rand_seed, state.device))


def pick_impl(module: str, name: str, tensor: torch.Tensor, ref: Callable) -> Callable:
    """`<name>_triton` from `replayssm.ops.triton.<module>` for CUDA tensors when Triton imports,
    else `ref` (the PyTorch twin with the same signature). Triton stays an optional import."""
    if not tensor.is_cuda or module in _NO_TRITON:
        return ref
    try:
        triton_module = importlib.import_module(f"replayssm.ops.triton.{module}")
    except ImportError:
        # A failed import is not cached by Python: it would search the path again at every call
        # (every layer of every step).
        _NO_TRITON.add(module)
        return ref
    return getattr(triton_module, f"{name}_triton", ref)


_NO_TRITON: set[str] = set()  # modules of replayssm.ops.triton that did not import


# (tag, ids of the key tensors) -> (weak references to them, their version counters, value).
_DERIVED: dict[tuple, tuple[list[weakref.ref], tuple[int, ...], Any]] = {}
_DERIVED_MAX = 64


def derived(tag: str, tensors: Sequence[torch.Tensor], build: Callable[[], Any]) -> Any:
    """build(), computed once for as long as the same `tensors` live unmodified.

    The layers of one forward pass get the same metadata tensors (cu_seqlens, slots, ...); what
    depends only on them (index layouts read to the host) is built at the first layer and reused by
    the others, so a step reads them back from the device once instead of once per layer. The value
    must not reference the key tensors (it would keep them alive). A tensor changed in place (its
    version counter moved) or a new tensor at a reused address misses.
    """
    try:
        versions = tuple(t._version for t in tensors)
    except RuntimeError:  # inference-mode tensors keep no version counter: no reuse
        return build()
    key = (tag, *(id(t) for t in tensors))
    hit = _DERIVED.get(key)
    if hit is not None and hit[1] == versions and all(r() is t for r, t in zip(hit[0], tensors)):
        return hit[2]
    value = build()
    if len(_DERIVED) >= _DERIVED_MAX:  # entries normally leave with their tensors; this bounds the rest
        _DERIVED.clear()
    refs = [weakref.ref(t, lambda _, k=key: _DERIVED.pop(k, None)) for t in tensors]
    _DERIVED[key] = (refs, versions, value)
    return value


def upload(pieces: dict[str, Sequence[int] | torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host lists / tensors -> flat int64 tensors on `device`, views of one buffer sent in one copy
    (pinned and asynchronous on CUDA: a pageable copy would wait for everything queued before it).

    Every view starts on a 16-byte boundary: Triton specializes a kernel on whether each pointer
    argument is 16-byte aligned, so views whose alignment followed the sizes before them compiled
    new kernel variants whenever the sizes changed parity (mid-run, for the Triton prefill scan).
    """
    host = [torch.as_tensor(v).reshape(-1).long() for v in pieces.values()]
    starts, at = [], 0
    for h in host:
        starts.append(at)
        at += h.numel() + h.numel() % 2  # 2 int64 = 16 bytes
    flat = torch.zeros(at, dtype=torch.int64)
    for h, a in zip(host, starts):
        flat[a : a + h.numel()] = h
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        flat = flat.to(device)
    return {name: flat[a : a + h.numel()] for name, h, a in zip(pieces, host, starts)}
