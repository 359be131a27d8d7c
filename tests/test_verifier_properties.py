"""Property-based checks of the built-in verifiers: any string scores without raising, every component finite and
in [0, 1] (json_schema's ``errors`` is a count: −1 or a non-negative integer), reference answers score 1, and the
bounded countdown parser agrees with the ast reading it replaced."""
from __future__ import annotations

import ast
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffgrpo.tasks import TASKS, get_task, safe_eval
from diffgrpo.tasks.generated import _canonical_int, _json_depth

FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

_TASKS = {name: get_task(name) for name in TASKS}
_POOLS = {name: t.instances("train") + t.instances("test") for name, t in _TASKS.items()}


# ---------------------------------------------------------------------------------------------- strategies
def _size(lo: int, hi: int, marks: list[int]):
    """A length in [lo, hi], often exactly one of the ``marks`` (the thresholds where verifiers used to break)."""
    return st.sampled_from(marks) | st.integers(lo, hi)


def _repeat(piece, size):
    """``piece`` repeated ``size`` times (long strings without drawing every character)."""
    return st.builds(lambda s, n: s * n, piece, size)


DIGITS = st.text("0123456789", max_size=40)
LONG_NUMBER = st.builds(lambda a, b, n: a + b * n, st.sampled_from("-123456789"), st.sampled_from("0123456789"),
                        _size(300, 6000, [308, 309, 400, 4299, 4300, 4301, 5000]))
EXPR_CHARS = st.text("0123456789+-*/() ", max_size=60)
UNICODE_DIGITS = st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=20)
GRID_LIKE = st.text(st.sampled_from("1234١٢٣٤¹²³⁴１２３４①"), min_size=16, max_size=16)  # str.isdigit() says yes to all
FRAGMENT = st.sampled_from(["<answer>", "</answer>", "<mask>", "(", ")", "**", "*", "/", "-", "+", "[", "]", "{",
                            "}", '"', "\\", ":", ",", "\x00", "٣", "²", "１", "1e999", "NaN", "Infinity", "true",
                            "null", '{"a":', '"x"', " ", "\n", "9" * 400, "0" * 20, "(" * 40, "[" * 70])
FRAGMENTS = st.lists(FRAGMENT, max_size=30).map("".join)
DEEP = _repeat(st.sampled_from(["[", '{"a":', "(", "-", "1+", "1*", "9**"]), _size(1, 10**5, [33, 65, 1000, 10**5]))
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                       max_size=4), max_leaves=20)
JSONISH = JSON_VALUES.map(json.dumps) | st.text('{}[]":,0123456789abcdeftrunlsTFN.-+eE \\', max_size=60)
LONG = _repeat(st.text(min_size=1, max_size=4), _size(1, 10**6, [16, 300, 4301, 10**5, 10**6]))
WRAP = st.sampled_from(["{}", "<answer>{}</answer>", " {} ", "<answer>{}1</answer>", "{}]"])


@st.composite
def answers_and_mutants(draw, name):
    """A reference answer of the task, then a few random edits (insert, delete, replace), maybe wrapped."""
    text = list(draw(st.sampled_from(_POOLS[name])).answer)
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        ch = draw(st.sampled_from("0123456789+-*/()[]{}\":,. \x00٣x") | st.characters())
        if op == "insert":
            text.insert(i, ch)
        elif text and i < len(text):
            if op == "delete":
                del text[i]
            else:
                text[i] = ch
    s = "".join(text)
    return draw(st.sampled_from([s, f"<answer>{s}</answer>", f" {s} ", s * 2]))


def completions(name):
    """Anything: free text, the characters and fragments each verifier reads, and edited reference answers."""
    wrapped = st.builds(str.format, WRAP, DIGITS | EXPR_CHARS | UNICODE_DIGITS | JSONISH)
    return st.one_of(st.text(), DIGITS, EXPR_CHARS, UNICODE_DIGITS, FRAGMENTS, JSONISH, wrapped,
                     answers_and_mutants(name))


