"""Run a part of `triton_cases` under Triton's CPU interpreter, in a fresh process.

TRITON_INTERPRET must be set before triton is imported, so the check runs in a subprocess
and leaves the test process (and every other test importing triton) untouched.

Some Triton releases' interpreters cannot take a kernel's scalar argument as a loop bound under
NumPy >= 2.4 (`int()` of a one-element array now raises; triton-lang/triton#9171, e.g. Triton 3.6
with NumPy 2.5 on the GPU machine). There the interpreted checks skip, saying why: the GPU tests
run the same kernels compiled.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def _count(out_ptr, n):
    k = 0
    for _ in range(0, n):
        k += 1
    tl.store(out_ptr, k)

out = torch.zeros(1, dtype=torch.int32)
_count[(1,)](out, 3)
assert out.item() == 3
"""


def _env() -> dict:
    path = os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)


@functools.lru_cache(maxsize=1)
def interpreter_problem() -> str | None:
    """Why this Triton's interpreter cannot run the cases here (None where it can)."""
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", _PROBE], env=_env(), capture_output=True,
                         text=True, timeout=300)
    if res.returncode == 0:
        return None
    if "0-dimensional arrays" in res.stderr:
        import numpy
        import triton

        return (f"Triton {triton.__version__}'s interpreter takes no scalar loop bound under NumPy "
                f"{numpy.__version__} (triton-lang/triton#9171)")
    raise AssertionError(f"the interpreter probe failed:\n{res.stderr[-4000:]}")


def run_interpreted(part: str | None = None, script: str = "triton_cases.py") -> None:
    """Run `<script> [<part>]` (a file of this folder) with TRITON_INTERPRET=1; fail with its output if
    it fails."""
    problem = interpreter_problem()
    if problem:
        pytest.skip(problem)
    env = _env()
    res = subprocess.run([sys.executable, "-W", "ignore", str(HERE / script), *([part] if part else [])],
                         env=env, capture_output=True, text=True, timeout=600)
    what = f"{script} {part or ''}".strip()
    assert res.returncode == 0, f"interpreted {what} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
