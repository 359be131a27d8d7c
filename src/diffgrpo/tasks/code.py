"""Code tasks whose reward runs the completion's code against tests in a sandbox (:mod:`diffgrpo.sandbox`).

  code      MBPP / HumanEval records from dllm.data_file       reward = fraction of the tests passed,
            (no generator)                                      pass_at_1 = correct = all of them passed
  code_toy  "f(0)=1,f(2)=5,f(3)=7" → "<answer>2*x+1</answer>"   reward 0.1·format + 0.9·(fraction of held-out
            (generated; split by the function)                  pairs f(6), f(9), f(-4) passed), correct = all

Record layouts (``dllm.data_file`` / ``eval_file``, JSONL or ``hf:``; the prompt field is ``dllm.prompt_field``,
MBPP's ``text`` or HumanEval's ``prompt``):

  MBPP       ``test_list``: assert lines, optional ``test_setup_code``, reference ``code``
  HumanEval  ``test``: source defining ``check(candidate)``, ``entry_point``, reference ``canonical_solution``;
             a completion that does not define ``entry_point`` continues the prompt (prompt + completion runs)

The completion's code is its first fenced block (```python … ``` or ``` … ```), else the content of a whole
``<answer>…</answer>``, else the completion itself. Every completion runs in its own sandboxed process (the task's
:class:`~diffgrpo.sandbox.SandboxPool`, ``dllm.sandbox*`` keys); identical programs run once (a bounded
memo of results: :class:`SandboxScorer`).
Loading a data file checks the layout only: no reference solution runs before training starts.
A program the sandbox could not run (after its retries) scores NaN, excluded like a NaN reward and counted in the
``sandbox_infra_failures`` component (logged as ``rewards/sandbox_infra_failures/mean``: the share of the batch);
a sandbox that keeps failing stops the run (:class:`SandboxScorer`).
Estimator: none (exact test outcomes). Cost: one interpreter start per distinct completion, ``workers`` at once.
"""
from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..data_sources import HF_PREFIX, load_prompts, resolve_builtin
from ..errors import ConfigError
from ..sandbox import BACKENDS, Limits, Program, Result, SandboxPool, SandboxUnavailable, make_sandbox
from .base import draw

_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_WHOLE_ANSWER_RE = re.compile(r"^\s*<answer>(.*?)</answer>\s*$", re.DOTALL)
MAX_CODE_CHARS = 65536


def extract_code(text) -> str:
    """The code of a completion: its first fenced block, else a whole ``<answer>…</answer>``'s content, else the
    text itself; "" for a non-string or a text longer than ``MAX_CODE_CHARS``."""
    if not isinstance(text, str) or len(text) > MAX_CODE_CHARS:
        return ""
    m = _FENCE_RE.search(text)
    if m is not None:
        return m.group(1)
    m = _WHOLE_ANSWER_RE.match(text)
    return m.group(1) if m is not None and "<answer>" not in m.group(1) else text


@dataclass(frozen=True)
class CodeExample:
    """A code instance: ``meta`` holds ``tests`` (list of test sources), ``setup``, ``entry_point`` and
    ``prompt_code`` (HumanEval's prompt, prepended when the completion does not define the entry point)."""
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, hash=False, compare=False)


def program_for(code: str, meta: dict) -> Program:
    """The program one completion's code makes with an instance's tests."""
    entry, head = meta.get("entry_point"), meta.get("prompt_code") or ""
    if head and entry and not re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        code = head.rstrip("\n") + "\n" + code  # (prompt fields are read stripped)
    return Program(code=code, tests=list(meta["tests"]), setup=meta.get("setup", ""))


def record_meta(rec: dict, where: str) -> tuple[dict, str]:
    """A record in MBPP or HumanEval layout → (meta, reference solution or ""); ValueError when it is neither."""
    if isinstance(rec.get("test_list"), list) and rec["test_list"]:
        tests = rec["test_list"]
        if not all(isinstance(t, str) and t.strip() for t in tests):
            raise ValueError(f"{where}: test_list must hold non-empty strings")
        setup = rec.get("test_setup_code") or ""
        if not isinstance(setup, str):
            raise ValueError(f"{where}: test_setup_code must be a string")
        ref = rec.get("code") if isinstance(rec.get("code"), str) else ""
        return {"tests": list(tests), "setup": setup, "entry_point": None, "prompt_code": None}, ref
    if isinstance(rec.get("test"), str) and rec["test"].strip():
        entry = rec.get("entry_point")
        if not isinstance(entry, str) or not entry.isidentifier():
            raise ValueError(f"{where}: a HumanEval record needs an entry_point (a Python name) beside its test")
        ref = rec.get("canonical_solution") if isinstance(rec.get("canonical_solution"), str) else ""
        return {"tests": [rec["test"] + f"\ncheck({entry})\n"], "setup": "", "entry_point": entry,
                "prompt_code": rec["prompt"]}, ref
    raise ValueError(f"{where}: neither MBPP (test_list of assert lines) nor HumanEval (test with check(candidate) "
                     f"and entry_point) layout")


