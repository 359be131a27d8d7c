"""On-disk cache of built-in artefacts (pretrained tiny models, the reward classifier): where it lives, an
exclusive lock while an entry is checked or built, and atomic directory writes so no entry is half-written."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .fileio import check_below, share_tree, temp_dir


def cache_root(cache_dir: str = "") -> Path:
    """Cache directory: explicit argument, else $DIFFGRPO_CACHE, else ~/.cache/diffgrpo."""
    root = cache_dir or os.environ.get("DIFFGRPO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "diffgrpo")
    return Path(root)


@contextlib.contextmanager
def cache_lock(path: Path):
    """Exclusive advisory lock on ``<path>.lock`` (POSIX flock) while a cache entry is checked or built."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def save_dir_atomic(target: Path, write) -> Path:
    """Call ``write(tmp_dir)`` then atomically move the directory into place (no half-written cache). Below a
    guarded run directory (``fileio.run_root``) no folder on the way may be a symbolic link."""
    check_below(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(f".{target.name}.", target.parent)
    try:
        write(tmp)
        share_tree(tmp)  # the umask's modes, whatever the writers chose
        if target.is_symlink():  # replace a link, never write through it
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


__all__ = ["cache_root", "cache_lock", "save_dir_atomic"]
