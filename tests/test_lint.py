"""The code passes ``ruff check`` with the project's rules (``[tool.ruff]`` in pyproject.toml)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str] | None:
    """The ruff command: the executable beside this interpreter, else on PATH; None when ruff is not installed."""
    beside = Path(sys.executable).with_name("ruff")
    found = str(beside) if beside.is_file() else shutil.which("ruff")
    return [found] if found else None


def test_ruff_check_passes():
    cmd = _ruff()
    if cmd is None:
        pytest.skip("ruff is not installed (the test extra installs it)")
    paths = [p for p in ("src", "tests", "examples", "benchmarks") if (ROOT / p).is_dir()]
    out = subprocess.run([*cmd, "check", "--output-format", "concise", *paths], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
