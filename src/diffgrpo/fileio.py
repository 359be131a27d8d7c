"""Writing run files so that a crash, a full disk or a symlink planted in a run directory cannot corrupt them or
redirect them elsewhere.

  atomic_write(path, data)  bytes / text / a writer ``f(tmp_path)`` into a fresh temporary file in the same
                            directory (``mkstemp``: a new name, created exclusively, never an existing file or
                            link), flushed to disk, then renamed over ``path``. ``os.replace`` replaces a symlink
                            at ``path`` itself instead of writing through it. A full disk or a file-size limit
                            is a one-line TrainingError; the previous file stays as it was.
  append_line(path, text)   appends to a log opened with ``O_NOFOLLOW`` (a symlink at ``path`` is refused), in one
                            ``write`` call.
  file_mode() / dir_mode()  the permissions a new file / folder gets under the process umask (``mkstemp`` and
                            ``mkdtemp`` create 0600 / 0700 whatever the umask; outputs are set to these, so a
                            team's umask 002 or 022 lets teammates read a run).
  read_jsonl(path)          the rows of a JSON-lines log; a torn last line (a write cut short by a full disk or a
                            kill) is dropped with a warning, a damaged line elsewhere is an error naming the line.
  claim_folder(out, marker, option, what)
                            an output folder of a command other than a run (``bench quality``, ``bench engines``)
                            must be new, empty, or hold that command's ``marker`` file; any other folder is refused
                            in one line naming ``option``, so the command never overwrites files it did not write.
  run_root(directory)       inside the block ``directory`` is guarded: every write, append and delete below it
                            (``atomic_write``, ``append_line``, ``check_below`` called by the checkpoint and export
                            writers) refuses a path one of whose folders below ``directory`` is a symbolic link, so
                            a planted ``samples/`` or ``checkpoints/`` link never receives files or has its
                            contents pruned. The directory itself may be a link (the user's choice of disk).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import ConfigError, TrainingError


def current_umask() -> int:
    """The process umask, read without changing it where the OS tells it (Linux ``/proc``), else by setting it
    and restoring it at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode of a new file under the umask (0644 under umask 022, 0664 under 002)."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """Mode of a new folder under the umask (0755 under umask 022, 0775 under 002)."""
    return 0o777 & ~current_umask()


def temp_dir(prefix: str, parent: str | Path) -> Path:
    """A fresh hidden folder in ``parent`` (``mkdtemp``: created exclusively) with the umask's mode, to fill and
    rename into place."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, dir_mode())
    return tmp


def share_tree(root: str | Path) -> None:
    """Give every file and folder below ``root`` (and ``root``) the umask's modes: libraries that write through a
    private temporary file (safetensors: 0600) would otherwise leave outputs a teammate cannot read. Symbolic
    links are neither followed nor changed."""
    root = Path(root)
    fmode, dmode = file_mode(), dir_mode()
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        os.chmod(dirpath, dmode)  # os.walk does not descend into links (followlinks=False)
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, fmode)
            finally:
                os.close(fd)


_ROOTS: list[Path] = []  # the guarded run directories (absolute, not resolved), see run_root


@contextlib.contextmanager
def run_root(directory: str | Path):
    """Guard ``directory`` for the block's duration (see the module docstring)."""
    root = Path(os.path.abspath(directory))
    _ROOTS.append(root)
    try:
        yield root
    finally:
        _ROOTS.remove(root)


def check_below(path: str | Path) -> None:
    """TrainingError when a folder between a guarded run directory and ``path`` (``path``'s parents below the
    root, not ``path`` itself: a link there is replaced, never written through) is a symbolic link."""
    p = Path(os.path.abspath(path))
    for root in _ROOTS:
        try:
            parts = p.relative_to(root).parts[:-1]
        except ValueError:
            continue
        cur = root
        for part in parts:
            cur = cur / part
            if cur.is_symlink():
                raise TrainingError(f"{cur} is a symbolic link inside the run directory {root}; refusing to write "
                                    "or delete through it (remove the link)")


def atomic_write(path: str | Path, data: bytes | str | Callable[[Path], None]) -> Path:
    """Write ``data`` (bytes, text, or ``writer(tmp_path)``) to ``path`` through a temporary file + rename."""
    path = Path(path)
    check_below(path)
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
        fd2 = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:  # flush the contents before the rename makes them visible; the umask's mode, not mkstemp's 0600
            os.fchmod(fd2, file_mode())
            os.fsync(fd2)
        finally:
            os.close(fd2)
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
    check_below(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # the umask applies
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
    lines = p.read_text(errors="replace").split("\n")  # only newlines end a row (not U+2028 inside a string)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except (ValueError, RecursionError):  # also a nesting too deep to parse, a 5000-digit integer
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


__all__ = ["append_line", "atomic_write", "check_below", "current_umask", "dir_mode", "file_mode", "read_jsonl",
           "read_utf8", "run_root", "share_tree", "temp_dir"]


def claim_folder(out: str | Path, marker: str, option: str, what: str, outputs: tuple[str, ...] = ()) -> None:
    """Refuse ``out`` unless it is new, empty, or an earlier output of the same command: it holds ``marker``, or
    (from versions before the marker) nothing but names in ``outputs``. Then write the marker (guarded: never through
    a link below ``out``). ``what`` names the command in the error."""
    out = Path(out)
    if (out.exists() or out.is_symlink()) and not out.is_dir():  # a file, or a link to nothing
        raise ConfigError(f"{option}: {str(out)!r} exists and is not a directory; choose a new or empty directory")
    mark = out / marker
    ours = mark.is_file() and not mark.is_symlink()
    if out.is_dir() and not ours and any(p.name not in outputs for p in out.iterdir()):
        raise ConfigError(f"{option}: {str(out)!r} is not empty and is not a {what} output (no {marker}); choose a "
                          "new or empty directory, so that no file of yours is overwritten")
    with run_root(out):
        atomic_write(mark, json.dumps({"tool": "diffgrpo", "kind": what}) + "\n")
