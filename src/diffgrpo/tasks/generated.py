"""Tasks with their own seeded instance generator: arithmetic, 4×4 sudoku, countdown and JSON schema (bounded
verifiers: no ``eval``, literals of at most 15 digits, nesting at most 32 / 64 deep)."""
from __future__ import annotations

import itertools
import json
import random
import re
from typing import Any, ClassVar

from .base import Example, Task, _is_test, extract_answer


# ---------------------------------------------------------------------------------------------- arithmetic
def _canonical_int(digits: str) -> str:
    """'-?[0-9]+' → str(int(digits)) without int() (which refuses over 4300 digits): '-007' → '-7', '-0' → '0'."""
    neg = digits.startswith("-")
    body = digits.lstrip("-").lstrip("0") or "0"
    return "-" + body if neg and body != "0" else body


class Arithmetic(Task):
    name, prompt_length, gen_length = "arithmetic", 6, 8

    def __init__(self, max_operand: int = 19, ops: str = "+-"):
        self.max_operand, self.ops = max_operand, ops
        self._cache: dict[str, list[Example]] = {}

    def instances(self, split):
        if split not in self._cache:
            out = []
            for a, b, op in itertools.product(range(self.max_operand + 1), range(self.max_operand + 1), self.ops):
                val = {"+": a + b, "-": a - b, "*": a * b}[op]
                p = f"{a}{op}{b}="
                if _is_test(p, self.test_fraction, self.split_seed) == (split == "test"):
                    out.append(Example(p, f"<answer>{val}</answer>", {"target": val}))
            self._cache[split] = out
        return self._cache[split]

    def example(self, prompt, answer):
        """The target is the prompt's value (``a+b=``), so that the reference answer is checked against it."""
        parsed = safe_eval(prompt[:-1]) if prompt.endswith("=") else None
        if parsed is None or parsed[0] != int(parsed[0]):
            raise ValueError(f"prompt {prompt!r} is not an integer expression followed by =")
        return Example(prompt, answer, {"target": int(parsed[0])})

    refused: ClassVar[dict[str, float]] = {"reward": 0.0, "format": 0.0, "correct": 0.0}

    def score(self, completion, ex):
        ans = extract_answer(completion)
        fmt = ans is not None and re.fullmatch(r"-?[0-9]+", ans) is not None  # ASCII digits only
        correct = fmt and _canonical_int(ans) == str(ex.meta["target"])
        return {"reward": 0.1 * fmt + 0.9 * correct, "format": float(fmt), "correct": float(correct)}

    def slip(self, ex):
        """Off by one: the answer plus one."""
        return f"<answer>{ex.meta['target'] + 1}</answer>"


# ---------------------------------------------------------------------------------------------- sudoku 4x4
def _valid_grid(g: list[int]) -> bool:
    """g: 16 ints row-major; every row, column and 2×2 box holds 1..4 once."""
    units = [[r * 4 + c for c in range(4)] for r in range(4)] + [[r * 4 + c for r in range(4)] for c in range(4)]
    units += [[(br + r) * 4 + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)]
    return all(sorted(g[i] for i in u) == [1, 2, 3, 4] for u in units)


