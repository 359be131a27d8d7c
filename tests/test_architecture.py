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
    assert "diffgrpo.cli.app" in graph and "diffgrpo.cli.outputs" in graph["diffgrpo.cli.app"]
    assert "diffgrpo.cli.export" in graph["diffgrpo.cli.outputs"]  # imported inside its command
    assert _cycles(graph) == []
    # the check sees a cycle when there is one
    assert _cycles({**graph, "diffgrpo.config": graph["diffgrpo.config"] | {"diffgrpo.trainer"}}) != []


# Floors of the package, lowest first: a module imports only from its own floor or below. A name is a top-level
# module or package, or a module inside a wing (``run.job``): the wings gather modules by purpose, not by floor.
FLOORS = [
    {"errors", "types", "fileio", "config", "cache", "data", "data_sources", "media", "losses", "advantages",
     "prompts", "tasks", "_version", "schema", "console", "yamlio", "configvalues", "threads", "sources", "sandbox",
     "feature_stats", "guard_checks", "plugins"},
    {"distributed", "ema", "samplers", "loss_weights", "run.runlog", "run.trackers", "models", "rewards", "run.rundir",
     "guards", "guard_features", "metering", "diversity", "consistency"},
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
    assert graph["diffgrpo.config"] <= {"diffgrpo.errors", "diffgrpo.fileio", "diffgrpo.yamlio", "diffgrpo.schema",
                                        "diffgrpo.configvalues"}  # yamlio, configvalues: leaves of the parser
    assert graph["diffgrpo.schema"] == set()  # the sections import nothing of the package


DOC = SRC.parents[1] / "docs" / "architecture.md"
WINGS = ("cli", "run", "studies")  # folders gathering modules by purpose; each of their modules has its own floor


def floor_table(floors: list[set[str]] = FLOORS) -> str:
    """The floors as docs/architecture.md's Markdown table (a package as ``name/``, a wing module as ``run/job``)."""
    def shown(name):
        return name.replace(".", "/") if "." in name else f"{name}/" if (SRC / name).is_dir() else name

    rows = [" ".join(f"`{n}`" for n in sorted(shown(n) for n in group)) for group in floors]
    return "\n".join(["| floor | modules |", "|---|---|", *(f"| {i} | {r} |" for i, r in enumerate(rows))])


def test_the_documented_floors_are_the_tested_floors():
    """docs/architecture.md's floor table is FLOORS rendered; regenerate it with
    ``python -c "from tests.test_architecture import floor_table; print(floor_table())"``."""
    text = DOC.read_text()
    assert floor_table() in text, ("docs/architecture.md's floor table differs from FLOORS; replace it with the output "
                                   "of: python -c \"from tests.test_architecture import floor_table; print(floor_table())\"")
    assert floor_table([{"errors"}, {"rewards"}]) not in text  # the comparison sees a different table


def _undocumented(text: str) -> list[str]:
    """The package's top-level modules (``name.py``), packages (``name/``) and wing modules (``run/job.py``) that
    ``text`` does not name."""
    names = [f"{p.name}/" if p.is_dir() else p.name for p in sorted(SRC.iterdir())
             if (p.is_dir() and any(p.glob("*.py"))) or (p.suffix == ".py" and p.name != "__init__.py")]
    names += [f"{w}/{p.name}" for w in WINGS for p in sorted((SRC / w).glob("*.py")) if not p.name.startswith("__")]
    return [n for n in names if not re.search(rf"(?<![\w./]){re.escape(n)}(?!\w)", text)]


def test_every_module_is_named_in_the_architecture_doc():
    assert _undocumented(DOC.read_text()) == []
    assert "guards.py" in _undocumented("`trainer.py` `run/job.py`")  # the scan sees a missing name
    assert "run/job.py" in _undocumented("`job.py`") and "trainer.py" not in _undocumented("`trainer.py`")


def test_no_engine_name_in_the_schema_or_the_generic_validation():
    """Adding an engine needs no edit in config.py or validation.py: neither names a registered engine in code
    (the field docs aside). The exceptions are data: the default of engine.name, engine.evaluation's choices, which
    name velocity sources (a recompute forward or the retained rollout graph), the shapes task's engine in
    TASK_DEFAULTS, and an example in a parse error."""
    allowed = {("EngineConfig.name", "recompute"), ("EngineConfig.evaluation", "recompute"),
               ("EngineConfig.evaluation", "retain"), ("TASK_DEFAULTS", "nft"),
               (None, " must look like key=value (e.g. engine.name=recompute)")}
    names = set(ENGINES)
    for module in ("config.py", "schema.py", "validation.py"):
        text = (SRC / module).read_text()
        tree = ast.parse(text)
        docs = set()
        for node in ast.walk(tree):  # docstrings and doc= keyword values
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None:
                docs.add(id(node.body[0].value))
            if isinstance(node, ast.keyword) and node.arg == "doc":
                docs |= {id(c) for c in ast.walk(node.value)}
        where = {id(c): stmt.target.id for stmt in tree.body  # module-level tables: TASK_DEFAULTS
                 if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) for c in ast.walk(stmt)}
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


