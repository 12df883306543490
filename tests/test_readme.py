"""The README's setup and test commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line for line in lines if line.startswith("python3 -m pip install") or line.startswith(
        "python3 -m pytest")]


def test_readme_shows_the_commands_ci_runs():
    """Every install and pytest line of .ci/run appears verbatim in the README."""
    readme = (ROOT / "README.md").read_text()
    commands = _ci_commands()
    assert len(commands) == 2, commands
    missing = [c for c in commands if c not in readme]
    assert not missing, f"README.md lacks the commands .ci/run runs: {missing}"


def test_setup_pins_the_toolchain():
    """The setup command installs with the constraints file, and that file pins every package exactly."""
    setup = _ci_commands()[0]
    assert "-c constraints.txt" in setup
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert pins and all("==" in p for p in pins), [p for p in pins if "==" not in p]
    names = {p.split("==")[0].lower() for p in pins}
    for tool in ("torch", "pytest", "pytest-xdist", "transformers", "ruff", "triton", "hypothesis"):
        assert tool in names, tool
