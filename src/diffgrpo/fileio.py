"""Writing run files so that a crash, a full disk or a symlink planted in a run directory cannot corrupt them or
redirect them elsewhere.

  atomic_write(path, data)  bytes / text / a writer ``f(tmp_path)`` into a fresh temporary file in the same
                            directory (``mkstemp``: a new name, created exclusively, never an existing file or
                            link), flushed to disk, then renamed over ``path``. ``os.replace`` replaces a symlink
                            at ``path`` itself instead of writing through it. A full disk or a file-size limit
                            is a one-line TrainingError; the previous file stays as it was.
  append_line(path, text)   appends to a log opened with ``O_NOFOLLOW`` (a symlink at ``path`` is refused), in one
                            ``write`` call.
  read_jsonl(path)          the rows of a JSON-lines log; a torn last line (a write cut short by a full disk or a
                            kill) is dropped with a warning, a damaged line elsewhere is an error naming the line.
"""
from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from .errors import ConfigError, TrainingError


def atomic_write(path: str | Path, data: bytes | str | Callable[[Path], None]) -> Path:
    """Write ``data`` (bytes, text, or ``writer(tmp_path)``) to ``path`` through a temporary file + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        if callable(data):
            os.close(fd)
            fd = -1
            data(tmp)
        else:
            with os.fdopen(fd, "wb") as f:
                fd = -1
                f.write(data.encode() if isinstance(data, str) else data)
        with open(tmp, "rb") as f:  # flush the contents before the rename makes them visible
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):  # the previous file, if any, is untouched
            raise TrainingError(f"{path}: cannot write ({e.strerror}); free space and resume the run") from None
        raise
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp.exists():
            tmp.unlink()
    return path


def append_line(path: str | Path, text: str) -> None:
    """Append ``text`` + newline to ``path`` (created if missing), refusing to follow a symlink at ``path``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TrainingError(f"{path} is a symbolic link; refusing to write through it") from None
        raise
    data = (text + "\n").encode()
    try:
        written = os.write(fd, data)
    except OSError as e:  # a full disk or a file-size limit: one line, the run's checkpoints stay usable
        raise TrainingError(f"{path}: cannot append ({e.strerror}); free space and resume the run") from None
    finally:
        os.close(fd)
    if written != len(data):
        raise TrainingError(f"{path}: a write was cut short ({written} of {len(data)} bytes; disk full or a "
                            "file-size limit); free space and resume the run")


def read_jsonl(path: str | Path, log=print) -> list[dict]:
    """Rows of a JSON-lines file ([] if it does not exist); see the module docstring for damaged lines."""
    p = Path(path)
    if not p.exists():
        return []
    lines = p.read_text(errors="replace").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                log(f"warning: {p}: the last line is incomplete (a write cut short); it is ignored")
                continue
            raise TrainingError(f"{p}: line {i + 1} is not valid JSON (the file is damaged)") from None
    return rows


def read_utf8(p: Path, key: str, spec: str | None = None) -> str:
    """The UTF-8 text of ``p`` (a byte-order mark is dropped); an unreadable or non-UTF-8 file is a one-line
    ConfigError naming ``key`` and the file as the user gave it (``spec``, default the path)."""
    spec = str(p) if spec is None else spec
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{key}: file {spec!r} cannot be read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: file {spec!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start}); save it as UTF-8") from None


__all__ = ["atomic_write", "append_line", "read_jsonl", "read_utf8"]
