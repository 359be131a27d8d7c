"""Prompt data with metadata, and the epoch sampler that draws it.

A prompt source (``train.prompts_file``, ``eval.prompts_file``) is one of:

- a text file: one prompt per line (blank lines skipped), no metadata;
- a ``.jsonl`` file: one JSON object per line with a prompt field (``train.prompt_column``, default ``prompt``);
  every other field is that prompt's metadata;
- a ``.csv`` file: a header row naming a prompt column plus metadata columns (values stay strings);
- ``builtin:<set>/<split>``: a prompt set shipped inside the package (``src/diffgrpo/prompts``, e.g.
  ``builtin:ocr/train``; :func:`builtin_sets` lists them);
- ``hf:<path or hub id>[:<split>]``: a ``datasets.load_dataset`` spec (needs the ``datasets`` package; split
  ``train`` by default). ``hf:json:<file>`` / ``hf:csv:<file>`` / ``hf:parquet:<file>`` load local files with that
  builder (``load_dataset("json", data_files=<file>)``).

Each becomes a list of records ``{"prompt": str, **metadata}``. Files must be UTF-8 (a byte-order mark is dropped),
regular files (not a pipe or a device) of at most ``MAX_PROMPT_FILE_BYTES`` (1 GiB, checked before reading). A CSV
header names each column once, and every row fills every column.
Every problem is a one-line :class:`~diffgrpo.errors.ConfigError` naming the config key.

A record's ``image`` / ``images`` fields name the source images of an editing prompt (``sources``: resolved
against the file's folder and checked here, before any model loads).

Metadata reaches the rewards per sample (``Rollout.metadata``). Under data parallelism each rank scores its own
samples, so a sample's metadata travels with it and nothing is gathered for the rewards.
"""
from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
from pathlib import Path

import numpy as np

from . import sources
from .errors import ConfigError
from .fileio import read_utf8

HF_PREFIX = "hf:"
BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).resolve().parent / "prompts"
_HF_BUILDERS = ("json", "csv", "parquet", "text")
MAX_PROMPT_FILE_BYTES = 1 << 30  # 1 GiB: a local prompt file is read whole (an hf: dataset has no cap)
_SPLIT_RE = re.compile(r"^[A-Za-z_][\w-]*$")


def _column_key(key: str) -> str:
    """The key that names the prompt field of the file read for ``key``."""
    return "dllm.prompt_field" if key.startswith("dllm.") else "train.prompt_column"


def _record(row: dict, column: str, where: str, spec: str, key: str) -> dict:
    if column not in row:
        raise ConfigError(f"{key}: file {spec!r} {where} has no field {column!r} (fields: "
                          f"{', '.join(map(str, row)) or 'none'}); name the prompt field with {_column_key(key)}")
    prompt = row[column]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{key}: file {spec!r} {where}: the prompt {prompt!r} is not a non-empty string")
    meta = {k: v for k, v in row.items() if k != column}
    meta.pop("prompt", None)  # a record's prompt is its prompt column
    return {"prompt": prompt.strip(), **meta}


def _parse_jsonl(text: str, column: str, spec: str, key: str) -> list[dict]:
    out = []
    for n, line in enumerate(text.split("\n"), 1):  # JSON lines end at newlines only (U+2028 may sit in a string)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}: file {spec!r} line {n} is not JSON ({e.msg})") from None
        except (RecursionError, ValueError) as e:  # nesting too deep to parse, an integer beyond Python's limit
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
            raise ConfigError(f"{key}: file {spec!r} line {n} cannot be read ({why})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{key}: file {spec!r} line {n} is a JSON {type(row).__name__}, not an object")
        out.append(_record(row, column, f"line {n}", spec, key))
    return out


def _parse_csv(text: str, column: str, spec: str, key: str) -> list[dict]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        fields = reader.fieldnames or []
        dup = sorted({f for f in fields if fields.count(f) > 1})
        if dup:  # a DictReader keeps the last of two same-named columns: refused, not guessed
            raise ConfigError(f"{key}: file {spec!r} names the column(s) {dup} more than once in its header; give "
                              "each column its own name")
        if column not in fields:
            raise ConfigError(f"{key}: file {spec!r} has no column {column!r} (columns: "
                              f"{', '.join(fields) or 'none'}); name the prompt column with {_column_key(key)}")
        out = []
        for row in reader:
            if None in row:
                raise ConfigError(f"{key}: file {spec!r} line {reader.line_num} has more values than the header "
                                  f"has columns")
            if not any((v or "").strip() for v in row.values()):
                continue
            if any(v is None for v in row.values()):  # a short row: its last columns would be None
                raise ConfigError(f"{key}: file {spec!r} line {reader.line_num} has fewer values than the header "
                                  f"has columns ({len(fields)})")
            out.append(_record(row, column, f"line {reader.line_num}", spec, key))
        return out
    except csv.Error as e:
        raise ConfigError(f"{key}: file {spec!r} is not valid CSV (line {reader.line_num}: {e})") from None


