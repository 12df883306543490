"""TPModelRunner: rank 0's ModelRunner for a tensor-parallel group (same interface, same results).

Every call that touches the model or the caches is first broadcast to the workers, which run
it on their shard, then run here on rank 0's shard; collectives inside the forward pair them up.
Calls therefore reach every rank in the same order with the same arguments, so the host cursor
mirrors (and the device cursors) are identical on every rank. Only rank 0 sees the logits:

    engine (rank 0)            rank 0                         rank r > 0
    execute(rows)  ----------> send ("call", "execute", rows) -> execute(rows) on shard r
                               execute(rows) on shard 0  <-- all-reduce per block -->
                               logits (all-gathered vocab)      (logits dropped)
    commit / copy_slots ...    same pattern, no collectives inside

A drafter with its own sharded model (the MTP head) is attached to every rank's runner:
`attach(name, factory, *args)` builds `factory(runner, *args)` on each rank as `runner.<name>` and
returns a proxy whose calls are mirrored the same way (`name.method` on the workers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replayssm.distributed.group import TPGroup, acquire_group
from replayssm.distributed.sharding import check_shardable
from replayssm.distributed.worker import resolve_call
from replayssm.engine.model_runner import ModelRunner
from replayssm.models.config import ModelConfig

# Read-only methods: answered by rank 0's runner alone (no message to the workers).
LOCAL_METHODS = frozenset({"cursors", "bytes_per_slot", "bytes_per_kv_block"})


class TPModelRunner:
    """ModelRunner over `tensor_parallel_size` ranks; rank 0 is this process. See the module docstring."""

    slot_bytes = staticmethod(ModelRunner.slot_bytes)
    kv_block_bytes = staticmethod(ModelRunner.kv_block_bytes)
    fixed_bytes = staticmethod(ModelRunner.fixed_bytes)

    def __init__(self, model_path: str | Path, *, tensor_parallel_size: int, device: str = "cpu",
                 **kwargs: Any) -> None:
        assert tensor_parallel_size >= 2, tensor_parallel_size  # EngineConfig checks the user's value
        # Fail before starting any process when the model does not split.
        check_shardable(ModelConfig.from_hf(model_path), tensor_parallel_size)
        self.group: TPGroup | None = acquire_group(tensor_parallel_size, str(device))
        # The workers are about to drop any older runner's shards: that runner becomes stale.
        self.group.owner = self
        self.group.send(("init", str(model_path), kwargs))
        local, error = None, None
        try:
            local = ModelRunner(model_path, device=self.group.device, tp_rank=0,
                                tp_size=tensor_parallel_size, **kwargs)
        except Exception as e:
            error = e
        failures = [s for s in self.group.gather_status() if s is not None]
        if error is not None or failures:
            self.group.owner = None
            self.group.send(("release",))
            self.group = None
            if error is not None:
                raise error
            raise RuntimeError("tensor-parallel worker failed to load the model:\n" + failures[0])
        self.local = local

    def __getattr__(self, name: str) -> Any:
        if name in ("local", "group"):
            raise AttributeError(name)
        value = getattr(self.local, name)
        if not callable(value) or name in LOCAL_METHODS:
            return value
        return lambda *args, **kwargs: self._mirror(name, args, kwargs)

    def _mirror(self, name: str, args: tuple, kwargs: dict) -> Any:
        if self.group is None:
            raise ValueError("this runner is closed")
        if self.group.owner is not self:
            raise ValueError("a newer tensor-parallel LLM in this process replaced this one's workers; "
                             "close() an LLM before building the next")
        self.group.send(("call", name, args, kwargs))
        try:
            return resolve_call(self.local, name)(*args, **kwargs)
        except RuntimeError as e:
            # A collective failed: most likely a worker died mid-step.
            raise self.group.dead_worker_error(e) from e

    def attach(self, name: str, factory: str, *args: Any) -> Any:
        """Build `factory(runner, *args)` ("module:function") on every rank as runner.<name>; returns
        a proxy whose method calls run on every rank (rank 0's result returned)."""
        self._mirror("attach", (name, factory) + args, {})
        return _Attached(self._mirror, name)

    def execute(self, rows: list) -> Any:
        """ModelRunner.execute on every rank; returns the full fp32 logits here."""
        return self._mirror("execute", (rows,), {})

    def commit(self, rows: list, num_accepted: list[int]) -> list[int]:
        return self._mirror("commit", (rows, num_accepted), {})

    def copy_slot(self, src: int, dst: int) -> None:
        self._mirror("copy_slot", (src, dst), {})

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self._mirror("copy_slots", (src, dst), {})

    def close(self) -> None:
        """Free this runner on every rank; the worker processes stay for the next LLM in this process.
        Idempotent; on a broken group it shuts the group down instead of raising (TPGroup.release)."""
        if self.group is not None:
            self.group.release(self)
        self.group = None
        self.local = None


class _Attached:
    """Rank 0's handle on an attached object: `proxy.method(...)` runs runner.<name>.method on every rank."""

    def __init__(self, mirror: Any, name: str) -> None:
        self._mirror, self._name = mirror, name  # mirror: TPModelRunner._mirror(name, args, kwargs)

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self._mirror(f"{self._name}.{method}", args, kwargs)