def all_sudoku_grids() -> list[tuple[int, ...]]:
    """Every valid 4×4 sudoku solution (288)."""
    rows = list(itertools.permutations([1, 2, 3, 4]))
    out: list[tuple[int, ...]] = []

    def extend(g: tuple[int, ...]):
        r = len(g) // 4
        if r == 4:
            out.append(g)
            return
        for row in rows:
            cols_ok = all(row[c] != g[k * 4 + c] for k in range(r) for c in range(4))
            box_ok = r % 2 == 0 or all(row[c] not in g[(r - 1) * 4 + c // 2 * 2:(r - 1) * 4 + c // 2 * 2 + 2]
                                       for c in range(4))
            if cols_ok and box_ok:
                extend(g + row)

    extend(())
    assert all(_valid_grid(list(g)) for g in out)
    return out


def count_solutions(puzzle: list[int], limit: int = 2) -> int:
    """Number of completions of ``puzzle`` (0 = blank), up to ``limit``."""
    try:
        i = puzzle.index(0)
    except ValueError:
        return int(_valid_grid(puzzle))
    r, c = divmod(i, 4)
    n = 0
    for v in range(1, 5):
        peers = [puzzle[r * 4 + k] for k in range(4)] + [puzzle[k * 4 + c] for k in range(4)]
        br, bc = r // 2 * 2, c // 2 * 2
        peers += [puzzle[(br + a) * 4 + bc + b] for a in range(2) for b in range(2)]
        if v in peers:
            continue
        puzzle[i] = v
        n += count_solutions(puzzle, limit - n)
        puzzle[i] = 0
        if n >= limit:
            break
    return n


class Sudoku(Task):
    name, prompt_length, gen_length = "sudoku", 16, 16

    def __init__(self, min_blanks: int = 4, max_blanks: int = 10, puzzles_per_grid: int = 4):
        self.min_blanks, self.max_blanks, self.per_grid = min_blanks, max_blanks, puzzles_per_grid
        self._cache: dict[str, list[Example]] = {}

    def instances(self, split):
        if split not in self._cache:
            rng = random.Random(self.split_seed)
            out = []
            for grid in all_sudoku_grids():
                sol = "".join(map(str, grid))
                if _is_test(sol, self.test_fraction, self.split_seed) != (split == "test"):
                    continue
                for _ in range(self.per_grid):
                    # remove cells one by one in random order while the solution stays unique
                    target = rng.randint(self.min_blanks, self.max_blanks)
                    puzzle = list(grid)
                    for i in rng.sample(range(16), 16):
                        if 16 - sum(v != 0 for v in puzzle) >= target:
                            break
                        keep, puzzle[i] = puzzle[i], 0
                        if count_solutions(list(puzzle)) != 1:
                            puzzle[i] = keep
                    p = "".join(str(v) if v else "." for v in puzzle)
                    out.append(Example(p, sol, {"solution": sol}))
            self._cache[split] = out
        return self._cache[split]

    def example(self, prompt, answer):
        if re.fullmatch("[1-4.]{16}", prompt) is None:
            raise ValueError(f"prompt {prompt!r} is not a 4x4 puzzle (16 characters of 1-4 and .)")
        return Example(prompt, answer, {"solution": answer})

    refused: ClassVar[dict[str, float]] = {"reward": 0.0, "cell_accuracy": 0.0, "correct": 0.0}

    def score(self, completion, ex):
        sol, puzzle = ex.meta["solution"], ex.prompt
        text = completion.strip()
        blanks = [i for i, ch in enumerate(puzzle) if ch == "."]
        hits = sum(1 for i in blanks if i < len(text) and text[i] == sol[i])
        acc = hits / max(len(blanks), 1)
        solved = (re.fullmatch("[1-4]{16}", text) is not None and _valid_grid([int(c) for c in text])
                  and all(p == "." or p == t for p, t in zip(puzzle, text)))
        return {"reward": 0.5 * acc + 0.5 * solved, "cell_accuracy": acc, "correct": float(solved)}

    def slip(self, ex):
        """Digits 1 and 2 swapped in the solution: still a valid grid, but it contradicts the givens."""
        return ex.meta["solution"].translate(str.maketrans("12", "21"))


# ---------------------------------------------------------------------------------------------- countdown
_MAX_EXPR_CHARS = 1024  # longer expressions are not read at all
_MAX_LITERAL_DIGITS = 15  # every integer of at most 15 digits is exact as a float; longer ones are malformed
_MAX_NESTING = 32  # parentheses and unary minus, together
_EXPR_TOKEN = re.compile(r"[0-9]+|[-+*/()]")


class _Malformed(Exception):
    pass


def safe_eval(expr: str) -> tuple[float, list[int]] | None:
    """Value and integer literals of an arithmetic expression (+ − * / parentheses, unary minus, spaces between
    tokens), or None if malformed: another character (``**`` included), a zero divisor, a literal with a leading
    zero or more than 15 digits, nesting deeper than 32, or more than 1024 characters. A recursive-descent parser
    with Python's precedence and left associativity, in float arithmetic as Python evaluates it (a product too large
    for a float is inf, not an error); its work is linear in the length, which is bounded."""
    if not isinstance(expr, str) or not expr or len(expr) > _MAX_EXPR_CHARS \
            or not re.fullmatch(r"[0-9+\-*/() ]+", expr):
        return None
    toks = _EXPR_TOKEN.findall(expr)  # spaces dropped: "1 2" leaves two numbers in a row, which does not parse
    nums: list[int] = []
    pos = 0

    def peek() -> str:
        return toks[pos] if pos < len(toks) else ""

    def factor(depth: int) -> float:
        nonlocal pos
        if depth > _MAX_NESTING:
            raise _Malformed
        t = peek()
        pos += 1
        if t == "-":
            return -factor(depth + 1)
        if t == "(":
            v = expr_(depth + 1)
            if peek() != ")":
                raise _Malformed
            pos += 1
            return v
        if t.isdigit():  # the token pattern admits ASCII digits only
            if len(t) > _MAX_LITERAL_DIGITS or (t[0] == "0" and t.strip("0")):
                raise _Malformed
            nums.append(int(t))
            return float(int(t))
        raise _Malformed

    def term(depth: int) -> float:
        nonlocal pos
        v = factor(depth)
        while peek() in ("*", "/"):
            op = peek()
            pos += 1
            w = factor(depth)
            if op == "*":
                v = v * w
            elif w == 0:
                raise _Malformed
            else:
                v = v / w
        return v

    def expr_(depth: int) -> float:
        nonlocal pos
        v = term(depth)
        while peek() in ("+", "-"):
            op = peek()
            pos += 1
            w = term(depth)
            v = v + w if op == "+" else v - w
        return v

    try:
        value = expr_(0)
    except _Malformed:
        return None
    return (value, nums) if pos == len(toks) else None


class Countdown(Task):
    """Three numbers and a target; use each number exactly once with + − * / to reach the target."""

    name, prompt_length, gen_length = "countdown", 12, 12

    def __init__(self, max_number: int = 12):
        self.max_number = max_number
        self._cache: dict[str, list[Example]] = {}

    def instances(self, split):
        if split not in self._cache:
            out = []
            rng = random.Random(self.split_seed + 1)
            for nums in itertools.combinations_with_replacement(range(1, self.max_number + 1), 3):
                a, b, c = rng.sample(nums, 3)
                o1, o2 = rng.choice("+-*"), rng.choice("+-*")
                expr = f"{a}{o1}{b}{o2}{c}"
                val = safe_eval(expr)[0]
                if val <= 0 or val != int(val) or val > 99:
                    expr = f"{a}+{b}+{c}"
                    val = a + b + c
                shown = sorted(nums)
                p = f"{shown[0]},{shown[1]},{shown[2]}:{int(val)}"
                if _is_test(p, self.test_fraction, self.split_seed) == (split == "test"):
                    out.append(Example(p, f"<answer>{expr}</answer>", {"numbers": shown, "target": int(val)}))
            self._cache[split] = out
        return self._cache[split]

    def example(self, prompt, answer):
        m = re.fullmatch(r"([0-9]+(?:,[0-9]+)*):([0-9]+)", prompt)
        if m is None:
            raise ValueError(f"prompt {prompt!r} is not n1,n2,...:target")
        return Example(prompt, answer, {"numbers": sorted(int(v) for v in m.group(1).split(",")),
                                        "target": int(m.group(2))})

    refused: ClassVar[dict[str, float]] = {"reward": 0.0, "format": 0.0, "correct": 0.0}

    def score(self, completion, ex):
        ans = extract_answer(completion)
        parsed = safe_eval(ans) if ans is not None else None
        if parsed is None:
            return {"reward": 0.0, "format": 0.0, "correct": 0.0}
        val, nums = parsed
        correct = sorted(nums) == sorted(ex.meta["numbers"]) and abs(val - ex.meta["target"]) < 1e-6
        return {"reward": 1.0 if correct else 0.1, "format": 1.0, "correct": float(correct)}

    def slip(self, ex):
        """The first operator replaced (+ → −, − → *, * → +; once more if the value happens to stay right)."""
        expr = extract_answer(ex.answer)
        i = next(j for j, ch in enumerate(expr) if j > 0 and ch in "+-*")
        for op in ({"+": "-", "-": "*", "*": "+"}[expr[i]], {"+": "*", "-": "+", "*": "-"}[expr[i]]):
            wrong = expr[:i] + op + expr[i + 1:]
            if safe_eval(wrong)[0] != ex.meta["target"]:
                return f"<answer>{wrong}</answer>"
        return None


# ---------------------------------------------------------------------------------------------- JSON schema
_TYPES = {"int": "integer", "str": "string", "bool": "boolean"}


def schema_from_spec(spec: str) -> dict[str, Any]:
    """'a:int,b:str' → a JSON schema: object, those typed properties, all required, nothing else allowed."""
    props = {}
    for part in spec.split(","):
        key, _, tp = part.partition(":")
        props[key] = {"type": _TYPES[tp]}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


_MAX_JSON_DEPTH = 64


def _json_depth(text: str) -> int:
    """Deepest nesting of [ and { outside JSON strings (a linear scan; unbalanced text is json.loads' to refuse)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


class JsonSchema(Task):
    name, prompt_length, gen_length = "json_schema", 20, 32

    def __init__(self, keys: str = "abcdef", max_keys: int = 3):
        self.keys, self.max_keys = keys, max_keys
        self._cache: dict[str, list[Example]] = {}

    def instances(self, split):
        if split not in self._cache:
            rng = random.Random(self.split_seed + 2)
            out = []
            for n in range(1, self.max_keys + 1):
                for keys in itertools.combinations(self.keys, n):
                    for tps in itertools.product(_TYPES, repeat=n):
                        spec = ",".join(f"{k}:{t}" for k, t in zip(keys, tps))
                        vals = {k: {"int": rng.randint(0, 9), "str": rng.choice("xyz"), "bool": rng.random() < .5}[t]
                                for k, t in zip(keys, tps)}
                        if _is_test(spec, self.test_fraction, self.split_seed) == (split == "test"):
                            out.append(Example(spec, json.dumps(vals, separators=(",", ":")),
                                               {"schema": schema_from_spec(spec)}))
            self._cache[split] = out
        return self._cache[split]

    def example(self, prompt, answer):
        if re.fullmatch(r"[a-z]+:(int|str|bool)(,[a-z]+:(int|str|bool))*", prompt) is None:
            raise ValueError(f"prompt {prompt!r} is not key:type,... with types int, str, bool")
        return Example(prompt, answer, {"schema": schema_from_spec(prompt)})

    refused: ClassVar[dict[str, float]] = {"reward": 0.0, "errors": -1.0, "correct": 0.0}

    def score(self, completion, ex):
        import jsonschema

        if _json_depth(completion) > _MAX_JSON_DEPTH:  # decided here, not by how deep the caller's stack is
            return dict(self.refused)
        try:
            obj = json.loads(completion.strip())
        except (ValueError, RecursionError):  # not JSON (JSONDecodeError is a ValueError)
            return dict(self.refused)
        n_err = sum(1 for _ in jsonschema.Draft7Validator(ex.meta["schema"]).iter_errors(obj))
        return {"reward": 1.0 / (1 + n_err), "errors": float(n_err), "correct": float(n_err == 0)}

    def slip(self, ex):
        """The first value written with the wrong type (an integer quoted, a boolean as 0/1, a string as 0)."""
        vals = json.loads(ex.answer)
        k = next(iter(vals))
        v = vals[k]
        vals[k] = int(v) if isinstance(v, bool) else (0 if isinstance(v, str) else str(v))
        return json.dumps(vals, separators=(",", ":"))