def split_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf:<path>[:<split>]`` → (path or builder, data_files or None, split)."""
    parts = spec[len(HF_PREFIX):].split(":")
    split = "train"
    if len(parts) > 1 and _SPLIT_RE.match(parts[-1]) and not (len(parts) == 2 and parts[0] in _HF_BUILDERS):
        split = parts.pop()
    if parts[0] in _HF_BUILDERS and len(parts) > 1:
        return parts[0], ":".join(parts[1:]), split
    return ":".join(parts), None, split


def _load_hf(spec: str, column: str, key: str) -> list[dict]:
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"{key}: {spec!r} needs the datasets package (pip install datasets)")
    import datasets  # optional dependency: imported only for an hf: spec

    path, data_files, split = split_hf_spec(spec)
    if data_files is not None and not Path(data_files).expanduser().is_file():
        raise ConfigError(f"{key}: file {data_files!r} does not exist")
    if path == "json" and data_files is not None:  # pyarrow's JSON reader crashes the process on deep nesting
        _check_nesting(Path(data_files).expanduser(), spec, key)
    try:
        ds = datasets.load_dataset(path, data_files=str(Path(data_files).expanduser()) if data_files else None,
                                   split=split)
    except Exception as e:  # noqa: BLE001 - any loading problem is a config problem of this key
        first = (str(e).splitlines() or [""])[0]
        raise ConfigError(f"{key}: {spec!r} cannot be loaded ({type(e).__name__}: {first})") from None
    for name in sources.FIELDS:  # image columns stay encoded (bytes) until a source is used
        if isinstance(getattr(ds, "features", {}).get(name), datasets.Image):
            ds = ds.cast_column(name, datasets.Image(decode=False))
    records = [_record(dict(row), column, f"row {i}", spec, key) for i, row in enumerate(ds)]
    base = Path(data_files).expanduser().parent if data_files else None  # paths in a local file's rows
    return sources.resolve(records, base=base, spec=spec, key=key, where="row")


MAX_JSON_DEPTH = 1000  # deeper nesting is refused before a JSON file reaches datasets (as json.loads refuses it)
_JSON_TOKENS = re.compile(rb'"(?:\\.|[^"\\])*"|[\[\]{}]')


def _check_nesting(path: Path, spec: str, key: str) -> None:
    """A local JSON / JSONL file for ``hf:json:`` whose brackets nest deeper than :data:`MAX_JSON_DEPTH` (outside
    strings) is a one-line ConfigError: pyarrow's reader segfaults on such a file instead of raising."""
    depth = 0
    with path.open("rb") as f:
        for chunk_line, line in enumerate(f, 1):
            for m in _JSON_TOKENS.finditer(line):
                c = m.group()
                if c in (b"[", b"{"):
                    depth += 1
                    if depth > MAX_JSON_DEPTH:
                        raise ConfigError(f"{key}: file {str(path)!r} line {chunk_line} cannot be read (nested more "
                                          f"than {MAX_JSON_DEPTH} deep) for {spec!r}")
                elif c in (b"]", b"}"):
                    depth = max(0, depth - 1)


def builtin_sets() -> list[str]:
    """The shipped prompt sets as ``<set>/<split>`` names (``builtin:<name>`` in a config)."""
    return sorted(f"{f.parent.name}/{f.stem}" for f in BUILTIN_DIR.glob("*/*")
                  if f.suffix in (".txt", ".jsonl") and f.stem in ("train", "test"))


def resolve_builtin(spec: str, key: str = "train.prompts_file") -> Path:
    """``builtin:<set>/<split>`` → the shipped file; an unknown name is a one-line ConfigError listing the sets."""
    name = spec[len(BUILTIN_PREFIX):].strip().strip("/")
    if not name:
        raise ConfigError(f"{key}: {spec!r} names no prompt set; write builtin:<set>/<split>, one of "
                          f"{[BUILTIN_PREFIX + n for n in builtin_sets()]}")
    for suffix in (".jsonl", ".txt"):
        f = BUILTIN_DIR / f"{name}{suffix}"
        if name in builtin_sets() and f.is_file():
            return f
    raise ConfigError(f"{key}: {spec!r} is not a shipped prompt set; choose one of "
                      f"{[BUILTIN_PREFIX + n for n in builtin_sets()]}")


