"""The released artifacts: ``python -m build`` makes an sdist and, from it, a wheel; both hold every data file of
the package (shipped configs, built-in prompt sets and their images, the typing marker), and the wheel installed
into a fresh virtual environment outside the checkout lists its configs, reads a shipped prompt set and trains
two iterations from an empty directory. The new environment borrows this one's installed dependencies (a path
entry, never an install: no torch is resolved from an index) and nothing else of the checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "diffgrpo"
pytestmark = pytest.mark.slow


def data_files() -> set[str]:
    """Every file of the package that is not Python source, as ``diffgrpo/<path>``."""
    return {f"diffgrpo/{p.relative_to(PKG).as_posix()}" for p in PKG.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist and wheel of a copy of the source (the checkout stays clean), the wheel built from the sdist."""
    pytest.importorskip("build")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return out


def test_the_sdist_and_the_wheel_hold_every_data_file(dist):
    expected = data_files()
    assert {"diffgrpo/py.typed", "diffgrpo/prompts/ocr/train.jsonl", "diffgrpo/prompts/edit/images/source_0.png",
            "diffgrpo/configs/sd35_medium_ocr.yaml"} <= expected  # the scan sees the data
    (whl,) = dist.glob("diffgrpo-*.whl")
    assert expected <= set(zipfile.ZipFile(whl).namelist())
    (sdist,) = dist.glob("diffgrpo-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {f"src/{n}" for n in expected} <= names
    assert {"pyproject.toml", "LICENSE", "README.md"} <= names


def test_the_wheel_in_a_fresh_environment_trains_from_an_empty_directory(dist, tmp_path):
    (whl,) = dist.glob("diffgrpo-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    here = sysconfig.get_paths()["purelib"]  # this environment's dependencies, after the new one's own packages
    there = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    Path(there, "borrowed_dependencies.pth").write_text(here + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PATH=f"{venv / 'bin'}:{env['PATH']}")
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(whl)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    work = tmp_path / "work"
    work.mkdir()

    def run(*args):
        return subprocess.run(list(args), capture_output=True, text=True, env=env, cwd=work, timeout=900)

    where = run(str(py), "-c", "import diffgrpo; print(diffgrpo.__file__)")
    assert where.returncode == 0 and where.stdout.strip().startswith(there), where.stdout + where.stderr
    listed = run(str(venv / "bin" / "diffgrpo"), "configs", "list")
    assert listed.returncode == 0, listed.stderr
    assert all(p.stem in listed.stdout for p in (PKG / "configs").glob("*.yaml"))
    prompts = run(str(py), "-c", "from diffgrpo.data_sources import load_prompts; "
                                 "print(len(load_prompts('builtin:ocr/train')))")
    assert prompts.returncode == 0 and int(prompts.stdout) > 0, prompts.stderr
    out = tmp_path / "run"
    trained = run(str(venv / "bin" / "diffgrpo"), "train", "train.num_iterations=2", f"log.output_dir={out}")
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("iteration", -1) for r in rows) == 2
    assert (out / "summary.json").is_file() and not any(work.iterdir())
