"""Source images of image-editing prompts: found in a prompt record's metadata, checked, loaded, handed on.

A prompt record (``data_sources``) may carry ``image`` (one path) or ``images`` (a list of paths). A relative path
resolves against the folder of the prompt file; an absolute one must lie inside that folder too. ``hf:`` datasets
give image columns (``datasets.Image`` values: Pillow images, or ``{"bytes", "path"}`` dicts): those are held in
memory under a key ``hf:<spec>#<row>/<column>[/<i>]`` that stands for the image in the metadata, so that the
metadata stays JSON (sample tables, logs).

Checks at data load (``load_prompts``, so at validation with ``--check-data`` and before any model loads): every
path is a regular file reached without symbolic links (none in the path below the prompt file's folder, the file
itself none), resolving inside that folder, that Pillow recognises as an image of at most :data:`MAX_PIXELS`
pixels (read from the header first) and decodes whole (``Image.verify`` and ``load``: a truncated or corrupt file
is refused here, not at its first use). Each problem is a one-line ConfigError naming the config key, the row and
the path. An hf: image value is checked the same way (its ``bytes`` must be an encoded file's bytes).

Decoding (:func:`to_rgb`) applies the EXIF orientation (``ImageOps.exif_transpose``, as diffusers' ``load_image``
does) and scales deeper pixel types to 8 bits: 16-bit (``I;16*``, and a PNG's ``I``) by 255/65535, float (``F``)
with values in [0, 1] by 255; a 32-bit integer image or a float one outside [0, 1] has no known range and is
refused in one line (Pillow's ``convert("RGB")`` would clip it to white or black).

After resolution a record's ``image`` / ``images`` hold absolute paths (or hf keys); :func:`of_record` gives a
record's sources as a tuple, :func:`load_rgb` one source as an RGB Pillow image (decoded under the same pixel
cap), :func:`attach` the metadata rewards receive: each sample's ``source_images``, a list of (3, H, W) float
tensors in [0, 1] at the source's own size (decoded once per process: an LRU of at most :data:`CACHE_BYTES` bytes
of tensors; a source larger than that is decoded at each use).
"""
from __future__ import annotations

import io
import os
import stat
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from .errors import ConfigError

FIELDS = ("image", "images")  # the metadata fields naming a record's source images
REWARD_FIELD = "source_images"  # what rewards receive beside the sample (a list of (3, H, W) tensors per sample)
MAX_PIXELS = 64 * 1024 * 1024  # per source image (Pillow's own decompression-bomb limit is 89 MP)
CACHE_BYTES = 1 << 30  # of decoded (3, H, W) float32 sources held at once (a 64 MP source alone is 768 MiB)
HF_KEY = "hf:"
_HF_IMAGES: dict[str, object] = {}  # hf key → the encoded file's bytes or a Pillow image (datasets image columns)
_DECODED: OrderedDict[str, torch.Tensor] = OrderedDict()


def _open_checked(path: Path | io.BytesIO, what: str):
    """A Pillow image opened lazily (header only), its pixel count checked."""
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(path)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ConfigError(f"{what} is not an image Pillow can read ({type(e).__name__})") from None
    w, h = im.size
    if w * h > MAX_PIXELS or w < 1 or h < 1:
        im.close()
        raise ConfigError(f"{what} has {w}×{h} pixels; the limit is {MAX_PIXELS} (resize it)")
    return im


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"


def to_rgb(im, what: str):
    """An opened Pillow image → RGB (8 bits a channel) with its EXIF orientation applied; a 16-bit image scaled by
    255/65535, a float one in [0, 1] by 255. A file that does not decode whole (truncated, corrupt) or a pixel
    type of unknown range is a one-line ConfigError."""
    from PIL import Image, ImageOps

    fmt = im.format  # the file's format (a transposed copy has none)
    try:
        im.load()
        im = ImageOps.exif_transpose(im)
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise ConfigError(f"{what} does not decode whole, truncated or corrupt ({_one_line(e)})") from None
    mode = im.mode
    if mode.startswith("I;16") or (mode == "I" and fmt == "PNG"):  # 16 bits a pixel
        arr = np.asarray(im).astype(np.float64) * (255.0 / 65535.0)  # (H, W)
        return Image.fromarray(np.rint(arr).astype(np.uint8)).convert("RGB")
    if mode == "F":
        arr = np.asarray(im, dtype=np.float64)  # (H, W)
        if not (np.isfinite(arr).all() and arr.min() >= 0.0 and arr.max() <= 1.0):
            raise ConfigError(f"{what} is a float image with values outside [0, 1]; save it as an 8- or 16-bit "
                              "image")
        return Image.fromarray(np.rint(arr * 255.0).astype(np.uint8)).convert("RGB")
    if mode in ("I", "I;32", "I;32B", "I;32L"):
        raise ConfigError(f"{what} is a 32-bit integer image (mode {mode}), whose range is not known; save it as an "
                          "8- or 16-bit image")
    try:
        return im.convert("RGB")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} cannot be converted to RGB (mode {mode}: {_one_line(e)})") from None


