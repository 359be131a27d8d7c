"""Text tasks with verifiable rewards for masked diffusion language models, and their shared vocabulary.

Every task has a seeded instance generator with a fixed train/test split, a reference completion (used to
pretrain the built-in model) and a reward computed from the completion text alone:

  arithmetic   "12+7="            → "<answer>19</answer>"     reward 0.1·format + 0.9·correct
  sudoku       4×4, "." = blank    → 16 digits (row-major)     reward 0.5·cell_accuracy + 0.5·solved
  countdown    "3,5,2:13"          → "<answer>3*5-2</answer>"  reward 1.0 correct / 0.1 well-formed / 0
  json_schema  "a:int,b:str"       → '{"a":3,"b":"x"}'         reward 1/(1+#jsonschema errors), 0 if not JSON
  gsm8k        a word problem      → "... \\boxed{72}"          reward 1 if the numeric answer is exact, else 0
                                                               (instances from dllm.data_file: no generator)

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
instance generators), ``numeric`` (numeric answers and ``gsm8k``); ``TASKS`` / ``FILE_TASKS`` register them here.
"""
from __future__ import annotations

from ..data_sources import HF_PREFIX, load_prompts
from ..errors import ConfigError
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
from .vocab import VOCAB, CharVocab, pad_right

TASKS: dict[str, type[Task]] = {"arithmetic": Arithmetic, "sudoku": Sudoku, "countdown": Countdown,
                                "json_schema": JsonSchema}  # tasks with their own instance generator
FILE_TASKS: dict[str, type[Task]] = {"gsm8k": Numeric}  # tasks whose instances come from dllm.data_file only


def examples_from_file(path: str, task: Task, *, key: str = "dllm.data_file", prompt_field: str = "prompt",
                       answer_field: str = "answer") -> list[Example]:
    """The instances of a prompt/answer source for ``task``: a JSONL file of ``{prompt_field: str, answer_field:
    str}`` records (other fields ignored) or an ``hf:`` datasets spec (``hf:gsm8k:train`` with
    ``prompt_field=question``, ``hf:json:<file>``; see :mod:`diffgrpo.data_sources`). Each reference answer must
    pass the task's verifier. One-line ConfigErrors naming ``key``."""
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
