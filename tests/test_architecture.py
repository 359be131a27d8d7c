"""The layering the package promises: every module imports on its own, the loop holds no family-specific code or
capability probes, and every engine and family implements its whole protocol."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import diffgrpo
from diffgrpo.config import EngineConfig
from diffgrpo.engines import ENGINES
from diffgrpo.engines.base import Engine
from diffgrpo.families import FAMILIES
from diffgrpo.family import Family

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
    """A package module imported inside a function hides a dependency (and usually a cycle). Only the command line
    (``cli/``) defers imports, so that each command loads what it needs."""
    lazy = []
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] == "cli":
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
    # the families appear only in their registry (families.py): import + registry entry each
    assert "FlowFamily" not in src and "DLLMFamily" not in src
    reg = (SRC / "families.py").read_text()
    assert reg.count("FlowFamily") == 2 and reg.count("DLLMFamily") == 2


def test_every_engine_implements_the_whole_contract_itself():
    """No hook is optional: each registered engine names every method of ``engines.base.Engine`` in its own class
    body (its own, or one of base.py's no-op hooks; no inheritance of implementation), with the protocol's
    parameters."""
    members = _protocol_members(Engine)
    assert members == {"plan", "sampling", "rollout_hooks", "sample_weights", "backward", "check_config"}
    for name, cls in ENGINES.items():
        assert cls.name == name
        keys = vars(cls)["config_keys"]  # declared in the class body: the engine.* keys it reads
        assert isinstance(keys, tuple) and set(keys) <= {f.name for f in dataclasses.fields(EngineConfig)} - {
            "name", "micro_batch_size"}, (name, keys)
        for m in members:
            assert m in vars(cls), f"{cls.__name__} lacks {m}"
            want = list(inspect.signature(getattr(Engine, m)).parameters)[1:]  # after self
            got = list(inspect.signature(getattr(cls, m)).parameters)[1:]
            assert got == want, (cls.__name__, m, got, want)
        assert cls.__bases__ == (object,)
        assert isinstance(vars(cls)["wave_size"], int)  # the family runs the waves; the engine only sizes them


def test_engines_are_composed_not_chained():
    """No engine module imports another engine module: they share the helpers (base, _graph, _steps, _forward,
    _per_sample) and the family runs the waves (no callback hands the rollout to the engine)."""
    engine_modules = {f"diffgrpo.engines.{cls.__module__.rsplit('.', 1)[1]}" for cls in ENGINES.values()}
    graph = _import_graph()
    chained = [(m, t) for m in engine_modules for t in graph[m] if t in engine_modules]
    assert chained == [] and len(engine_modules) == len(ENGINES)
    assert "rollout" not in inspect.signature(Engine.sampling).parameters


def test_every_family_implements_the_whole_protocol_itself():
    members = _protocol_members(Family)
    assert {"check_config", "check_world", "network", "connect", "rollout", "collect", "backward", "evaluate",
            "rng_state", "set_rng_state"} <= members
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


# ---------------------------------------------------------------------- the import graph
def _import_graph() -> dict[str, set[str]]:
    """Static import graph of the package from the AST: module → the package modules it imports (at any depth of
    the file, functions included; ``from pkg import name`` counts as ``pkg.name`` when that is a module)."""
    files = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for mod, path in files.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[mod] = {t for t in out if t in files and t != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycles_cli_included():
    graph = _import_graph()
    assert "diffgrpo.cli.app" in graph and "diffgrpo.cli.export" in graph["diffgrpo.cli.app"]
    assert _cycles(graph) == []
    # the check sees a cycle when there is one
    assert _cycles({**graph, "diffgrpo.config": graph["diffgrpo.config"] | {"diffgrpo.trainer"}}) != []


# Floors of the package, lowest first: a module imports only from its own floor or below. A name is a top-level
# module or package, or a module inside a wing (``run.job``): the wings gather modules by purpose, not by floor.
FLOORS = [
    {"errors", "types", "fileio", "config", "cache", "data", "data_sources", "media", "losses", "advantages",
     "prompts", "tasks", "_version", "console", "yamlio", "configvalues", "threads", "sources", "sandbox",
     "feature_stats"},
    {"distributed", "ema", "samplers", "loss_weights", "run.runlog", "models", "rewards", "run.rundir",
     "guards"},
    {"engines", "family", "run.checkpoint", "run.saved_config"},
    {"flow", "dllm"},
    {"families", "validation", "run.job", "trainer", "run"},
    {"studies", "cli", "diffgrpo", "__main__"},
]


def _floor(mod: str) -> int:
    parts = mod.split(".")[1:] or ["diffgrpo"]
    for key in (".".join(parts[:2]), parts[0]):
        for i, group in enumerate(FLOORS):
            if key in group:
                return i
    raise AssertionError(f"{mod} is on no floor")


def test_no_upward_imports():
    """The schema and the building blocks never import the families or the job; models and rewards read the task
    library without climbing into a family's folder."""
    graph = _import_graph()
    upward = [(m, t) for m, targets in graph.items() for t in targets if _floor(t) > _floor(m)]
    assert upward == []
    assert graph["diffgrpo.config"] <= {"diffgrpo.errors", "diffgrpo.fileio", "diffgrpo.yamlio",
                                        "diffgrpo.configvalues"}  # yamlio, configvalues: leaves of the parser


def test_no_engine_name_in_the_schema_or_the_generic_validation():
    """Adding an engine needs no edit in config.py or validation.py: neither names a registered engine in code
    (the field docs aside). The exceptions are data: the default of engine.name, engine.evaluation's choices, which
    name velocity sources (a recompute forward or the retained rollout graph), and an example in a parse error."""
    allowed = {("EngineConfig.name", "recompute"), ("EngineConfig.evaluation", "recompute"),
               ("EngineConfig.evaluation", "retain"), (None, " must look like key=value (e.g. engine.name=recompute)")}
    names = set(ENGINES)
    for module in ("config.py", "validation.py"):
        text = (SRC / module).read_text()
        tree = ast.parse(text)
        docs = set()
        for node in ast.walk(tree):  # docstrings and doc= keyword values
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None:
                docs.add(id(node.body[0].value))
            if isinstance(node, ast.keyword) and node.arg == "doc":
                docs |= {id(c) for c in ast.walk(node.value)}
        where = {}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    for c in ast.walk(stmt):
                        where[id(c)] = f"{cls.name}.{stmt.target.id}"
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                for name in names:
                    if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", node.value) and \
                            (where.get(id(node)), node.value) not in allowed:
                        found.append((module, node.lineno, name))
        assert found == [], found
        if module == "validation.py":
            assert not any(re.search(rf"\b{n}\b", text) for n in names)


def test_hub_modules_stay_within_their_size():
    """config.py ≤ 700 lines, trainer.py ≤ 330 with no method over 50 lines, job.py ≤ 250, checkpoint.py ≤ 400."""
    limits = {"config.py": 700, "trainer.py": 330, "run/job.py": 250, "run/checkpoint.py": 400}
    for name, limit in limits.items():
        assert len((SRC / name).read_text().splitlines()) <= limit, name
    for node in ast.walk(ast.parse((SRC / "trainer.py").read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno + 1 <= 50, node.name


def test_every_cfg_parameter_below_the_loop_is_typed():
    """Engines, families, models, samplers and the loss weights annotate every config parameter they take."""
    untyped = []
    for part in ("engines", "flow", "dllm", "models", "samplers", "loss_weights.py", "family.py"):
        paths = [SRC / part] if part.endswith(".py") else sorted((SRC / part).rglob("*.py"))
        for path in paths:
            for fn in ast.walk(ast.parse(path.read_text())):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
                    untyped += [f"{path.relative_to(SRC)}:{fn.lineno} {a.arg}" for a in args
                                if "cfg" in a.arg and a.annotation is None]
    assert untyped == []
