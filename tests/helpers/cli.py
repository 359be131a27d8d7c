"""The command line as a child process, and the headless browser the report tests render with."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def run_cli(args, env_extra=None, **kw) -> subprocess.Popen:
    """``python -m diffgrpo.cli *args`` with one OpenMP thread, its stdout and stderr merged into ``.stdout``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", "diffgrpo.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def browser() -> str:
    """A headless Chromium (Debian's chromium-headless-shell, or chromium); skips when none is installed, but fails
    under CI (CI=true: .ci/run installs it), so the browser test cannot silently stop running there."""
    for name in ("chromium-headless-shell", "chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI=true but no chromium-headless-shell / chromium on PATH (apt-get install chromium-headless-shell)")
    pytest.skip("chromium not installed (apt-get install chromium-headless-shell)")
