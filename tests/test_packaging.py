"""The package as users install it: a wheel built from the source holds the shipped configs, the license text and
the PEP 561 marker; installing it keeps the torch already there; `diffgrpo configs list` and `python -m diffgrpo`
work from the installed wheel alone; outputs honour the umask."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel --no-deps`` builds from a copy of the source (the checkout stays clean)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("diffgrpo-*.whl")
    return whl


def test_wheel_holds_configs_license_and_typing_marker(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (ROOT / "src" / "diffgrpo" / "configs").glob("*.yaml"))
    assert shipped and sorted(n.rsplit("/", 1)[-1] for n in names if n.startswith("diffgrpo/configs/")) == shipped
    assert "diffgrpo/py.typed" in names and "diffgrpo/__main__.py" in names
    lic = next(n for n in names if n.endswith("licenses/LICENSE"))
    assert "Apache License" in zipfile.ZipFile(wheel).read(lic).decode()
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    torch_req = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_req == ["Requires-Dist: torch>=2.4"], torch_req  # a range, never an exact pin


def _fake_dist(root: Path, name: str, version: str) -> None:
    """Metadata of an installed distribution (what pip's resolver reads), no code."""
    d = root / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "INSTALLER").write_text("pip\n")
    (d / "RECORD").write_text("")


def _older_torch_every_installed_package_accepts() -> str:
    """The oldest of a few torch 2.x releases (2.4.1 first) that the torch requirement of every installed
    distribution admits: an environment with that GPU torch and these packages is one pip could have made."""
    from importlib.metadata import distributions

    from packaging.requirements import Requirement
    from packaging.version import Version

    reqs = [q for d in distributions() for q in map(Requirement, d.requires or [])
            if q.name.lower() == "torch" and (q.marker is None or q.marker.evaluate({"extra": ""}))]
    for v in ("2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.0"):
        if all(q.specifier.contains(v) for q in reqs) and Version(v) < Version(_torch_version()):
            return v
    pytest.skip("no torch older than the installed one meets every installed package's requirement")


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def _pip_env() -> dict[str, str]:
    """pip without the machine's or the user's configuration (no find-links, extra indexes or constraints of
    theirs): only what the command line names can be installed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return dict(env, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")


@pytest.mark.parametrize("installed", ["present", "older"])
def test_installing_the_wheel_keeps_the_installed_torch(wheel, tmp_path, installed):
    """pip's plan for the wheel installs no torch, both with this environment's torch and with an older torch 2.x
    in front of it on the path (an environment whose GPU torch is older, 2.4.1 where every installed package
    accepts it). --no-index and no pip configuration: nothing can be fetched, so a requirement the installed torch
    does not meet fails the plan."""
    env = _pip_env()
    expected = _torch_version()
    if installed == "older":
        expected = _older_torch_every_installed_package_accepts()
        _fake_dist(tmp_path / "site", "torch", expected)
        env["PYTHONPATH"] = str(tmp_path / "site")
    report = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
                        str(wheel.parent), "--report", str(report), "-q", str(wheel)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]
    assert plan == ["diffgrpo"], plan
    seen = subprocess.run([sys.executable, "-m", "pip", "show", "torch"], capture_output=True, text=True, env=env)
    assert f"Version: {expected}" in seen.stdout  # the torch pip judged the plan against


def test_configs_list_and_module_entry_point_from_the_installed_wheel(wheel, tmp_path):
    """Installed alone (``--target``, no checkout on the path), the wheel lists and copies its configs, answers
    ``--version`` and runs as ``python -m diffgrpo``."""
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=str(target))
    work = tmp_path / "work"
    work.mkdir()

    def run(*args):
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=work, timeout=300)

    where = run("-c", "import diffgrpo, sys; print(diffgrpo.__file__)")
    assert where.returncode == 0 and where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    listed = run("-m", "diffgrpo", "configs", "list")
    assert listed.returncode == 0, listed.stderr
    for p in (ROOT / "src" / "diffgrpo" / "configs").glob("*.yaml"):
        assert p.stem in listed.stdout
    copied = run("-m", "diffgrpo", "configs", "cp", "sd35_medium_ocr", ".")
    assert copied.returncode == 0, copied.stderr
    assert (work / "sd35_medium_ocr.yaml").read_text() == (ROOT / "src/diffgrpo/configs/sd35_medium_ocr.yaml").read_text()
    again = run("-m", "diffgrpo", "configs", "cp", "sd35_medium_ocr", ".")
    assert again.returncode == 2 and "already exists" in again.stderr  # never over a file
    version = run("-m", "diffgrpo", "--version")
    assert version.returncode == 0 and version.stdout.strip() == "diffgrpo 0.1.0"
    by_name = run("-m", "diffgrpo", "print-config", "--config", "sd35_medium_pickscore", "--changed")
    assert by_name.returncode == 0 and "stable-diffusion-3.5-medium" in by_name.stdout, by_name.stderr


def test_outputs_honour_the_umask(tmp_path):
    """atomic_write and the checkpoint / cache temporary folders give the umask's modes (0644/0755 under 022,
    0664/0775 under 002), not mkstemp's 0600 / mkdtemp's 0700."""
    from diffgrpo.fileio import append_line, atomic_write, temp_dir

    for umask, fmode, dmode in ((0o022, 0o644, 0o755), (0o002, 0o664, 0o775), (0o077, 0o600, 0o700)):
        old = os.umask(umask)
        try:
            d = tmp_path / f"u{umask:03o}"
            f = atomic_write(d / "a.txt", "x")
            g = atomic_write(d / "b.bin", lambda p: p.write_bytes(b"y"))
            append_line(d / "log.jsonl", "{}")
            t = temp_dir(".tmp.", d)
        finally:
            os.umask(old)
        for p in (f, g, d / "log.jsonl"):
            assert stat.S_IMODE(p.stat().st_mode) == fmode, (oct(umask), p.name, oct(p.stat().st_mode))
        assert stat.S_IMODE(t.stat().st_mode) == dmode


def test_checkpoint_folder_honours_the_umask(tmp_path):
    """A checkpoint written under umask 002 is group-readable and -writable, folder and files."""
    import torch

    from diffgrpo.run.checkpoint import save_checkpoint

    old = os.umask(0o002)
    try:
        path = save_checkpoint(tmp_path, 3, trainable={"w": torch.ones(2)}, optimizer={}, rng={}, config={})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o775
    for p in path.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) & 0o060 == 0o060, (p.name, oct(p.stat().st_mode))
