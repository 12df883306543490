"""The loop of a tensor-parallel rank > 0: run rank 0's ModelRunner calls on this rank's shard.

Messages (pickled, broadcast from rank 0 on the control group):

    ("init", model_path, kwargs)   build ModelRunner(model_path, tp_rank, tp_size, **kwargs) on this
                                   rank's device; answer None or the traceback (gather to rank 0)
    ("call", name, args, kwargs)   runner.<name>(*args, **kwargs); the result is dropped (logits
                                   reach rank 0 through the all-gather inside execute). name may
                                   be "attach" or "<attached>.<method>" (runner.py: attach)
    ("release",)                   drop the runner (the LLM on rank 0 was closed)
    ("exit",)                      leave the loop

A ValueError from a call is the caller's mistake: rank 0 raised the same one from the same
arguments before any collective, so the worker carries on. Any other error means this rank
can no longer follow rank 0: it prints the traceback and exits, which breaks the group's
sockets so rank 0 fails instead of waiting.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist


def _receive(control: Any) -> tuple:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def run_worker(rank: int, size: int, device: str, control: Any) -> None:
    """Serve rank 0's messages until ("exit",); returns normally then."""
    from replayssm.engine.model_runner import ModelRunner

    runner = None
    while True:
        message = _receive(control)
        kind = message[0]
        if kind == "exit":
            return
        if kind == "release":
            runner = None
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        elif kind == "init":
            _, model_path, kwargs = message
            runner, status = None, None
            try:
                runner = ModelRunner(model_path, device=device, tp_rank=rank, tp_size=size, **kwargs)
            except Exception:
                status = f"rank {rank}: {traceback.format_exc()}"
            dist.gather_object(status, None, dst=0, group=control)
        else:
            assert kind == "call", message
            _, name, args, kwargs = message
            try:
                resolve_call(runner, name)(*args, **kwargs)
            except ValueError:
                pass  # rank 0 raised the same error from the same arguments
            except Exception:
                traceback.print_exc()
                print(f"replayssm tensor-parallel worker rank {rank}: {name}() failed; exiting",
                      file=sys.stderr, flush=True)
                os._exit(1)


def attach(runner: Any, name: str, factory: str, *args: Any) -> None:
    """runner.<name> = factory(runner, *args), factory given as "module:function" (picklable)."""
    module, _, attr = factory.partition(":")
    setattr(runner, name, getattr(importlib.import_module(module), attr)(runner, *args))


def resolve_call(runner: Any, name: str) -> Any:
    """The callable a mirrored call names: "attach", a runner method, or "<attached>.<method>"."""
    if name == "attach":
        return lambda *args: attach(runner, *args)
    target: Any = runner
    for part in name.split("."):
        target = getattr(target, part)
    return target
