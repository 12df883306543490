"""A toy demo checkpoint trained for a few CPU steps by demo_train, once per test process."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import torch
from threads import one_thread  # noqa: F401 (autouse fixture, re-exported to test modules)

TOY_STEPS = 20


@functools.cache
def toy_checkpoint() -> str:
    """Directory of a toy-size model trained TOY_STEPS steps (batch 4 x 128); removed at exit."""
    from replayssm.demo_train import train

    root = tempfile.mkdtemp(prefix="replayssm-demo-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(root, size="toy", steps=TOY_STEPS, batch=4, seq_len=128, device="cpu", log_every=TOY_STEPS,
              eval_limit=0, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    return root


def prompt_ids(problems) -> list[list[int]]:
    """<s> + the characters of each problem's prompt, as the demo tokenizer encodes them."""
    from replayssm.demo_train import BOS, encode

    return [[BOS, *encode(p.prompt).tolist()] for p in problems]


@functools.cache
def toy_checkpoint_random_mtp() -> str:
    """toy_checkpoint() with its mtp.* tensors re-drawn at full scale (fan-in scaled matrices, norms
    around 1), so that every part of the MTP layer moves the draft logits; removed at exit."""
    from safetensors.torch import load_file, save_file

    root = tempfile.mkdtemp(prefix="replayssm-demo-mtp-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    shutil.copytree(toy_checkpoint(), root, dirs_exist_ok=True)
    file = f"{root}/model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(11)
    for name, t in tensors.items():
        if name.startswith("mtp."):
            r = torch.randn(t.shape, generator=gen)
            r = 1.0 + 0.2 * r if t.dim() == 1 else 2.0 * r / t.shape[-1] ** 0.5
            tensors[name] = r.to(t.dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    return root


@functools.cache
def toy_checkpoint_small_dt() -> str:
    """toy_checkpoint() with every Mamba dt_bias at -14 (Δ = softplus(dt + dt_bias) below transformers'
    default time_step_min 1e-3), D at 0 (the scan's output is the state's alone, so a floor on Δ would
    change it by orders of magnitude) and the Mamba out_proj scaled up 30x (the layers move the
    logits); removed at exit."""
    from safetensors.torch import load_file, save_file

    root = tempfile.mkdtemp(prefix="replayssm-demo-dt-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    shutil.copytree(toy_checkpoint(), root, dirs_exist_ok=True)
    file = f"{root}/model.safetensors"
    tensors = load_file(file)
    for name, t in tensors.items():
        if name.endswith("mixer.dt_bias"):
            tensors[name] = torch.full_like(t, -14.0)
        elif name.endswith("mixer.D"):
            tensors[name] = torch.zeros_like(t)
        elif name.endswith("mixer.out_proj.weight"):
            tensors[name] = t * 30.0
    save_file(tensors, file, metadata={"format": "pt"})
    return root
