"""Process start-up and the control channel of a tensor-parallel group.

Two ways to get N ranks:
  - spawned (``LLM(..., tensor_parallel_size=N)``): this process is rank 0 and spawns N - 1
    worker processes (torch.multiprocessing "spawn", MASTER_ADDR 127.0.0.1, a free port);
  - torchrun: every process calls ``LLM(...)``; rank 0 returns an engine, ranks > 0 run the
    worker loop inside that call and exit the process when rank 0 shuts down.

Tensors travel on the default process group (NCCL on CUDA, gloo on CPU). Control messages
(which ModelRunner method to call, with which arguments) are pickled and broadcast from rank
0 on a separate gloo group, whose timeout is long because workers wait there while the engine
is idle. One group lives per process; LLM objects built one after another reuse it (each
``close()`` drops the workers' runner), and ``shutdown()`` (also run at exit) ends it.

No hangs: a worker that dies during start-up is noticed through its pipe and exit code; once
the group is up, a dead peer closes its gloo sockets and the next control message or CPU
collective raises; NCCL collectives give up after `timeout_s`.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

START_TIMEOUT_S = 300.0  # a spawned worker must import torch and reach the rendezvous by then
COLLECTIVE_TIMEOUT_S = 600.0
_CONTROL_TIMEOUT = timedelta(days=30)  # workers wait here between engine steps

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cpu stays cpu; cuda / cuda:k means cuda:(k + local rank)."""
    if not device.startswith("cuda"):
        return "cpu"
    base = int(device.split(":")[1]) if ":" in device else 0
    index = base + rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor parallelism on {device!r} needs GPU {index}, but only "
                         f"{torch.cuda.device_count()} are visible")
    return f"cuda:{index}"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "LOCAL_RANK" in os.environ)


@dataclass
class TPGroup:
    """Rank 0's view of the group: size, its device, the control group, spawned processes."""

    size: int
    device: str  # rank 0's device
    control: Any  # gloo ProcessGroup for pickled control messages
    processes: list  # spawned worker processes (empty under torchrun)
    owner: object | None = None  # the TPModelRunner whose shards the workers hold now

    def send(self, message: tuple) -> None:
        """Broadcast one control message to every worker (raises if a worker is gone).

        A spawned worker that has exited is caught here, before the broadcast, from its exit
        code. Without this check only the sockets tell, and how soon a write to a dead peer
        fails depends on the host: a CI machine sat for over an hour in the dead-worker test
        (tests/distributed) where this machine raised at once.
        """
        if any(p.exitcode is not None for p in self.processes):
            raise self.dead_worker_error(None)
        try:
            dist.broadcast_object_list([message], src=0, group=self.control)
        except RuntimeError as e:
            raise self.dead_worker_error(e) from e

    def release(self, owner: object) -> None:
        """The workers drop `owner`'s shards; idempotent, and never raises. A broken group (a worker
        gone) holds nothing worth releasing: it is shut down instead, so the next LLM starts a
        fresh one."""
        if self.owner is not owner:
            return
        self.owner = None
        try:
            self.send(("release",))
        except RuntimeError as e:
            logger.warning("closing on a broken tensor-parallel group; shutting it down: %s", e)
            if _GROUP is self:
                shutdown()

    def gather_status(self) -> list[str | None]:
        """Every worker's answer to the last 'init' (None = ok, else its traceback)."""
        out: list[Any] = [None] * self.size
        try:
            dist.gather_object(None, out, dst=0, group=self.control)
        except RuntimeError as e:
            raise self.dead_worker_error(e) from e
        return out[1:]

    def dead_worker_error(self, cause: BaseException | None) -> RuntimeError:
        codes = {r + 1: p.exitcode for r, p in enumerate(self.processes) if p.exitcode is not None}
        who = f"worker ranks {codes} exited (rank: exit code)" if codes else "a worker stopped answering"
        detail = f" ({cause})" if cause is not None else ""
        return RuntimeError(f"tensor-parallel group of {self.size} is broken: {who}; see the worker's "
                            f"traceback above{detail}")