def _program_key(p: Program) -> str:
    h = hashlib.sha256()
    for part in (p.setup, p.code, *p.tests):
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


class SandboxScorer:
    """Runs programs in a pool (made on first use with defaults unless :meth:`use` gave one). Identical programs
    in one call run once, and the results of programs that ended by themselves are remembered (the last
    ``memo`` of them): a program is scored as a function of its text (setup, code, tests).

    A program the sandbox could not run after the pool's retries (``Result.infra``) is neither a pass nor a fail:
    its scores are NaN (excluded like a NaN reward) and it is counted (``infra_failures``; the tasks' component
    ``sandbox_infra_failures``). The run stops (:class:`~diffgrpo.sandbox.SandboxUnavailable`, one line, exit 1)
    when the sandbox could run none of one call's programs (every completion of an iteration or an evaluation), or
    failed on at least half of them in ``patience`` calls in a row."""

    def __init__(self, memo: int = 8192, patience: int = 3):
        self.pool: SandboxPool | None = None
        self.memo: OrderedDict[str, Result] = OrderedDict()
        self.memo_size, self.patience = memo, patience
        self.infra_failures, self.failing_calls = 0, 0

    def use(self, pool: SandboxPool) -> None:
        self.pool = pool

    def run(self, programs: list[Program]) -> list[Result]:
        if not programs:
            return []
        if self.pool is None:
            self.pool = make_sandbox("auto", key="dllm.sandbox")
        keys = [_program_key(p) for p in programs]
        todo = {k: p for k, p in zip(keys, programs) if k not in self.memo}
        done = dict(zip(todo, self.pool.run_many(list(todo.values()))))
        for k, r in done.items():
            if r.status == "ok":
                self.memo[k] = r
                if len(self.memo) > self.memo_size:
                    self.memo.popitem(last=False)
        results = [done[k] if k in done else self.memo[k] for k in keys]
        self._judge(results)
        return results

    def _judge(self, results: list[Result]) -> None:
        """Count the programs the sandbox could not run; stop the run when it keeps failing."""
        bad = [r for r in results if r.infra]
        self.infra_failures += len(bad)
        self.failing_calls = self.failing_calls + 1 if 2 * len(bad) >= len(results) else 0
        if len(bad) == len(results) or self.failing_calls >= self.patience:
            why = " ".join(bad[-1].stderr.split())[-240:]
            raise SandboxUnavailable(
                f"the sandbox ({getattr(self.pool.backend, 'name', '?')}) could not run {len(bad)} of {len(results)} "
                f"programs after {self.pool.retries} retries each" + (f", and at least half in {self.failing_calls} "
                "calls in a row" if len(bad) < len(results) else "") + f"; the run stops (last: {why})")


def infra_row(keys) -> dict[str, float]:
    """The scores of a completion the sandbox could not run: NaN (neither a pass nor a fail), counted."""
    return {**{k: float("nan") for k in keys}, "sandbox_infra_failures": 1.0}


def _is_test(key: str, test_fraction: float, seed: int) -> bool:
    h = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:8], 16)
    return (h / 0xFFFFFFFF) < test_fraction


# ---------------------------------------------------------------------------------------------- code (files)
class CodeTask:
    """MBPP / HumanEval-style records from a file; the reward runs each completion against the record's tests."""

    name, prompt_length, gen_length = "code", 512, 256
    refused: ClassVar[dict[str, float]] = {"reward": 0.0, "pass_at_1": 0.0, "correct": 0.0,
                                           "sandbox_infra_failures": 0.0}

    def __init__(self):
        self.scorer = SandboxScorer()

    @property
    def max_chars(self) -> int:
        return 64 * self.gen_length

    def instances(self, split):
        return []

    def sample(self, split, n, generator):
        return draw(self.instances(split), n, generator)

    def slip(self, ex):
        return None

    def example(self, prompt, answer):
        raise ValueError("a code instance needs its tests: read it from a record (MBPP or HumanEval layout)")

    def examples_from_records(self, records: list[dict], *, key: str, path: str) -> list[CodeExample]:
        out = []
        for i, rec in enumerate(records, 1):
            try:
                meta, ref = record_meta(rec, f"record {i}")
            except ValueError as e:
                raise ConfigError(f"{key}: file {path!r} {e}") from None
            out.append(CodeExample(rec["prompt"], ref, meta))
        return out

    def reward(self, completion, ex) -> dict[str, float]:
        return self.rewards_rows([completion], [ex])[0]

    def rewards_rows(self, completions: list, examples: list) -> list[dict[str, float]]:
        rows: list[dict | None] = [None] * len(completions)
        todo = []
        for i, (c, e) in enumerate(zip(completions, examples)):
            if not isinstance(c, str) or len(c) > self.max_chars:
                rows[i] = dict(self.refused)
            else:
                todo.append((i, program_for(extract_code(c), e.meta)))
        for (i, _), r in zip(todo, self.scorer.run([p for _, p in todo])):
            rows[i] = infra_row(("reward", "pass_at_1", "correct")) if r.infra else {
                "reward": r.fraction, "pass_at_1": float(r.all_passed), "correct": float(r.all_passed),
                "sandbox_infra_failures": 0.0}
        return rows

    def rewards(self, completions, examples) -> dict[str, torch.Tensor]:
        rows = self.rewards_rows(completions, examples)
        return {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in rows[0]}


