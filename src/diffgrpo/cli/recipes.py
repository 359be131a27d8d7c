"""The configs shipped inside the package (``diffgrpo/configs/*.yaml``): list them, copy one out, name one.

``diffgrpo configs list`` prints each name with the first sentence of its header (cut at a word, with an ellipsis); ``diffgrpo configs cp NAME [DEST]``
copies it (never over an existing file); ``--config NAME`` on any command reads the shipped file when no file of
that name exists in the current directory. They are read through ``importlib.resources``, so they work the same
from a checkout, an editable install and a wheel.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import ConfigError, suggest
from ..fileio import atomic_write


def _root():
    return resources.files("diffgrpo") / "configs"


def shipped() -> dict[str, str]:
    """name (file stem) → the config's text, sorted by name."""
    root = _root()
    files = sorted((f for f in root.iterdir() if f.name.endswith(".yaml")), key=lambda f: f.name)
    return {f.name[: -len(".yaml")]: f.read_text(encoding="utf-8") for f in files}


SUMMARY_CHARS = 100  # the longest description ``configs list`` prints


def _first_sentence(text: str) -> str:
    """``text`` up to its first full stop followed by a space (outside parentheses), without the stop."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "." and depth == 0 and text[i + 1:i + 2] in (" ", ""):
            return text[:i]
    return text


def summary(text: str, limit: int = SUMMARY_CHARS) -> str:
    """What a config trains: the first sentence of its header comment, ended at a word boundary with an ellipsis
    when it is longer than ``limit`` characters (never mid-word)."""
    head = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        head.append(line.lstrip("#").strip())
    sentence = _first_sentence(" ".join(w for w in head if w))
    if len(sentence) <= limit:
        return sentence
    cut = sentence[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:(-– ")  # room for " …"
    return cut + " …"


def shipped_text(name: str, *, key: str = "configs") -> str:
    """The text of the shipped config ``name`` (``.yaml`` optional); a one-line ConfigError naming the choices."""
    stem = name.removesuffix(".yaml")
    configs = shipped()
    if stem not in configs:
        raise ConfigError(f"{key}: no shipped config {name!r}{suggest(stem, list(configs))}; choose one of "
                          f"{list(configs)} (diffgrpo configs list)")
    return configs[stem]


def config_path(arg: str) -> str | None:
    """``--config ARG`` → None when ARG is an existing file (read as given), else the shipped config's name:
    ``NAME``, ``NAME.yaml`` or ``configs/NAME.yaml`` (the path the configs' headers give, from any directory)."""
    if Path(arg).expanduser().exists():
        return None
    stem = arg.removeprefix("configs/").removesuffix(".yaml")
    return stem if "/" not in stem and stem in shipped() else None


def copy_config(name: str, dest: str | Path = ".") -> Path:
    """Copy the shipped config ``name`` to ``dest`` (a directory, or a new file name); → the written path.
    Refuses to replace an existing file."""
    text = shipped_text(name, key="configs cp")
    dest = Path(dest).expanduser()
    stem = name.removesuffix(".yaml")
    target = dest / f"{stem}.yaml" if dest.is_dir() or str(dest).endswith("/") else dest
    if target.exists() or target.is_symlink():
        raise ConfigError(f"configs cp: {str(target)!r} already exists; choose another destination")
    if not target.parent.is_dir():
        raise ConfigError(f"configs cp: directory {str(target.parent)!r} does not exist")
    return atomic_write(target, text)


__all__ = ["config_path", "copy_config", "shipped", "shipped_text", "summary"]
