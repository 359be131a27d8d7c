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
  :mod:`diffgrpo.tasks.code` and :mod:`diffgrpo.tasks.competition_math`

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

The package: ``vocab`` (the character vocabulary), ``base`` (``Example``, ``Task``), ``generated`` (the tasks with
instance generators), ``numeric`` (numeric answers and ``gsm8k``), ``registry`` (``TASKS`` / ``FILE_TASKS``,
``get_task``, ``examples_from_file``).
"""
from __future__ import annotations

from .base import Example, Task, extract_answer
from .generated import (
    Arithmetic,
    Countdown,
    JsonSchema,
    Sudoku,
    all_sudoku_grids,
    count_solutions,
    safe_eval,
    schema_from_spec,
)
from .numeric import (
    NUMERIC_MAX_CHARS,
    Numeric,
    extract_boxed,
    last_answer_tag,
    last_number,
    numeric_correct,
    parse_number,
    predicted_number,
    reference_number,
)
from .registry import FILE_TASKS, TASKS, examples_from_file, get_task
from .vocab import VOCAB, CharVocab, pad_right

__all__ = [
    "FILE_TASKS",
    "NUMERIC_MAX_CHARS",
    "TASKS",
    "VOCAB",
    "Arithmetic",
    "CharVocab",
    "Countdown",
    "Example",
    "JsonSchema",
    "Numeric",
    "Sudoku",
    "Task",
    "all_sudoku_grids",
    "count_solutions",
    "examples_from_file",
    "extract_answer",
    "extract_boxed",
    "get_task",
    "last_answer_tag",
    "last_number",
    "numeric_correct",
    "pad_right",
    "parse_number",
    "predicted_number",
    "reference_number",
    "safe_eval",
    "schema_from_spec",
]
