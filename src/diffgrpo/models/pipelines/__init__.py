"""The diffusers architectures, one module each, and their table.

Each module (``sd3``, ``flux``, ``wan``, ``qwenimage``, ``zimage``, ``flux2``, ``editing``, ``qwenimage21``,
``hunyuanvideo15``, ``ltx2``) holds the functions of its rows (``encode``, ``forward``, ``decode``, ``latent_shape``, an
optional ``check``) and its ``ROWS`` (:class:`~.spec.PipelineSpec`). :data:`PIPELINES` maps each row's name
(``model.pipeline``) to it, in the order detection tries them. Adding an architecture is one module and its rows here.
"""
from __future__ import annotations

from . import editing, flux, flux2, hunyuanvideo15, ltx2, qwenimage, qwenimage21, sd3, wan, zimage
from .spec import ForwardArgs, PipelineSpec

PIPELINES: dict[str, PipelineSpec] = {
    row.name: row
    for module in (sd3, flux, wan, qwenimage, zimage, flux2, editing, qwenimage21, hunyuanvideo15, ltx2)
    for row in module.ROWS
}

__all__ = ["PIPELINES", "ForwardArgs", "PipelineSpec", "editing", "flux", "flux2", "hunyuanvideo15", "ltx2", "qwenimage",
           "qwenimage21", "sd3", "wan", "zimage"]