def _decode_checked(opener, what: str):
    """The image ``opener()`` opens (a path or a fresh BytesIO), checked (pixel cap, ``verify``) and decoded whole
    → RGB (:func:`to_rgb`)."""
    im = _open_checked(opener(), what)
    try:
        im.verify()  # the file's structure and checksums (a PNG cut short or with a broken chunk)
    except Exception as e:  # noqa: BLE001 - Pillow's plug-ins raise what they will for a damaged file
        raise ConfigError(f"{what} does not decode whole, truncated or corrupt ({_one_line(e)})") from None
    finally:
        im.close()
    with _open_checked(opener(), what) as im:
        return to_rgb(im, what)


KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(p: Path) -> str:
    """What ``p`` is when it exists but is not a regular file ("a directory", "a FIFO (named pipe)", ...), else
    ``""`` (it does not exist). Never opens it (a FIFO would block)."""
    try:
        mode = os.lstat(p).st_mode
    except OSError:
        return ""
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def _check_path(value: str, base: Path | None, what: str) -> str:
    """An existing image file below ``base`` reached without links → its absolute path (as a string)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{what}: {value!r} is not a path (a non-empty string)")
    if base is None:
        raise ConfigError(f"{what}: {value!r} is a path, but paths need a prompt file to resolve against")
    root = Path(os.path.abspath(base))
    p = Path(os.path.abspath(root / Path(value).expanduser()))
    try:
        rel = p.relative_to(root)
    except ValueError:
        raise ConfigError(f"{what}: {value!r} lies outside the prompt file's folder {str(root)!r}") from None
    cur = root
    for part in rel.parts:
        cur = cur / part
        if cur.is_symlink():
            raise ConfigError(f"{what}: {value!r} goes through the symbolic link {str(cur)!r}; give the file itself")
    if not p.is_file():
        kind = _kind(p)
        raise ConfigError(f"{what}: image {value!r} " + (f"is {kind}, not an image file" if kind else "does not exist")
                          + f" (resolved to {str(p)!r})")
    try:
        real = Path(os.path.realpath(p))
        real.relative_to(Path(os.path.realpath(root)))
    except (OSError, ValueError):
        raise ConfigError(f"{what}: {value!r} resolves outside the prompt file's folder") from None
    _decode_checked(lambda: p, f"{what}: {value!r}")
    return str(p)


def _hf_image(value, key: str, what: str) -> str:
    """A datasets image value (Pillow image or {"bytes", "path"}) held in memory under ``key``."""
    from PIL import Image

    if isinstance(value, dict) and "bytes" in value:  # an undecoded image column: kept compressed
        data = value["bytes"]
        if not isinstance(data, (bytes, bytearray)) or not data:
            raise ConfigError(f"{what}: its 'bytes' is a {type(data).__name__}, not an image file's bytes (an hf: "
                              "image column's value); in a JSONL or CSV file name the image by its path (a string)")
        data = bytes(data)
        _decode_checked(lambda: io.BytesIO(data), what)
        _HF_IMAGES[key] = data
        return key
    if not isinstance(value, Image.Image):
        raise ConfigError(f"{what}: {str(value)[:80]!r} is neither a path (a string) nor an image (an hf: image "
                          "column's value)")
    w, h = value.size
    if w * h > MAX_PIXELS:
        raise ConfigError(f"{what} has {w}×{h} pixels; the limit is {MAX_PIXELS}")
    to_rgb(value, what)
    _HF_IMAGES[key] = value
    return key


def resolve(records: list[dict], *, base: Path | None, spec: str, key: str, where: str = "record") -> list[dict]:
    """``records`` with their ``image`` / ``images`` fields resolved and checked (see the module doc). ``base``: the
    prompt file's folder (None for an hf: dataset, whose images are values, not paths). ``where``: what a record
    is called in messages ("record", "row"); ``""``: ``spec`` is itself the image argument (``--image PATH``),
    named alone."""
    out = []
    for n, rec in enumerate(records):
        named = f"{key}: file {spec!r} {where} {n + 1}" if where else f"{key} {spec!r}"
        if not any(f in rec for f in FIELDS):
            out.append(rec)
            continue
        if all(f in rec for f in FIELDS):
            raise ConfigError(f"{named}: give either 'image' or 'images', not both")
        rec = dict(rec)
        for f in FIELDS:
            if f not in rec:
                continue
            values = rec[f] if f == "images" else [rec[f]]
            if f == "images" and (not isinstance(values, list) or not values):
                raise ConfigError(f"{named}: 'images' must be a non-empty list of paths")
            what = f"{named} field {f!r}" if where else named
            done = []
            for i, v in enumerate(values):
                if isinstance(v, str):
                    done.append(_check_path(v, base, what))
                else:
                    done.append(_hf_image(v, f"{HF_KEY}{spec}#{n}/{f}" + (f"/{i}" if f == "images" else ""), what))
            rec[f] = done if f == "images" else done[0]
        out.append(rec)
    return out


def of_record(meta: dict) -> tuple[str, ...]:
    """The source images (absolute paths or hf keys) a record or a sample's metadata names; () for none."""
    if "images" in meta:
        return tuple(meta["images"])
    if "image" in meta:
        return (meta["image"],)
    return ()