# the shapes that broke a verifier before: huge literals, deep nesting, long chains, non-ASCII digits, sheer length
ADVERSARIAL = st.builds(str.format, WRAP, LONG_NUMBER | DEEP | GRID_LIKE | LONG)


def _in_range(name: str, scored: dict[str, float]) -> None:
    assert set(scored) == set(_TASKS[name].refused)
    for k, v in scored.items():
        assert isinstance(v, float) and math.isfinite(v), (k, v)
        if k == "errors":  # a count of schema errors, −1 when not JSON
            assert v == -1.0 or (v >= 0 and v == int(v)), v
        else:
            assert 0.0 <= v <= 1.0, (k, v)
    assert scored["correct"] in (0.0, 1.0)


# ---------------------------------------------------------------------------------------------- properties
@pytest.mark.parametrize("name", list(TASKS))
@FAST
@given(data=st.data())
def test_any_completion_scores_in_range_without_raising(name, data):
    completion = data.draw(completions(name), label="completion")
    ex = data.draw(st.sampled_from(_POOLS[name]), label="instance")
    _in_range(name, _TASKS[name].reward(completion, ex))


@pytest.mark.parametrize("name", list(TASKS))
@FAST
@given(data=st.data())
def test_adversarial_completions_score_in_range_without_raising(name, data):
    completion = data.draw(ADVERSARIAL, label="completion")
    ex = data.draw(st.sampled_from(_POOLS[name]), label="instance")
    _in_range(name, _TASKS[name].reward(completion, ex))


@pytest.mark.parametrize("name", list(TASKS))
@FAST
@given(data=st.data())
def test_reference_answers_score_one(name, data):
    ex = data.draw(st.sampled_from(_POOLS[name]), label="instance")
    pad = data.draw(st.sampled_from(["", " ", "  ", "\n"]), label="pad")
    for completion in (ex.answer, pad + ex.answer + pad):
        r = _TASKS[name].reward(completion, ex)
        assert r["correct"] == 1.0 and r["reward"] == 1.0, (completion, r)


def _ast_reading(expr: str):
    """The reading safe_eval replaced: Python's parser, then +, −, *, / and unary minus in floats."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None
    nums: list[int] = []

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and type(n.value) is int:
            nums.append(n.value)
            return float(n.value)
        if isinstance(n, ast.BinOp) and type(n.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Add):
                return a + b
            if isinstance(n.op, ast.Sub):
                return a - b
            if isinstance(n.op, ast.Mult):
                return a * b
            if b == 0:
                raise ZeroDivisionError
            return a / b
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        raise ValueError

    try:
        return ev(tree), nums
    except (ValueError, ZeroDivisionError):
        return None


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a[1] == b[1] and (a[0] == b[0] or (math.isnan(a[0]) and math.isnan(b[0])))


def _expressions():
    leaf = st.integers(0, 10**6).map(str)

    def extend(inner):
        op = st.tuples(st.sampled_from(["", " "]), st.sampled_from("+-*/")).map(lambda t: f"{t[0]}{t[1]}{t[0]}")
        return (st.tuples(inner, op, inner).map("".join) | inner.map(lambda e: f"({e})")
                | inner.map(lambda e: f"-{e}"))

    return st.recursive(leaf, extend, max_leaves=12)


@FAST
@given(expr=_expressions() | st.text("0123456789+-*/() ", max_size=30).map(str.strip))
def test_safe_eval_agrees_with_the_ast_reading(expr):
    if any(len(tok) > 15 for tok in "".join(c if c.isdigit() else " " for c in expr).split()):
        assert safe_eval(expr) is None  # longer literals are refused (they were an OverflowError past 309 digits)
        return
    assert _same(safe_eval(expr), _ast_reading(expr)), expr


@FAST
@given(digits=st.from_regex(r"-?[0-9]{1,300}", fullmatch=True))
def test_canonical_int_matches_int(digits):
    assert _canonical_int(digits) == str(int(digits))


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


@FAST
@given(value=JSON_VALUES)
def test_json_depth_scan_matches_the_document(value):
    assert _json_depth(json.dumps(value)) == _depth(value)