# The validation purposes (``validation.PURPOSES``) whose command reads the prompt sources: only for these must a
# prompt file exist and parse before any model loads; the others (export, print) check only a shipped set's name.
READS_DATA = ("train", "sample")


def reads_data(purpose: str) -> bool:
    """Whether a config validated for ``purpose`` (``validation.PURPOSES``) has its prompt sources read."""
    return purpose in READS_DATA


def check_prompts(spec: str, *, key: str, column: str = "prompt", purpose: str = "train") -> None:
    """Validation of a prompt source: it loads (exists, is UTF-8, parses, has the prompt column and a prompt), or,
    for a purpose that reads no data (:func:`reads_data`), only a ``builtin:`` name is checked."""
    if not reads_data(purpose):
        if spec.startswith(BUILTIN_PREFIX):
            resolve_builtin(spec, key)
        return
    load_prompts(spec, key=key, column=column)


def listing_counts(prompts: list[str]) -> list[int]:
    """For each prompt, how many times it was listed before it (0 at its first listing): a set that repeats prompts
    to weigh its categories equally gives each repeat its own evaluation seeds."""
    seen: dict[str, int] = {}
    out = []
    for p in prompts:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


def load_prompts(spec: str, *, key: str = "train.prompts_file", column: str = "prompt") -> list[dict]:
    """The prompt records ``[{"prompt": str, **metadata}]`` of ``spec`` (see the module doc); ``key`` names the
    config key in errors. Raises ConfigError for a missing, unreadable, malformed or empty source. ``column`` names
    the prompt field of the user's sources: a shipped ``builtin:`` set's is always ``prompt``."""
    column = "prompt" if spec.startswith(BUILTIN_PREFIX) else column
    if spec.startswith(HF_PREFIX):
        records = _load_hf(spec, column, key)
    else:
        p = resolve_builtin(spec, key) if spec.startswith(BUILTIN_PREFIX) else Path(spec).expanduser()
        try:
            exists, is_file = p.exists(), p.is_file()
        except (OSError, ValueError):  # a name too long, an embedded NUL byte
            exists = is_file = False
        if not is_file:
            raise ConfigError(f"{key}: file {spec!r} " + ("is not a regular file (a folder, a pipe or a device); "
                                                          "name a text, .jsonl or .csv file" if exists
                                                          else "does not exist"))
        size = p.stat().st_size
        if size > MAX_PROMPT_FILE_BYTES:  # checked before reading: a huge file never fills the memory
            raise ConfigError(f"{key}: file {spec!r} has {size / 2 ** 30:.1f} GiB; a prompt file may hold at most "
                              f"{MAX_PROMPT_FILE_BYTES // 2 ** 20} MiB (data_sources.MAX_PROMPT_FILE_BYTES); use an "
                              "hf: dataset for more")
        text = read_utf8(p, key, spec)
        suffix = p.suffix.lower()
        if suffix == ".jsonl":
            records = _parse_jsonl(text, column, spec, key)
        elif suffix == ".csv":
            records = _parse_csv(text, column, spec, key)
        if suffix in (".jsonl", ".csv"):  # source images of editing prompts (image / images), checked here
            records = sources.resolve(records, base=p.parent, spec=spec, key=key)
        else:
            records = [{"prompt": line.strip()} for line in text.split("\n") if line.strip()]  # not at U+2028
    if not records:
        raise ConfigError(f"{key}: file {spec!r} holds no prompts")
    return records


def prompt_metadata(record: dict, digit) -> dict:
    """What the rewards receive for one sample of ``record``: its fields but the prompt, with ``digit`` (the digit
    the prompt names, or None) unless the record sets its own."""
    return {"digit": digit, **{k: v for k, v in record.items() if k != "prompt"}}


class EpochSampler:
    """Seeded epoch-based prompt order (FlowGRPO's K-repeat sampler without the repeats, which the caller adds):
    epoch ``e`` is a permutation of ``range(n)`` seeded by ``(seed, e)``, consumed in order; a draw that runs past
    the end continues into the next epoch, so every prompt comes once per epoch. Its position (epoch, index) is
    its whole state. Every rank holds the same sampler and draws the same whole batch."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed % 2 ** 32, epoch]).permutation(self.n)

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            m = min(k - len(out), self.n - self.index)
            out += self._order[self.index:self.index + m].tolist()
            self.index += m
            if self.index == self.n:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


__all__ = ["EpochSampler", "READS_DATA", "builtin_sets", "check_prompts", "listing_counts", "load_prompts", "prompt_metadata",
           "read_utf8", "reads_data", "resolve_builtin", "split_hf_spec"]