# ---------------------------------------------------------------------------------------------- code_toy
@dataclass(frozen=True)
class ToyFunction:
    """x → a·x ± b (``quad``: x·x ± b), written as the shortest expression in x."""
    a: int
    sign: int
    b: int
    quad: bool = False

    def expr(self) -> str:
        head = "x*x" if self.quad else ("x" if self.a == 1 else f"{self.a}*x")
        return head if self.b == 0 else f"{head}{'+' if self.sign > 0 else '-'}{self.b}"

    def __call__(self, x: int) -> int:
        return (x * x if self.quad else self.a * x) + self.sign * self.b


def toy_functions() -> list[ToyFunction]:
    """Every function of the toy task (114): a·x ± b for a in 1..5, b in 0..9; x·x ± b."""
    out = []
    for quad, a in [(False, a) for a in range(1, 6)] + [(True, 1)]:
        out.append(ToyFunction(a, 1, 0, quad))
        out += [ToyFunction(a, s, b, quad) for b in range(1, 10) for s in (1, -1)]
    return out


_TOY_ANSWER_RE = re.compile(r"^<answer>(.*?)</answer>$", re.DOTALL)


class CodeToy:
    """Write f from three input/output pairs (x in 0..5); the answer is an expression in x, run in the sandbox as
    ``f = lambda x: (<answer>)`` against the held-out pairs x = 6, 9, -4. The split is by function: no held-out
    function is ever seen in training. Slip (``pretrain.answer_noise``): the constant one too large."""

    name, prompt_length, gen_length = "code_toy", 24, 8
    test_fraction, split_seed = 0.2, 0
    held_out_inputs = (6, 9, -4)
    refused: ClassVar[dict[str, float]] = {"reward": 0.0, "format": 0.0, "correct": 0.0,
                                           "sandbox_infra_failures": 0.0}

    def __init__(self):
        self.scorer = SandboxScorer()
        self._cache: dict[str, list[CodeExample]] = {}

    @property
    def max_chars(self) -> int:
        return 64 * self.gen_length

    def _example(self, fn: ToyFunction, shown: tuple[int, ...]) -> CodeExample:
        prompt = ",".join(f"f({x})={fn(x)}" for x in shown)
        tests = [f"assert f({x}) == {fn(x)}" for x in self.held_out_inputs]
        return CodeExample(prompt, f"<answer>{fn.expr()}</answer>", {"tests": tests, "setup": "", "function": fn})

    def instances(self, split):
        if split not in self._cache:
            out = []
            for fn in toy_functions():
                if _is_test(fn.expr(), self.test_fraction, self.split_seed) != (split == "test"):
                    continue
                out += [self._example(fn, shown) for shown in itertools.combinations(range(6), 3)]
            random.Random(self.split_seed).shuffle(out)  # eval_size takes a prefix: mix the functions
            self._cache[split] = out
        return self._cache[split]

    def sample(self, split, n, generator):
        return draw(self.instances(split), n, generator)

    def example(self, prompt, answer):
        """An instance from its prompt: the function is the toy function that fits the three pairs."""
        m = re.fullmatch(r"f\((-?[0-9])\)=(-?[0-9]+),f\((-?[0-9])\)=(-?[0-9]+),f\((-?[0-9])\)=(-?[0-9]+)", prompt)
        if m is None:
            raise ValueError(f"prompt {prompt!r} is not f(x)=y,f(x)=y,f(x)=y")
        pairs = [(int(m.group(k)), int(m.group(k + 1))) for k in (1, 3, 5)]
        fits = [fn for fn in toy_functions() if all(fn(x) == y for x, y in pairs)]
        if not fits:
            raise ValueError(f"prompt {prompt!r} fits no toy function (a*x+-b, x*x+-b)")
        return self._example(fits[0], tuple(x for x, _ in pairs))

    def slip(self, ex):
        fn = ex.meta["function"]
        return f"<answer>{ToyFunction(fn.a, fn.sign if fn.b else 1, fn.b + 1, fn.quad).expr()}</answer>"

    def reward(self, completion, ex) -> dict[str, float]:
        return self.rewards_rows([completion], [ex])[0]

    def rewards_rows(self, completions: list, examples: list) -> list[dict[str, float]]:
        rows: list[dict | None] = [None] * len(completions)
        todo = []
        for i, (c, e) in enumerate(zip(completions, examples)):
            m = _TOY_ANSWER_RE.match(c.strip()) if isinstance(c, str) and len(c) <= self.max_chars else None
            body = m.group(1).strip() if m is not None else ""
            if not body or "<answer>" in body or "</answer>" in body:
                rows[i] = dict(self.refused)
            else:
                todo.append((i, Program(code=f"f = lambda x: ({body})", tests=list(e.meta["tests"]))))
        for (i, _), r in zip(todo, self.scorer.run([p for _, p in todo])):
            rows[i] = {**infra_row(("reward", "correct")), "format": 1.0} if r.infra else {
                "reward": 0.1 + 0.9 * r.fraction, "format": 1.0, "correct": float(r.all_passed),
                "sandbox_infra_failures": 0.0}
        return rows

    def rewards(self, completions, examples) -> dict[str, torch.Tensor]:
        rows = self.rewards_rows(completions, examples)
        return {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in rows[0]}


