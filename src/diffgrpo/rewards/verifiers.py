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
(reference: ``metadata["answer"]``), ``verify_countdown`` / ``verify_sudoku`` / ``verify_json_schema`` (the task's
own verifier of :mod:`diffgrpo.tasks`; the instance is read from the prompt and ``metadata["answer"]``, which
sudoku needs: its solution) and ``d1_format``. A completion that is not a string (an image tensor) scores 0.

d1's format rewards (Zhao et al., 2025, ``diffu_grpo`` reward functions for GSM8K): strict XML format (0.5),
soft XML format (0.5) and the XML tag count (0.125 per tag written once, minus 0.001 per character after the
closing tag): :func:`d1_format_components`; their sum (at most 1.5) is :func:`d1_format_score`.
"""
from __future__ import annotations

import re

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


def d1_format(completions, prompts, metadata) -> list[float]:
    """d1's format rewards summed (strict + soft + xmlcount, at most 1.5) per completion."""
    return [d1_format_score(c) for c in completions]


__all__ = ["MAX_CHARS", "last_answer_tag", "extract_boxed", "last_number", "parse_number", "predicted_number",
           "reference_number",
           "numeric_correct", "d1_format_components", "d1_format_score", "verify_gsm8k", "verify_countdown",
           "verify_sudoku", "verify_json_schema", "d1_format"]
