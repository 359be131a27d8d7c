"""Numeric answers (GSM8K, MATH-style integers and decimals) read exactly, and the file-only ``gsm8k`` task."""
from __future__ import annotations

import re
from fractions import Fraction
from typing import ClassVar

from .base import Example, Task

# ---------------------------------------------------------------------------------------------- GSM8K-style
# Numeric answers (GSM8K, MATH-style integers and decimals):
#   * the prediction is the content of the LAST \boxed{...} (balanced braces), else the last number inside the last
#     <answer>...</answer> (d1's XML format), else the last number of the whole completion;
#   * numbers are read with thousands separators (1,234), a sign, decimals, $ / % / a trailing period dropped, a/b
#     and \frac{a}{b} as exact fractions; the comparison is exact (fractions.Fraction), so 72, 72.0 and $72.00 agree;
#   * a reference is read the same way, GSM8K's "#### 72" tail first. Literals longer than 40 digits are not numbers.
# Every function is linear in its input, which is bounded (NUMERIC_MAX_CHARS), and never raises.
NUMERIC_MAX_CHARS = 65536  # completions longer than this are not parsed (reward 0)
_MAX_DIGITS = 40
_NUM_RE = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?")
_FRAC_RE = re.compile(r"^\\[dt]?frac\{(-?[0-9.]+)\}\{(-?[0-9.]+)\}$")
_GSM8K_TAIL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` whose brace is closed, or None. One linear pass
    (a stack of open braces), whatever the nesting."""
    if not isinstance(text, str) or len(text) > NUMERIC_MAX_CHARS:
        return None
    closes: dict[int, int] = {}  # index of "{" → index of its "}"
    stack: list[int] = []
    for j, ch in enumerate(text):
        if ch == "{":
            stack.append(j)
        elif ch == "}" and stack:
            closes[stack.pop()] = j
    best = -1
    for m in re.finditer(r"\\(?:boxed|fbox)\{", text):
        if m.end() - 1 in closes:
            best = m.end() - 1
    return text[best + 1:closes[best]].strip() if best >= 0 else None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (``1,234``, ``-5``, ``3.75``, ``3/4``) as written, or None."""
    if not isinstance(text, str) or len(text) > NUMERIC_MAX_CHARS:
        return None
    found = _NUM_RE.findall(text)
    return found[-1] if found else None


def parse_number(s: str) -> Fraction | None:
    """A number's exact value, or None when ``s`` is not one number. Accepts the forms :func:`last_number` finds,
    ``$``, ``%``, a trailing period, ``\\text{..}`` units after it, surrounding spaces and ``\\frac{a}{b}``."""
    if not isinstance(s, str) or len(s) > 256:
        return None
    t = s.strip().replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").replace("\\!", "")
    t = re.sub(r"\\(?:text|mathrm)\{[^{}]*\}", "", t).strip().rstrip(".").strip()
    m = _FRAC_RE.match(t)
    if m:
        num, den = parse_number(m.group(1)), parse_number(m.group(2))
        return None if num is None or not den else num / den
    if not _NUM_RE.fullmatch(t):
        return None
    if sum(c.isdigit() for c in t) > _MAX_DIGITS:
        return None
    t = t.replace(",", "")
    try:
        if "/" in t:
            a, b = t.split("/")
            return None if Fraction(b) == 0 else Fraction(a) / Fraction(b)
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` pair (the last closing tag and the last opening tag before it;
    two reverse scans, no regex backtracking), or None."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>"):end] if start >= 0 else None



def predicted_number(completion: str) -> Fraction | None:
    """The completion's numeric answer: last boxed, else the last number in the last <answer> tag, else the
    last number; None if there is none."""
    if not isinstance(completion, str) or len(completion) > NUMERIC_MAX_CHARS:
        return None
    boxed = extract_boxed(completion)
    if boxed is not None:
        v = parse_number(boxed)
        if v is None:  # a box around an expression or words: its last number
            n = last_number(boxed)
            v = parse_number(n) if n is not None else None
        return v
    tag = last_answer_tag(completion)
    if tag is not None:
        n = last_number(tag)
        if n is not None:
            return parse_number(n)
    n = last_number(completion)
    return parse_number(n) if n is not None else None


def reference_number(answer: str) -> Fraction | None:
    """A reference answer's value: GSM8K's ``#### N`` tail, else as :func:`predicted_number` reads it."""
    if not isinstance(answer, str) or len(answer) > NUMERIC_MAX_CHARS:
        return None
    m = _GSM8K_TAIL.search(answer)
    if m is not None:
        v = parse_number(m.group(1))
        if v is not None:
            return v
    return predicted_number(answer)


def numeric_correct(completion, reference) -> bool:
    """Whether the completion's numeric answer equals the reference's (exact). Never raises."""
    ref = reference if isinstance(reference, Fraction) else reference_number(str(reference))
    if ref is None:
        return False
    pred = predicted_number(completion)
    return pred is not None and pred == ref



class Numeric(Task):
    """Word problems with a numeric answer (GSM8K, MATH-style integers): no generator, the instances come from
    ``dllm.data_file`` (and ``dllm.eval_file``). The reference is the record's answer (GSM8K's ``#### N`` tail, a
    ``\\boxed{}`` or its last number); a completion is correct when its boxed answer (else the last number of its
    <answer> tag, else its last number) equals it exactly (:mod:`diffgrpo.rewards.verifiers`)."""

    name, prompt_length, gen_length = "gsm8k", 256, 256  # d1's generation length for GSM8K

    def instances(self, split):
        return []

    def example(self, prompt, answer):
        ref = reference_number(answer)
        if ref is None:
            raise ValueError(f"answer {answer[:80]!r} holds no number (GSM8K '#### N', a boxed value or a number)")
        return Example(prompt, answer, {"target": ref, "answer": answer})

    refused: ClassVar[dict[str, float]] = {"reward": 0.0, "correct": 0.0}

    def score(self, completion, ex):
        correct = float(numeric_correct(completion, ex.meta["target"]))
        return {"reward": correct, "correct": correct}