# ---------------------------------------------------------------------------------------------- files, config
def read_records(path: str, *, key: str, prompt_field: str) -> list[dict]:
    """The records of a code data source: a ``.jsonl`` file, ``builtin:<set>/<split>`` (shipped JSONL) or an
    ``hf:`` spec, each ``{"prompt": <prompt_field>, **fields}``."""
    if path.startswith("builtin:"):
        path = str(resolve_builtin(path, key))
    if not path.startswith(HF_PREFIX) and not path.lower().endswith(".jsonl"):
        raise ConfigError(f"{key}: file {path!r} is not a .jsonl file (MBPP or HumanEval records), a "
                          "builtin:<set>/<split> or an hf:<dataset>[:<split>] spec")
    return load_prompts(path, key=key, column=prompt_field)


def sandbox_limits(d) -> Limits:
    return Limits(timeout_s=d.sandbox_timeout, memory_mb=d.sandbox_memory_mb)


def attach_sandbox(task, d, log=print) -> None:
    """Give a code task the pool ``dllm.sandbox*`` asks for (started and checked now: a one-line SandboxError
    naming the backend when it cannot run here); other tasks are left alone."""
    if isinstance(task, (CodeTask, CodeToy)):
        task.scorer.use(make_sandbox(d.sandbox, workers=d.sandbox_workers, url=d.sandbox_url,
                                     limits=sandbox_limits(d), log=log, key="dllm.sandbox"))


def check_config(d) -> None:
    """The ``dllm.sandbox*`` keys: set only for a code task; remote needs a URL."""
    code = d.task in ("code", "code_toy")
    defaults = {"sandbox": "auto", "sandbox_workers": 0, "sandbox_timeout": 10.0, "sandbox_memory_mb": 512,
                "sandbox_url": ""}
    for k, v in defaults.items():
        if not code and getattr(d, k) != v:
            raise ConfigError(f"dllm.{k}: applies to the code tasks (dllm.task in ['code', 'code_toy']), not "
                              f"dllm.task={d.task}; remove it")
    if d.sandbox not in BACKENDS:
        raise ConfigError(f"dllm.sandbox: value {d.sandbox!r} is not allowed; choose one of {list(BACKENDS)}")
    if d.sandbox == "remote" and not d.sandbox_url.startswith(("http://", "https://")):
        raise ConfigError(f"dllm.sandbox_url: value {d.sandbox_url!r} must be the service's http(s) URL for "
                          "dllm.sandbox=remote (e.g. http://127.0.0.1:8080)")
    if d.sandbox_url and d.sandbox != "remote":
        raise ConfigError(f"dllm.sandbox_url: set only with dllm.sandbox=remote (it is {d.sandbox!r})")


__all__ = [
    "CodeExample",
    "CodeTask",
    "CodeToy",
    "SandboxScorer",
    "ToyFunction",
    "attach_sandbox",
    "check_config",
    "extract_code",
    "infra_row",
    "program_for",
    "read_records",
    "record_meta",
    "sandbox_limits",
    "toy_functions",
]
