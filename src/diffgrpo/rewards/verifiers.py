"""Text verifiers as rewards: GSM8K-style numeric answers, Countdown, Sudoku, JSON schema, and d1's format rewards.

Estimator: none (exact, deterministic checks of a completion string against a reference). Cost: linear in the
completion's length, which is bounded (``MAX_CHARS``; longer strings score 0 unparsed), so an adversarial
completion is refused in O(1) beyond its length check and nothing ever raises.

Numeric answers (GSM8K, MATH-style integers and decimals):
  * the prediction is the content of the LAST ``\\boxed{...}`` (balanced braces), else the last number inside the
    last ``<answer>...</answer>`` (d1's XML format), else the last number of the whole completion;
  * numbers are read with thousands separators (``1,234``), a sign, decimals, ``$`` / ``%`` / a trailing period
    dropped, ``a/b`` and ``\\frac{a}{b}`` as exact fractions; the comparison is exact (``fractions.Fraction``), so
    ``72``, ``72.0`` and ``$72.00`` agree and ``0.1+0.2``-style float error cannot make a wrong answer right;
  * a reference is read the same way, GSM8K's ``#### 72`` tail first.
  Literals longer than 40 digits are not numbers (no huge-integer work).

The numeric reading lives with the other task verifiers in :mod:`diffgrpo.tasks` (re-exported here).

Registry rewards (``reward.weights``; signature ``fn(completions, prompts, metadata) -> (B,)``): ``verify_gsm8k``
(reference: ``metadata["answer"]``), ``verify_math`` (math-verify equivalence with ``metadata["answer"]``),
``verify_code`` / ``verify_code_pass_at_1`` (the completion's code run in a sandbox against the record's tests:
fraction passed / all passed; options backend, workers, timeout, memory_mb, url), ``verify_countdown`` /
``verify_sudoku`` / ``verify_json_schema`` (the task's own verifier of :mod:`diffgrpo.tasks`; the instance is read
from the prompt and ``metadata["answer"]``, which
sudoku needs: its solution) and ``d1_format``. A completion that is not a string (an image tensor) scores 0.

d1's format rewards (Zhao et al., 2025, ``diffu_grpo`` reward functions for GSM8K): strict XML format (0.5),
soft XML format (0.5) and the XML tag count (0.125 per tag written once, minus 0.001 per character after the
closing tag): :func:`d1_format_components`; their sum (at most 1.5) is :func:`d1_format_score`.
"""
from __future__ import annotations

import re

from ..sandbox import Limits, make_sandbox
from ..tasks import (
    NUMERIC_MAX_CHARS,
    extract_boxed,
    get_task,
    last_answer_tag,
    last_number,
    numeric_correct,
    parse_number,
    predicted_number,
    reference_number,
)
from ..tasks.code import SandboxScorer, extract_code, program_for, record_meta
from ..tasks.competition_math import math_equal

MAX_CHARS = NUMERIC_MAX_CHARS  # completions longer than this are not parsed (reward 0)


# ---------------------------------------------------------------------------------------------- d1 format
_JUNCTION = "\n</reasoning>\n<answer>\n"


def _strict_format(text: str) -> bool:
    """d1's strict format, ``re.match(r"^<reasoning>\\n.*?\\n</reasoning>\\n<answer>\\n.*?\\n</answer>\\n?$",
    text, re.S)``, decided in linear time (the earliest junction, then the tail)."""
    head = "<reasoning>\n"
    if not text.startswith(head):
        return False
    for tail in ("\n</answer>", "\n</answer>\n", "\n</answer>\n\n"):  # ``\n?$``: $ also matches before a final \n
        if text.endswith(tail):
            k = text.find(_JUNCTION, len(head))
            if k >= 0 and k + len(_JUNCTION) <= len(text) - len(tail):
                return True
    return False
_SOFT_MID = re.compile(r"</reasoning>\s*<answer>")


def _soft_format(text: str) -> bool:
    """d1's soft format, ``re.search(r"<reasoning>.*?</reasoning>\\s*<answer>.*?</answer>", text, re.S)``, decided
    in linear time: some ``</reasoning> <answer>`` junction after the first ``<reasoning>`` and before the last
    ``</answer>``."""
    first = text.find("<reasoning>")
    last = text.rfind("</answer>")
    if first < 0 or last < 0:
        return False
    for m in _SOFT_MID.finditer(text, first + len("<reasoning>")):
        return m.end() <= last  # the earliest junction is the best one
    return False


def d1_format_components(text) -> dict[str, float]:
    """d1's three format rewards of one completion: strict (0.5), soft (0.5), xmlcount (<= 0.5). Zeros for a
    non-string or an over-long string."""
    if not isinstance(text, str) or len(text) > MAX_CHARS:
        return {"format_strict": 0.0, "format_soft": 0.0, "format_xmlcount": 0.0}
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return {"format_strict": 0.5 * _strict_format(text), "format_soft": 0.5 * _soft_format(text),
            "format_xmlcount": count}


def d1_format_score(text) -> float:
    """Sum of d1's three format rewards (at most 1.5)."""
    return float(sum(d1_format_components(text).values()))


