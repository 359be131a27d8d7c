"""The layering the package promises: every module imports on its own, the loop holds no family-specific code or
capability probes, and every engine and family implements its whole protocol."""
from __future__ import annotations

import ast
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import diffgrpo
from diffgrpo.engines import ENGINES
from diffgrpo.engines.base import Engine
from diffgrpo.family import Family
from diffgrpo.trainer import FAMILIES

SRC = Path(diffgrpo.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(SRC)], prefix="diffgrpo."))


def _protocol_members(proto) -> set[str]:
    return {n for n, v in vars(proto).items() if not n.startswith("_") and callable(v) or isinstance(v, staticmethod)}


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Importing any module first (no other diffgrpo module loaded) works: no import cycle hides behind an
    import order. One interpreter, the package's modules dropped from sys.modules before each import."""
    assert len(MODULES) > 30 and "diffgrpo.flow.family" in MODULES and "diffgrpo.dllm.family" in MODULES
    code = ("import importlib, sys\n"
            f"for name in {MODULES!r}:\n"
            "    for k in [k for k in sys.modules if k == 'diffgrpo' or k.startswith('diffgrpo.')]:\n"
            "        del sys.modules[k]\n"
            "    importlib.import_module(name)\n"
            "print('ok', len(sys.argv))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_no_lazy_imports_of_the_package_outside_the_command_line():
    """A package module imported inside a function hides a dependency (and usually a cycle). Only cli.py defers
    imports, so that each command loads what it needs."""
    lazy = []
    for path in SRC.rglob("*.py"):
        if path.name == "cli.py":
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("diffgrpo")):
                        lazy.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert lazy == []


def test_the_loop_has_no_family_branches_or_capability_probes():
    src = (SRC / "trainer.py").read_text()
    tree = ast.parse(src)
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert "hasattr" not in calls and "getattr" not in calls and "isinstance" not in calls
    names = ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} |
             {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})
    for word in ("sigmas", "kernel", "latent_shape", "ctx", "vocab", "task", "sampler", "steps", "dllm"):
        assert word not in names, word
    # the two families appear once each, in the registry
    assert src.count("FlowFamily") == 2 and src.count("DLLMFamily") == 2  # import + registry entry


def test_every_engine_implements_the_whole_contract_itself():
    """No hook is optional: each registered engine names every method of ``engines.base.Engine`` in its own class
    body (its own, or one of base.py's no-op hooks; no inheritance of implementation), with the protocol's
    parameters."""
    members = _protocol_members(Engine)
    assert members == {"plan", "collect", "rollout_hooks", "sample_weights", "backward"}
    for name, cls in ENGINES.items():
        assert cls.name == name
        for m in members:
            assert m in vars(cls), f"{cls.__name__} lacks {m}"
            want = list(inspect.signature(getattr(Engine, m)).parameters)[1:]  # after self
            got = list(inspect.signature(getattr(cls, m)).parameters)[1:]
            assert got == want, (cls.__name__, m, got, want)
        assert cls.__bases__ == (object,)


def test_every_family_implements_the_whole_protocol_itself():
    members = _protocol_members(Family)
    assert {"check_world", "network", "connect", "rollout", "collect", "backward", "evaluate", "rng_state",
            "set_rng_state"} <= members
    for key, cls in FAMILIES.items():
        assert cls.name == key and cls.__bases__ == (object,)
        for m in members:
            assert m in vars(cls), f"{cls.__name__} lacks {m}"


def test_error_messages_name_only_keys_that_exist():
    """Every config key a raised error names (``section.key``) is a real key, so a user can act on it."""
    import re

    from diffgrpo.config import RunConfig

    def keys(obj, prefix=""):
        import dataclasses
        out = set()
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            out |= keys(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else {f"{prefix}{f.name}"}
        return out

    real = keys(RunConfig())
    sections = {k.split(".")[0] for k in real if "." in k}
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(sorted(sections)) + r")\.([a-z_]+)")
    named = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                for c in ast.walk(node.exc):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        named += [(f"{path.relative_to(SRC)}:{node.lineno}", f"{s}.{k}")
                                  for s, k in pattern.findall(c.value)]
    assert len(named) > 40  # the scan sees the messages
    unknown = [(where, key) for where, key in named if key not in real and not key.startswith("reward.weights")]
    assert unknown == []