# ---------------------------------------------------------------------- sizes
# Every module ≤ 500 lines, every function or method ≤ 80, every package ``__init__.py`` ≤ 120 (it re-exports).
# The exceptions are named, each with its cap (its size when the rule was set: it may shrink, never grow) and why.
MODULE_LINES, FUNCTION_LINES, INIT_LINES = 500, 80, 120
LONG_MODULES = {
}
LONG_FUNCTIONS: dict[str, tuple[int, str]] = {}
LONG_INITS: dict[str, tuple[int, str]] = {}
# Stricter caps of the hubs: the loop, the job and checkpoints stay small as the package grows.
HUB_MODULES = {"trainer.py": 330, "run/job.py": 250, "run/checkpoint.py": 400}
HUB_FUNCTIONS = {"trainer.py": 50}


def _function_lines(tree: ast.AST, where: str) -> dict[str, int]:
    """``where:Qual.name`` → lines (def to last line) of every function and method in ``tree``, nested ones too."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[f"{where}:{name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(module path under src/diffgrpo → lines, ``path:Qual.name`` → lines of each function)."""
    modules, functions = {}, {}
    for path in sorted(SRC.rglob("*.py")):
        rel, text = path.relative_to(SRC).as_posix(), path.read_text()
        modules[rel] = len(text.splitlines())
        functions.update(_function_lines(ast.parse(text), rel))
    return modules, functions


def _over(sizes: dict[str, int], limit: int, exceptions: dict) -> list[str]:
    """The entries of ``sizes`` above ``limit``, or above their own cap where ``exceptions`` names them."""
    return [f"{k}: {n} > {exceptions.get(k, (limit,))[0]}" for k, n in sorted(sizes.items())
            if n > exceptions.get(k, (limit,))[0]]


def test_modules_and_functions_stay_within_their_size():
    modules, functions = _sizes()
    inits = {k: n for k, n in modules.items() if k.endswith("__init__.py")}
    assert len(modules) > 100 and len(functions) > 1000  # the scan sees the package
    assert _over({k: n for k, n in modules.items() if k not in inits}, MODULE_LINES, LONG_MODULES) == []
    assert _over(inits, INIT_LINES, LONG_INITS) == []
    assert _over(functions, FUNCTION_LINES, LONG_FUNCTIONS) == []
    for name, limit in HUB_MODULES.items():
        assert _over({name: modules[name]}, limit, {}) == []
    for name, limit in HUB_FUNCTIONS.items():
        assert _over({k: n for k, n in functions.items() if k.startswith(f"{name}:")}, limit, {}) == []
    for caps in (LONG_MODULES, LONG_FUNCTIONS, LONG_INITS):  # an exception is above its rule and says why
        assert all(cap > min(MODULE_LINES, FUNCTION_LINES, INIT_LINES) and why for cap, why in caps.values())
    # an exception that is no longer needed is removed: each names a module or function still above its rule
    stale = [k for k in LONG_MODULES if modules.get(k, 0) <= MODULE_LINES] + \
            [k for k in LONG_INITS if modules.get(k, 0) <= INIT_LINES] + \
            [k for k in LONG_FUNCTIONS if functions.get(k, 0) <= FUNCTION_LINES]
    assert stale == []