# ---------------------------------------------------------------------------------------------- registry rewards
def _meta(metadata, i: int) -> dict:
    m = metadata[i] if metadata is not None and i < len(metadata) else None
    return m if isinstance(m, dict) else {}


def verify_gsm8k(completions, prompts, metadata) -> list[float]:
    """1.0 when the completion's numeric answer equals ``metadata["answer"]`` (GSM8K ``#### N``, boxed or a
    number), else 0.0."""
    return [float(numeric_correct(c, _meta(metadata, i).get("answer", ""))) for i, c in enumerate(completions)]


def _task_reward(task_name: str):
    def fn(completions, prompts, metadata) -> list[float]:
        task = get_task(task_name)
        out = []
        for i, c in enumerate(completions):
            meta = _meta(metadata, i)
            try:
                ex = task.example(str(prompts[i]).strip(), str(meta.get("answer", "")).strip())
            except (ValueError, KeyError, TypeError):  # not an instance of the task: nothing to verify against
                out.append(0.0)
                continue
            out.append(float(task.reward(c, ex)["reward"]))
        return out

    fn.__name__ = f"verify_{task_name}"
    fn.__doc__ = f"The {task_name} task's reward of each completion (instance from the prompt and metadata['answer'])."
    return fn


verify_countdown = _task_reward("countdown")
verify_sudoku = _task_reward("sudoku")
verify_json_schema = _task_reward("json_schema")


def verify_math(completions, prompts, metadata) -> list[float]:
    """1.0 when the completion's answer equals ``metadata["answer"]`` mathematically (math-verify: boxed LaTeX,
    fractions, radicals, intervals, percentages; :mod:`diffgrpo.tasks.competition_math`), else 0.0."""
    return [float(math_equal(c, str(_meta(metadata, i).get("answer", "")))) for i, c in enumerate(completions)]


def _code_programs(completions, prompts, metadata) -> list:
    """One program per completion with its record's tests (MBPP ``test_list`` / HumanEval ``test`` +
    ``entry_point`` in the metadata), or None where the completion or the record cannot make one."""
    out = []
    for i, c in enumerate(completions):
        try:
            meta, _ = record_meta({"prompt": str(prompts[i]), **_meta(metadata, i)}, f"sample {i}")
        except ValueError:
            meta = None
        out.append(program_for(extract_code(c), meta) if meta is not None and isinstance(c, str) else None)
    return out


def build_verify_code(device=None, *, backend: str = "auto", workers: int = 0, timeout: float = 10.0,
                      memory_mb: int = 512, url: str = "", pass_at_1: bool = False):
    """``verify_code`` with its ``reward.options`` (``device`` is not read: nothing runs on an accelerator): the
    fraction of each completion's tests that pass in the sandbox (``pass_at_1``: 1.0 when all pass). The pool
    starts on the first call; completions whose record has no tests score 0."""
    scorer = SandboxScorer()

    def fn(completions, prompts, metadata) -> list[float]:
        if scorer.pool is None:
            scorer.use(make_sandbox(backend, workers=workers, url=url, key="reward.options.verify_code",
                                    limits=Limits(timeout_s=timeout, memory_mb=memory_mb)))
        progs = _code_programs(completions, prompts, metadata)
        runs = iter(scorer.run([p for p in progs if p is not None]))
        out = []
        for p in progs:
            r = next(runs) if p is not None else None
            score = float("nan") if r is not None and r.infra else None  # not run: neither a pass nor a fail
            out.append(0.0 if r is None else score if score is not None else
                       (float(r.all_passed) if pass_at_1 else r.fraction))
        return out

    fn.__name__ = "verify_code_pass_at_1" if pass_at_1 else "verify_code"
    return fn


def _default_code_reward(pass_at_1: bool):
    built = []

    def fn(completions, prompts, metadata) -> list[float]:
        if not built:
            built.append(build_verify_code(pass_at_1=pass_at_1))
        return built[0](completions, prompts, metadata)

    fn.__name__ = "verify_code_pass_at_1" if pass_at_1 else "verify_code"
    fn.__doc__ = ("1.0 when all of the completion's tests pass in the sandbox, else 0.0" if pass_at_1 else
                  "The fraction of the completion's tests (metadata: MBPP test_list, or HumanEval test and "
                  "entry_point) that pass in the sandbox")
    return fn


verify_code = _default_code_reward(False)
verify_code_pass_at_1 = _default_code_reward(True)


def d1_format(completions, prompts, metadata) -> list[float]:
    """d1's format rewards summed (strict + soft + xmlcount, at most 1.5) per completion."""
    return [d1_format_score(c) for c in completions]


__all__ = ["MAX_CHARS", "last_answer_tag", "extract_boxed", "last_number", "parse_number", "predicted_number",
           "reference_number",
           "numeric_correct", "d1_format_components", "d1_format_score", "verify_gsm8k", "verify_countdown",
           "verify_sudoku", "verify_json_schema", "d1_format", "verify_math", "verify_code", "verify_code_pass_at_1",
           "build_verify_code"]
