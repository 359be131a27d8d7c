"""The task registry: ``TASKS`` (tasks with an instance generator), ``FILE_TASKS`` (tasks whose instances come from
``dllm.data_file`` only), ``get_task`` by name, and ``examples_from_file`` reading a task's instances from a source."""
from __future__ import annotations

from ..data_sources import HF_PREFIX, load_prompts
from ..errors import ConfigError
from .base import Example, Task
from .code import CodeTask, CodeToy, read_records
from .competition_math import MathTask
from .generated import Arithmetic, Countdown, JsonSchema, Sudoku
from .numeric import Numeric

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
    (:func:`diffgrpo.tasks.code.read_records`; no reference solution runs here)."""
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