def test_the_size_rules_see_a_violation():
    body = "".join(f"        x{i} = {i}\n" for i in range(FUNCTION_LINES))
    tree = ast.parse("class A:\n    def long(self):\n" + body + "def short():\n    return 1\n")
    lines = _function_lines(tree, "m.py")
    assert lines == {"m.py:A.long": FUNCTION_LINES + 1, "m.py:short": 2}
    assert _over(lines, FUNCTION_LINES, {}) == [f"m.py:A.long: {FUNCTION_LINES + 1} > {FUNCTION_LINES}"]
    assert _over(lines, FUNCTION_LINES, {"m.py:A.long": (FUNCTION_LINES + 1, "why")}) == []
    assert _over({"config.py": 701}, MODULE_LINES, {"config.py": (700, "why")}) == ["config.py: 701 > 700"]
    assert _over({"x.py": MODULE_LINES + 1, "y.py": MODULE_LINES}, MODULE_LINES, {}) == ["x.py: 501 > 500"]


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


def _crossings(graph: dict[str, set[str]], source: str, target: str) -> list[tuple[str, str]]:
    """Edges from a module of package ``source`` (or the module itself) to one of package ``target``."""
    def inside(mod, pkg):
        return mod == f"diffgrpo.{pkg}" or mod.startswith(f"diffgrpo.{pkg}.")
    return sorted((m, t) for m, targets in graph.items() if inside(m, source) for t in targets if inside(t, target))


def test_dllm_imports_no_engine_module():
    """The masked-LM family stands alone from the flow engines: no ``dllm`` module imports an ``engines`` module
    and no engine imports ``dllm``; what both meter (forwards, backwards, memory, time) comes from ``metering``."""
    graph = _import_graph()
    assert "diffgrpo.dllm.grpo" in graph and "diffgrpo.engines.base" in graph
    assert _crossings(graph, "dllm", "engines") == []
    assert _crossings(graph, "engines", "dllm") == []
    assert "diffgrpo.metering" in graph["diffgrpo.dllm.grpo"] and "diffgrpo.metering" in graph["diffgrpo.engines.base"]
    # the check sees a crossing when there is one
    leak = {**graph, "diffgrpo.dllm.grpo": graph["diffgrpo.dllm.grpo"] | {"diffgrpo.engines.base"}}
    assert _crossings(leak, "dllm", "engines") == [("diffgrpo.dllm.grpo", "diffgrpo.engines.base")]


def test_the_command_line_names_no_family_and_the_adapter_no_architecture():
    """cli/ calls the family protocol (what a family decides comes back as data), and the diffusers adapter
    dispatches through its pipeline row: neither compares a name of the other side (the rows' names and the
    families' keys)."""
    from diffgrpo.families import FAMILIES
    from diffgrpo.models.pipelines import PIPELINES

    def compared(source: str) -> set[str]:
        """String constants compared with ==, != or in (a literal tuple/list/set) in ``source``."""
        out = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Compare):
                for c in [node.left, *node.comparators]:
                    elts = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                    out |= {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        return out

    cli = set().union(*(compared(p.read_text()) for p in (SRC / "cli").glob("*.py")))
    assert cli & set(FAMILIES) == set()
    assert not any(re.search(r"\b(FlowFamily|DLLMFamily)\b", p.read_text()) for p in (SRC / "cli").glob("*.py"))
    assert compared((SRC / "models" / "diffusers_adapter.py").read_text()) & set(PIPELINES) == set()
    # the scan sees such a branch where there is one
    assert compared("if family_of(name) == 'dllm' or row.name in ('sd3', 'flux'): pass") == {"dllm", "sd3", "flux"}


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers (and fixtures in conftest.py): no test module imports a test_* module
    or conftest."""
    tests = Path(__file__).parent
    found = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    re.match(r"(tests\.)?(test_\w+|conftest)$", node.module):
                found.append(f"{path.name}:{node.lineno} {node.module}")
    assert found == []
