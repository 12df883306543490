"""Run a part of `triton_cases` under Triton's CPU interpreter, in a fresh process.

TRITON_INTERPRET must be set before triton is imported, so the check runs in a subprocess
and leaves the test process (and every other test importing triton) untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def run_interpreted(part: str) -> None:
    """Run `triton_cases.py <part>` with TRITON_INTERPRET=1; fail with its output if it fails."""
    path = os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    res = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "triton_cases.py"), part], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"interpreted {part} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
