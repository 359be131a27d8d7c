"""Competition math: answers compared for mathematical equivalence with the ``math-verify`` package.

  math   a problem (MATH, AIME, ...) from dllm.data_file   reward = correct = 1 if the completion's answer equals
         (no generator)                                      the reference mathematically, else 0

Reading: the reference is the record's answer field: a LaTeX answer (``\\frac{1}{2}``, ``[1,2)``, ``2\\sqrt{2}``,
``50\\%``) or a solution holding a ``\\boxed{}``; the prediction is the completion's last ``\\boxed{}`` (else its
LaTeX ``$...$`` answer, else the content of its last ``<answer>`` tag, else its last number), parsed as LaTeX.
Only LaTeX extraction is used: math-verify's plain-expression extraction goes through ``sympy.parse_expr``, which
calls ``eval`` on the text, and a completion is hostile input. Equivalence is math-verify's ``verify`` (sympy:
numbers to 6 decimals, fractions, radicals, intervals, sets, percentages as fractions); GSM8K keeps its exact
numeric rule (:func:`diffgrpo.tasks.numeric_correct`).

Timeouts: math-verify bounds parsing and comparison with ``signal.alarm``, which works only in the main thread.
In the main thread each call gets ``timeout_s`` (10) seconds; in any other thread (a background reward) the calls run
without the alarm, and the bound is the input's size: answers longer than ``MAX_ANSWER_CHARS`` are not parsed.
Estimator: none. Cost: a sympy parse of two short strings and one comparison per completion.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .base import draw

MAX_COMPLETION_CHARS = 65536
MAX_ANSWER_CHARS = 512
_NUM_RE = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:/[0-9]+)?")
_DOLLAR_RE = re.compile(r"\$([^$]{1,512})\$")  # MAX_ANSWER_CHARS


def _math_verify():
    """The math-verify module (the ``math`` extra), or None when it is not installed."""
    try:
        import math_verify  # optional: pip install 'diffgrpo[math]'
    except ImportError:
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the thread-timeout notice is said once, in the docs
    return math_verify


def _timeout(timeout_s: int) -> int | None:
    return timeout_s if threading.current_thread() is threading.main_thread() else None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance (linear scan), or None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, j = 0, start + len("\\boxed")
        for j in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[start + len("\\boxed{"):j]
        start = text.rfind("\\boxed{", 0, start)
    return None


def answer_latex(completion: str) -> str | None:
    """The LaTeX of a completion's answer as parsed (see the module doc), or None."""
    if not isinstance(completion, str) or len(completion) > MAX_COMPLETION_CHARS:
        return None
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0:
        return completion[start + len("<answer>"):end].strip().strip("$").strip() or None
    dollars = _DOLLAR_RE.findall(completion)
    if dollars:
        return dollars[-1].strip()
    nums = _NUM_RE.findall(completion)
    return nums[-1] if nums else None


def parse_answer(latex: str | None, timeout_s: int = 10) -> list:
    """math-verify's parse of one answer (LaTeX extraction only) → its parsed forms ([] when none)."""
    mv = _math_verify()
    if mv is None or not latex or len(latex) > MAX_ANSWER_CHARS:
        return []
    try:
        return mv.parse(f"$\\boxed{{{latex}}}$", extraction_config=[mv.LatexExtractionConfig()],
                        parsing_timeout=_timeout(timeout_s))
    except Exception:  # noqa: BLE001 - an answer that cannot be read is no answer
        return []


def reference_latex(answer: str) -> str | None:
    """A reference: the last boxed value of a solution, else the answer itself."""
    if not isinstance(answer, str) or not answer.strip():
        return None
    boxed = _last_boxed(answer)
    return (boxed if boxed is not None else answer).strip().strip("$").strip() or None


def math_equal(completion: str, reference: str, timeout_s: int = 10) -> bool:
    """Whether the completion's answer equals the reference mathematically (math-verify). Never raises."""
    mv = _math_verify()
    gold = parse_answer(reference_latex(reference), timeout_s)
    pred = parse_answer(answer_latex(completion), timeout_s)
    if mv is None or not gold or not pred:
        return False
    try:
        return bool(mv.verify(gold, pred, timeout_seconds=_timeout(timeout_s)))
    except Exception:  # noqa: BLE001 - a comparison that fails is not an agreement
        return False


@dataclass(frozen=True)
class MathExample:
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, hash=False, compare=False)


class MathTask:
    """Competition-math problems from ``dllm.data_file``; reward 1 for a mathematically equal answer."""

    name, prompt_length, gen_length = "math", 256, 256
    refused: ClassVar[dict[str, float]] = {"reward": 0.0, "correct": 0.0}

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
        if _math_verify() is None:
            raise ValueError("dllm.task=math needs the math-verify package (pip install 'diffgrpo[math]')")
        ref = reference_latex(answer)
        if not parse_answer(ref):
            raise ValueError(f"answer {answer[:80]!r} is not a LaTeX answer math-verify can read")
        return MathExample(prompt, f"\\boxed{{{ref}}}", {"reference": ref, "answer": answer})

    def reward(self, completion, ex) -> dict[str, float]:
        if not isinstance(completion, str) or len(completion) > self.max_chars:
            return dict(self.refused)
        ok = float(math_equal(completion, ex.meta["reference"]))
        return {"reward": ok, "correct": ok}

    def rewards(self, completions, examples) -> dict[str, torch.Tensor]:
        rows = [self.reward(c, e) for c, e in zip(completions, examples)]
        return {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in rows[0]}


__all__ = [
    "MAX_ANSWER_CHARS",
    "MathExample",
    "MathTask",
    "answer_latex",
    "math_equal",
    "parse_answer",
    "reference_latex",
]