def of_batch(metadata: list[dict]) -> list[tuple[str, ...]] | None:
    """Each sample's sources, or None when no sample has any (a text-to-image batch)."""
    out = [of_record(m) for m in metadata]
    return out if any(out) else None


def load_rgb(ref: str):
    """One source (a resolved path or an hf key) as an RGB Pillow image (:func:`to_rgb`)."""
    what = f"source image {ref!r}"
    if ref.startswith(HF_KEY):
        if ref not in _HF_IMAGES:
            raise ConfigError(f"source image {ref!r} is not loaded (load its dataset with load_prompts)")
        held = _HF_IMAGES[ref]
        if isinstance(held, bytes):
            with _open_checked(io.BytesIO(held), what) as im:
                return to_rgb(im, what)
        return to_rgb(held, what)
    p = Path(ref)
    if p.is_symlink():
        raise ConfigError(f"source image {ref!r} is a symbolic link")
    with _open_checked(p, what) as im:
        return to_rgb(im, what)


def _cached_bytes() -> int:
    return sum(t.nbytes for t in _DECODED.values())


def as_tensor(ref: str) -> torch.Tensor:
    """A source as a (3, H, W) float32 tensor in [0, 1], cached while the cache holds at most
    :data:`CACHE_BYTES` bytes (least recently used first out)."""
    if ref in _DECODED:
        _DECODED.move_to_end(ref)
        return _DECODED[ref]
    u8 = torch.from_numpy(np.ascontiguousarray(np.asarray(load_rgb(ref)).transpose(2, 0, 1)))  # (3, H, W) uint8
    t = u8.to(torch.float32).div_(255.0)  # one float copy (a 64 MP source: 768 MiB)
    if t.nbytes > CACHE_BYTES:
        return t
    _DECODED[ref] = t
    while _cached_bytes() > CACHE_BYTES:
        _DECODED.popitem(last=False)
    return t


def attach(metadata: list[dict]) -> list[dict]:
    """The metadata an image reward receives (the flow family scores its decoded images with it): a sample with
    sources also gets ``source_images`` (its sources as (3, H, W) tensors in [0, 1]); ``metadata`` itself is not
    changed. Without any source, ``metadata`` as is."""
    if not any(of_record(m) for m in metadata):
        return metadata
    return [{**m, REWARD_FIELD: [as_tensor(r) for r in of_record(m)]} if of_record(m) else m for m in metadata]


def first_source(meta: dict, size: tuple[int, int]) -> torch.Tensor | None:
    """A sample's first source resized (bilinear) to ``size`` (H, W): (3, H, W) in [0, 1], or None."""
    refs = of_record(meta)
    if not refs:
        return None
    t = as_tensor(refs[0])
    if tuple(t.shape[-2:]) != tuple(size):
        t = torch.nn.functional.interpolate(t[None], size=size, mode="bilinear", align_corners=False)[0]
    return t.clamp(0, 1)


__all__ = ["CACHE_BYTES", "FIELDS", "MAX_PIXELS", "REWARD_FIELD", "as_tensor", "attach", "first_source", "load_rgb",
           "of_batch", "of_record", "resolve", "to_rgb"]
