"""Text tasks with verifiable rewards for masked diffusion language models, and their shared vocabulary.

Every task has a seeded instance generator with a fixed train/test split, a reference completion (used to
pretrain the built-in model) and a reward computed from the completion text alone:

  arithmetic   "12+7="            → "<answer>19</answer>"     reward 0.1·format + 0.9·correct
  sudoku       4×4, "." = blank    → 16 digits (row-major)     reward 0.5·cell_accuracy + 0.5·solved
  countdown    "3,5,2:13"          → "<answer>3*5-2</answer>"  reward 1.0 correct / 0.1 well-formed / 0
  json_schema  "a:int,b:str"       → '{"a":3,"b":"x"}'         reward 1/(1+#jsonschema errors), 0 if not JSON
  gsm8k        a word problem      → "... \\boxed{72}"          reward 1 if the numeric answer is exact, else 0
                                                               (instances from dllm.data_file: no generator)
  code_toy, code (the completion's code runs in a sandbox) and math (math-verify equivalence): see
  :mod:`diffgrpo.dllm.code_tasks` and :mod:`diffgrpo.dllm.math_tasks`

Verifiers score any string and never raise: a completion longer than ``Task.max_chars`` (64 characters per
token of the task's ``gen_length``, far beyond any decoded completion) scores 0 without being parsed; digits are
ASCII only (no Unicode digit passes for an answer); countdown expressions are read by a bounded parser (no
``eval``, no ``**``, literals of at most 15 digits, nesting at most 32 deep); a JSON document nested deeper than 64
scores as not JSON. Every component but json_schema's ``errors`` (a count, −1 when not JSON) lies in [0, 1].

Splits: arithmetic, countdown and json_schema split by a seeded hash of the instance; sudoku splits by the
*solution grid* (no test solution is ever seen in training, whatever its blanks).

The vocabulary is character level plus the special tokens <pad>, <mask>, <eos> and the two tag tokens
<answer>, </answer> (kept whole so that completions stay short). Completions are padded with <eos> to
``gen_length`` (LLaDA convention); prompts are left-padded with <pad> to the task's ``prompt_length``.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

import torch

from ..data_sources import HF_PREFIX, load_prompts
from ..errors import ConfigError
from .code_tasks import CodeTask, CodeToy, read_records
from .math_tasks import MathTask

# ---------------------------------------------------------------------------------------------- vocabulary
SPECIALS = ["<pad>", "<mask>", "<eos>", "<answer>", "</answer>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz+-*/=()[]{}<>:,.\"' _|?")


class CharVocab:
    """Character vocabulary shared by every task. ``encode`` matches special tokens greedily first."""

    def __init__(self):
        self.tokens = SPECIALS + CHARS
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.mask_id, self.eos_id = self.index["<pad>"], self.index["<mask>"], self.index["<eos>"]
        self._special_re = re.compile("|".join(re.escape(s) for s in SPECIALS))

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        """Text → ids; specials first, then characters; unknown characters raise ValueError."""
        out, pos = [], 0
        for m in self._special_re.finditer(text):
            out += [self._char(c) for c in text[pos:m.start()]]
            out.append(self.index[m.group(0)])
            pos = m.end()
        return out + [self._char(c) for c in text[pos:]]

    def _char(self, c: str) -> int:
        if c not in self.index:
            raise ValueError(f"character {c!r} is not in the vocabulary")
        return self.index[c]

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        """Ids → text; stops at the first <eos> (else drops it); <pad> is dropped; <mask> stays "<mask>"."""
        out = []
        for i in (ids.tolist() if torch.is_tensor(ids) else ids):
            if i == self.eos_id and stop_at_eos:
                break
            if i == self.pad_id or i == self.eos_id:
                continue
            out.append(self.tokens[i])
        return "".join(out)

    def encode_prompts(self, prompts: list[str], length: int) -> torch.Tensor:
        """Left-padded prompt ids (B, length) long."""
        out = torch.full((len(prompts), length), self.pad_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids = self.encode(p)
            if len(ids) > length:
                raise ValueError(f"prompt {p!r} has {len(ids)} tokens > prompt_length {length}")
            if ids:
                out[b, length - len(ids):] = torch.tensor(ids)
        return out

    def encode_completions(self, completions: list[str], length: int) -> torch.Tensor:
        """Completion ids (B, length) long, <eos>-padded (truncated if longer)."""
        return pad_right([self.encode(c) for c in completions], length, self.eos_id)


def pad_right(seqs: list[list[int]], length: int, fill: int) -> torch.Tensor:
    """Token lists → (B, length) long, each truncated to ``length`` and padded with ``fill`` on the right."""
    out = torch.full((len(seqs), length), fill, dtype=torch.long)
    for b, ids in enumerate(seqs):
        ids = ids[:length]
        if ids:
            out[b, : len(ids)] = torch.tensor(ids)
    return out


VOCAB = CharVocab()


# ---------------------------------------------------------------------------------------------- helpers
@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str  # one reference completion (pretraining target)
    meta: dict = field(default_factory=dict, hash=False, compare=False)


def _is_test(key: str, test_fraction: float, seed: int) -> bool:
    h = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:8], 16)
    return (h / 0xFFFFFFFF) < test_fraction


_ANSWER_RE = re.compile(r"^<answer>(.*?)</answer>$", re.S)


def extract_answer(text: str) -> str | None:
    """The content of exactly one <answer>…</answer> pair spanning the whole completion (trimmed), else None."""
    m = _ANSWER_RE.match(text.strip())
    if m is None or "<answer>" in m.group(1) or "</answer>" in m.group(1):
        return None
    return m.group(1).strip()


class Task:
    """Base: ``instances(split)`` lists every instance of a split; ``sample`` draws seeded examples."""

    name = ""
    prompt_length = 0
    gen_length = 0
    test_fraction = 0.2
    split_seed = 0

    def instances(self, split: str) -> list[Example]:
        raise NotImplementedError

    def sample(self, split: str, n: int, generator: torch.Generator) -> list[Example]:
        pool = self.instances(split)
        idx = torch.randint(len(pool), (n,), generator=generator)
        return [pool[int(i)] for i in idx]

    def example(self, prompt: str, answer: str) -> Example:
        """An instance from a prompt and its reference answer (a data file's record): the verifier's fields are
        read from them. Raises ValueError when they are not an instance of this task."""
        raise NotImplementedError

    refused: ClassVar[dict[str, float]] = {}  # the components of a completion that cannot be read (all zero)

    @property
    def max_chars(self) -> int:
        """Longest completion that is parsed at all: 64 characters per token of ``gen_length`` (the built-in
        vocabulary's longest token has 9), so that an adversarial string costs O(1) to refuse."""
        return 64 * self.gen_length

    def reward(self, completion: str, ex: Example) -> dict[str, float]:
        """→ {"reward": float, <components>: float, "correct": 0/1}. Any string is scored and nothing raises:
        a non-string or a completion longer than ``max_chars`` gets ``refused`` (reward 0)."""
        if not isinstance(completion, str) or len(completion) > self.max_chars:
            return dict(self.refused)
        return self.score(completion, ex)

    def score(self, completion: str, ex: Example) -> dict[str, float]:
        """The verifier proper, given a string of at most ``max_chars`` characters."""
        raise NotImplementedError

    def slip(self, ex: Example) -> str | None:
        """A wrong answer in the right format made by the task's systematic slip (same rule for every prompt),
        or None when the task has none. Used by ``pretrain.answer_noise`` to give the built-in base a habit
        that a verifiable reward can train away."""
        return None

    def rewards(self, completions: list[str], examples: list[Example]) -> dict[str, torch.Tensor]:
        rows = [self.reward(c, e) for c, e in zip(completions, examples)]
        return {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in rows[0]}


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
_GSM8K_TAIL = re.compile(r"####\s*(.+?)\s*$", re.S)


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


TASKS: dict[str, type[Task]] = {"arithmetic": Arithmetic, "sudoku": Sudoku, "countdown": Countdown,
                                "json_schema": JsonSchema,  # tasks with their own instance generator
                                "code_toy": CodeToy}
FILE_TASKS: dict[str, type[Task]] = {"gsm8k": Numeric,  # tasks whose instances come from dllm.data_file only
                                     "code": CodeTask, "math": MathTask}


def examples_from_file(path: str, task: Task, *, key: str = "dllm.data_file", prompt_field: str = "prompt",
                       answer_field: str = "answer") -> list[Example]:
    """The instances of a prompt/answer source for ``task``: a JSONL file of ``{prompt_field: str, answer_field:
    str}`` records (other fields ignored) or an ``hf:`` datasets spec (``hf:gsm8k:train`` with
    ``prompt_field=question``, ``hf:json:<file>``; see :mod:`diffgrpo.data_sources`). Each reference answer must
    pass the task's verifier. One-line ConfigErrors naming ``key``. Code tasks read their own record layouts
    (:func:`diffgrpo.dllm.code_tasks.read_records`; no reference solution runs here)."""
    if isinstance(task, CodeTask):
        return task.examples_from_records(read_records(path, key=key, prompt_field=prompt_field), key=key, path=path)
    if not path.startswith(HF_PREFIX) and not path.lower().endswith(".jsonl"):
        raise ConfigError(f"{key}: file {path!r} is not a .jsonl file (one JSON object per line with prompt and "
                          "answer fields) or an hf:<dataset>[:<split>] spec")
    out = []
    for i, rec in enumerate(load_prompts(path, key=key, column=prompt_field), 1):
        answer = rec.get(answer_field)
        if not isinstance(answer, str) or not answer.strip():
            raise ConfigError(f"{key}: file {path!r} record {i} has no non-empty string field {answer_field!r}")
        try:
            ex = task.example(rec["prompt"], answer.strip())
        except ValueError as e:
            raise ConfigError(f"{key}: file {path!r} record {i} is not a dllm.task={task.name} instance "
                              f"({e})") from None
        if task.reward(ex.answer, ex).get("correct") != 1.0:
            raise ConfigError(f"{key}: file {path!r} record {i}: the answer {ex.answer!r} does not pass the "
                              f"dllm.task={task.name} verifier for the prompt {ex.prompt!r}")
        out.append(ex)
    return out


def get_task(name: str) -> Task:
    if name in FILE_TASKS:
        return FILE_TASKS[name]()
    if name not in TASKS:
        raise ValueError(f"unknown dLLM task {name!r}; choose one of {sorted(TASKS) + sorted(FILE_TASKS)}")
    return TASKS[name]()


__all__ = ["VOCAB", "CharVocab", "Example", "Task", "TASKS", "FILE_TASKS", "Numeric", "get_task", "extract_boxed",
           "last_answer_tag", "last_number", "parse_number", "predicted_number", "reference_number",
           "numeric_correct", "examples_from_file", "extract_answer", "safe_eval",
           "schema_from_spec", "all_sudoku_grids", "count_solutions"]