_GROUP: TPGroup | None = None


def acquire_group(size: int, device: str) -> TPGroup:
    """The process's group of `size` ranks on `device`, started on first use (rank 0 only returns)."""
    global _GROUP
    if _GROUP is not None and _GROUP.owner is None and not under_torchrun() \
            and (_GROUP.size, _GROUP.device) != (size, rank_device(device, 0)):
        shutdown()  # an idle group of another shape: replace it
    if _GROUP is not None:
        if (_GROUP.size, _GROUP.device) != (size, rank_device(device, 0)):
            raise ValueError(f"a tensor-parallel group of {_GROUP.size} on {_GROUP.device} is already "
                             "running in this process; call replayssm.distributed.group.shutdown() first")
        return _GROUP
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialized by someone else; cannot start "
                         "a tensor-parallel group")
    _GROUP = _start_torchrun(size, device) if under_torchrun() else _start_spawned(size, device)
    atexit.unregister(shutdown)
    atexit.register(shutdown)
    return _GROUP


def shutdown() -> None:
    """Tell workers to exit, join them (terminate after a grace period), tear down the group."""
    global _GROUP
    group, _GROUP = _GROUP, None
    if group is None:
        return
    try:
        group.send(("exit",))
    except RuntimeError:
        pass  # a dead worker has nothing left to hear
    deadline = time.monotonic() + 30
    for p in group.processes:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    if dist.is_initialized():
        dist.destroy_process_group()


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _init(rank: int, size: int, device: str, init_method: str) -> Any:
    """Join the default group (NCCL or gloo) and the gloo control group; returns the control group."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(_backend(device), init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


def _start_spawned(size: int, device: str) -> TPGroup:
    import torch.multiprocessing as mp

    dev0 = rank_device(device, 0)
    for r in range(1, size):
        rank_device(device, r)  # fail before spawning when GPUs are missing
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    processes, pipes = [], []
    for r in range(1, size):
        here, there = ctx.Pipe()
        p = ctx.Process(target=_spawned_main, args=(r, size, rank_device(device, r), init_method, there),
                        daemon=True, name=f"replayssm-tp{r}")
        p.start()
        processes.append(p)
        pipes.append(here)
    try:
        _wait_joining(processes, pipes)
        control = _init(0, size, dev0, init_method)
    except BaseException:
        for p in processes:
            p.terminate()
        raise
    return TPGroup(size, dev0, control, processes)


def _wait_joining(processes: list, pipes: list) -> None:
    """Wait until every spawned worker has imported everything and is entering the rendezvous."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for r, (p, pipe) in enumerate(zip(processes, pipes), start=1):
        while not pipe.poll(0.1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel worker rank {r} exited with code {p.exitcode} "
                                   "during start-up (see its traceback above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel worker rank {r} did not start within "
                                   f"{START_TIMEOUT_S:.0f} s")
        message = pipe.recv()
        if message != "joining":
            raise RuntimeError(f"tensor-parallel worker rank {r} failed during start-up:\n{message}")


def _spawned_main(rank: int, size: int, device: str, init_method: str, pipe: Any) -> None:
    """Entry point of a spawned worker process."""
    try:
        from replayssm.distributed.worker import run_worker
    except BaseException:
        pipe.send(traceback.format_exc())
        raise
    if device == "cpu":
        # CPU ranks share the cores instead of each spinning up a full thread pool.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    pipe.send("joining")
    control = _init(rank, size, device, init_method)
    try:
        run_worker(rank, size, device, control)
    finally:
        dist.destroy_process_group()


def _start_torchrun(size: int, device: str) -> TPGroup:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} but torchrun started {world} processes")
    dev = rank_device(device, local)
    control = _init(rank, size, dev, "env://")
    if rank == 0:
        return TPGroup(size, dev, control, [])
    from replayssm.distributed.worker import run_worker

    try:
        run_worker(rank, size, dev, control)
    finally:
        dist.destroy_process_group()
    sys.exit(0)  # the worker's LLM(...) call never returns: rank 0 owns the engine
