"""The CI script (``.ci/run``): it runs README's test command in a clean environment (``env -i``: only HOME, the
venv on PATH and what the script sets), and the install lines of README and docs/quickstart.md name the extras it
installs."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()


def _extras(text: str) -> list[set[str]]:
    """The extras of every ``pip install -e ".[...]"`` in ``text``."""
    return [set(m.split(",")) for m in re.findall(r'pip install (?:-q )?-e "\.\[([a-z0-9_,]+)\]"', text)]


def test_ci_runs_the_tests_in_a_clean_environment():
    command = " ".join(line.rstrip("\\").strip() for line in CI.splitlines()
                       if line.strip() and not line.lstrip().startswith("#")).split("env -i ", 1)[1]
    words = shlex.split(command, posix=False)
    assigned = {w.split("=", 1)[0] for w in words[: words.index("python")]}
    assert assigned == {"HOME", "PATH", "DIFFGRPO_CACHE", "OMP_NUM_THREADS", "CI"}
    assert words[words.index("python"):] == ["python", "-m", "pytest", "-q"]  # README's command, nothing added
    assert 'PATH="$VIRTUAL_ENV/bin:' in command and "CI=true" in command


def test_readme_and_quickstart_install_the_extras_ci_tests():
    (ci,) = _extras(CI)
    for doc in ("README.md", "docs/quickstart.md"):
        lines = [line for line in (ROOT / doc).read_text().splitlines() if "# the tests (as .ci/run)" in line]
        assert lines and all(_extras(line) == [ci] for line in lines), (doc, lines)
