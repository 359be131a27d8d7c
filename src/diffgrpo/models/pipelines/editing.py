"""Image-editing pipelines: Qwen-Image-Edit, Qwen-Image-Edit-Plus (several sources) and FLUX.1 Kontext.

Each is a row of the pipeline table (``models.pipelines.PIPELINES``) whose conditioning adds the prompt's source
image(s) (``sources``: the ``image`` / ``images`` fields of its record); the row's ``edit`` encodes (instruction,
sources) pairs. What this module holds:

| pipeline key         | pipeline                   | text conditioning (per prompt)                    | image conditioning          |
|----------------------|----------------------------|---------------------------------------------------|-----------------------------|
| qwenimage_edit       | QwenImageEditPipeline      | Qwen2.5-VL over the instruction and the source    | VAE latents of the source   |
| qwenimage_edit_plus  | QwenImageEditPlusPipeline  | Qwen2.5-VL over "Picture i:" + every source, each | VAE latents of every source |
|                      |                            | seen at :data:`PLUS_CONDITION_AREA` pixels        |                             |
| flux_kontext         | FluxKontextPipeline        | CLIP pooled + T5 (FLUX.1's, no image)             | VAE latents of the source   |

Exactness: the source is resized to the output's square side (``model.resolution``), as the pipelines resize it
to their target area (1024² for Qwen-Image-Edit and for Edit-Plus's VAE view; Kontext's preferred 1024×1024 for a
square source), so at the published resolution a square source is encoded as the pipelines encode it; a source of
another aspect ratio is stretched to the square (the pipelines keep its aspect). The VAE encodes the mode of its
posterior (the pipelines' ``sample_mode="argmax"``), so the encoding is deterministic.

Cost: each (instruction, sources) pair is encoded once (the policy's LRU cache), the VAE and the vision-language
encoder once per pair, each pair on its own (a batched encoding would round differently with the batch's padding).
In every forward the source tokens are appended to the noisy latent tokens (Qwen: ``img_shapes`` lists both;
Kontext: rotary ids with first coordinate 1) and the prediction of the latent tokens is kept, as the pipelines do:
the sequence grows by h/2·w/2 tokens per source, which every engine pays in every forward.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ... import sources as source_images
from ...config import RunConfig
from ...data_sources import BUILTIN_PREFIX, load_prompts, reads_data
from ...errors import ConfigError
from ..latents import flux_image_ids, pack_2x2
from ..lora import JOINT_TARGETS
from . import flux, qwenimage
from .spec import ForwardArgs, PipelineSpec, embedded_guidance, pad_seq

EDIT_PIPELINES = {"QwenImageEditPipeline": "qwenimage_edit", "QwenImageEditPlusPipeline": "qwenimage_edit_plus",
                  "FluxKontextPipeline": "flux_kontext"}
MULTI_SOURCE = ("qwenimage_edit_plus",)  # pipelines that take several sources per prompt
PLUS_CONDITION_AREA = 384 * 384  # QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE: its VL encoder's view
# published hub ids (prefixes) of editing pipelines: recognised before anything is downloaded
PUBLISHED = {"Qwen/Qwen-Image-Edit-2509": "QwenImageEditPlusPipeline", "Qwen/Qwen-Image-Edit-2511":
             "QwenImageEditPlusPipeline", "Qwen/Qwen-Image-Edit": "QwenImageEditPipeline",
             "black-forest-labs/FLUX.1-Kontext": "FluxKontextPipeline"}


def is_edit(name: str) -> bool:
    """Whether the pipeline key ``name`` is an editing pipeline's."""
    return name in MULTI_SOURCE or name in EDIT_PIPELINES.values()


def pipeline_class(pretrained: str) -> str | None:
    """The pipeline class ``model.pretrained`` names, read without loading: a local directory's model_index.json
    ``_class_name``, or a published editing id; None when unknown."""
    p = Path(pretrained).expanduser()
    if (p / "model_index.json").is_file():
        try:
            return json.loads((p / "model_index.json").read_text(encoding="utf-8")).get("_class_name")
        except (OSError, ValueError):
            return None
    return next((cls for pre, cls in PUBLISHED.items() if pretrained.startswith(pre)), None)


def keys(prompts: list[str], sources: list[tuple[str, ...]] | None, name: str) -> list[tuple[str, tuple]]:
    """Cache keys (instruction, sources) of a batch; an editing pipeline without a source is a ConfigError."""
    if sources is None or len(sources) != len(prompts) or not all(sources):
        missing = next((p for i, p in enumerate(prompts) if sources is None or not sources[i]), prompts[0])
        raise ConfigError(f"model.pretrained: pipeline {name} edits images and needs a source image per "
                          f"prompt (its record's 'image' or 'images' field); the prompt {missing!r} has none "
                          "(prompts from train.prompts_file / eval.prompts_file carry them; diffgrpo sample takes --image)")
    return [(p, tuple(s)) for p, s in zip(prompts, sources)]


# ------------------------------------------------------------------------------------------- encoding


def _plus_condition_size(im) -> tuple[int, int]:
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
        calculate_dimensions,
    )

    w, h = calculate_dimensions(PLUS_CONDITION_AREA, im.size[0] / im.size[1])[:2]
    return h, w


def _vae_latents(pipe, im, side: int, video_vae: bool) -> torch.Tensor:
    """A source image → its (C, h, w) VAE latents, normalised as the pipeline normalises them."""
    x = pipe.image_processor.preprocess(im, side, side).to(device=pipe.transformer.device, dtype=pipe.vae.dtype)
    if not video_vae:  # x: (1, 3, side, side) in [-1, 1]
        return pipe._encode_vae_image(x, generator=None)[0]
    return pipe._encode_vae_image(x.unsqueeze(2), generator=None)[0, :, 0]  # the Qwen VAE is (B, C, F, H, W)


def _kontext_pair(pipe, prompt: str, refs: tuple, max_sequence_length: int, side: int) -> dict[str, torch.Tensor]:
    im = pipe.image_processor.resize(source_images.load_rgb(refs[0]), side, side)
    cond = flux.encode(pipe, [prompt], max_sequence_length)
    return {**cond, "image_latents": _vae_latents(pipe, im, side, False)[None, None]}


def _qwen_pair(pipe, prompt: str, refs: tuple, max_sequence_length: int, side: int,
               plus: bool) -> dict[str, torch.Tensor]:
    proc = pipe.image_processor
    ims = [source_images.load_rgb(r) for r in refs]
    if plus:  # the VL encoder sees each source at its condition size, the VAE at the output's
        vl = [proc.resize(im, *_plus_condition_size(im)) for im in ims]
    else:
        ims = [proc.resize(ims[0], side, side)]
        vl = ims[0]
    pe, mask = pipe.encode_prompt(prompt=[prompt], image=vl, device=pipe.transformer.device,
                                  max_sequence_length=max_sequence_length)
    if mask is None:
        mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)
    return {"prompt_embeds": pe, "prompt_mask": mask,
            "image_latents": torch.stack([_vae_latents(pipe, im, side, True) for im in ims])[None]}


def _stack(parts: list[dict]) -> dict[str, torch.Tensor]:
    """Per-pair encodings (each batched (1, ...)) → one batch, text sequences zero-padded to a common length."""
    out = {}
    for k in parts[0]:
        ts = [d[k] for d in parts]
        if k in ("prompt_embeds", "prompt_mask"):
            L = max(t.shape[1] for t in ts)
            ts = [pad_seq(t, L) for t in ts]
        out[k] = torch.cat(ts)
    return out


@torch.no_grad()
def encode_kontext(pipe, batch: list[tuple[str, tuple]], max_sequence_length: int, side: int) -> dict:
    """[(instruction, sources)] → {"prompt_embeds", "pooled", "image_latents": (B, 1, C, h, w)} through the
    pipeline's own ``encode_prompt``, ``image_processor`` and ``_encode_vae_image``; ``side``: the square pixel
    size the source is resized to (the output's)."""
    return _stack([_kontext_pair(pipe, p, refs, max_sequence_length, side) for p, refs in batch])


@torch.no_grad()
def encode_qwen(pipe, batch: list[tuple[str, tuple]], max_sequence_length: int, side: int) -> dict:
    """[(instruction, source)] → {"prompt_embeds", "prompt_mask", "image_latents": (B, 1, C, h, w)}."""
    return _stack([_qwen_pair(pipe, p, refs, max_sequence_length, side, False) for p, refs in batch])


@torch.no_grad()
def encode_qwen_plus(pipe, batch: list[tuple[str, tuple]], max_sequence_length: int, side: int) -> dict:
    """[(instruction, sources)] → {"prompt_embeds", "prompt_mask", "image_latents": (B, n, C, h, w)}."""
    return _stack([_qwen_pair(pipe, p, refs, max_sequence_length, side, True) for p, refs in batch])


# ------------------------------------------------------------------------------------------- the forward


def _with_sources(h: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
    """h (N, L, 4C) packed noisy latents, img (N, n, C, hs, ws) → (N, L + n·hs/2·ws/2, 4C)."""
    return torch.cat([h, *[pack_2x2(img[:, i]).to(h.dtype) for i in range(img.shape[1])]], 1)


def forward_kontext(tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict,
                    args: ForwardArgs) -> torch.Tensor:
    """FLUX.1 Kontext: the source's tokens appended with rotary ids (1, row, col) → the L latent tokens'
    prediction (N, L, 4C)."""
    H, W = args.latent_hw
    img = cond["image_latents"]  # (N, 1, C, hs, ws)
    hs, ws = img.shape[-2:]
    src = flux_image_ids(hs // 2, ws // 2, h.device, h.dtype)
    src[:, 0] = 1  # the pipeline's marker of the source image's tokens
    ids = torch.cat([flux_image_ids(H // 2, W // 2, h.device, h.dtype), src])
    Lt = cond["prompt_embeds"].shape[1]
    out = tr(hidden_states=_with_sources(h, img), encoder_hidden_states=cond["prompt_embeds"],
             pooled_projections=cond["pooled"], timestep=sigma, guidance=embedded_guidance(tr, h, args.guidance),
             img_ids=ids, txt_ids=torch.zeros(Lt, 3, device=h.device, dtype=h.dtype), return_dict=False)[0]
    return out[:, :h.shape[1]]


def forward_qwen(tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """Qwen-Image-Edit (Plus): every source's tokens appended, ``img_shapes`` listing them → the L latent tokens'
    prediction (N, L, 4C)."""
    H, W = args.latent_hw
    img = cond["image_latents"]  # (N, n, C, hs, ws)
    N, n, _, hs, ws = img.shape
    shapes = [[(1, H // 2, W // 2), *[(1, hs // 2, ws // 2)] * n]] * N
    out = tr(hidden_states=_with_sources(h, img), encoder_hidden_states=cond["prompt_embeds"],
             encoder_hidden_states_mask=cond["prompt_mask"], timestep=sigma,
             guidance=embedded_guidance(tr, h, args.guidance), img_shapes=shapes, return_dict=False)[0]
    return out[:, :h.shape[1]]


# ------------------------------------------------------------------------------------------- data rules


def check_records(records: list[dict], name: str, key: str) -> None:
    """Every record of an editing run names its source(s): one for a one-source pipeline, the same number for all
    (Edit-Plus batches stack them)."""
    counts = set()
    for n, rec in enumerate(records):
        refs = source_images.of_record(rec)
        if not refs:
            raise ConfigError(f"{key}: record {n + 1} ({rec.get('prompt', '')[:40]!r}) has no source image; "
                              f"pipeline {name} edits images: give every record an 'image' field"
                              f"{' (or images: [...])' if name in MULTI_SOURCE else ''}")
        if len(refs) > 1 and name not in MULTI_SOURCE:
            raise ConfigError(f"{key}: record {n + 1} has {len(refs)} source images; pipeline {name} takes one "
                              "(Qwen-Image-Edit-Plus, e.g. Qwen/Qwen-Image-Edit-2509, takes several)")
        counts.add(len(refs))
    if len(counts) > 1:
        raise ConfigError(f"{key}: records have {sorted(counts)} source images; give every record the same number")


def check_config(cfg: RunConfig, purpose: str = "train") -> None:
    """``model.name=diffusers`` with an editing pipeline (``model.pipeline``, or read from ``model.pretrained``
    without loading it): the train and eval prompts must be files whose every record names its source image(s);
    not for ``purpose="sample"`` (``diffgrpo sample`` takes the sources from ``--image``; ``validation.PURPOSES``)."""
    m = cfg.model
    if m.name != "diffusers" or purpose == "sample":
        return
    cls = pipeline_class(m.pretrained) if m.pretrained else None
    name = m.pipeline if m.pipeline != "auto" else EDIT_PIPELINES.get(cls or "", "")
    if not is_edit(name):
        return
    what = f"model.pretrained {m.pretrained!r} is an image-editing pipeline ({cls or name})"
    for key, spec in (("train.prompts_file", cfg.train.prompts_file), ("eval.prompts_file", cfg.eval.prompts_file)):
        if not spec:
            raise ConfigError(f"{key}: {what} and needs a source image per prompt: give a JSONL whose records carry "
                              "'image' (or 'images') beside the instruction (e.g. builtin:edit/train), not the "
                              "digit prompts")
        if reads_data(purpose) or spec.startswith(BUILTIN_PREFIX):  # a shipped set is checked always (it is small)
            check_records(load_prompts(spec, key=key, column=cfg.train.prompt_column), name, key)


def _row(name: str, pipeline_class: str, base, cond_keys: tuple[str, ...], forward, edit) -> PipelineSpec:
    """An editing row: its text-to-image base's conventions (timestep, packing, guidance, text length, VAE) with the
    sources' latents as one more conditioning tensor."""
    (b,) = base.ROWS
    return PipelineSpec(name, b.transformer_class, pipeline_class, b.timestep_scale, packed=True, video=False,
                        true_cfg=b.true_cfg, cfg_renorm=b.cfg_renorm, cond_keys=(*cond_keys, "image_latents"),
                        lora_targets=JOINT_TARGETS, max_sequence_length=b.max_sequence_length, encode=b.encode,
                        forward=forward, decode=b.decode, latent_shape=b.latent_shape, edit=edit,
                        multi_source=name in MULTI_SOURCE)


ROWS = (
    _row("qwenimage_edit", "QwenImageEditPipeline", qwenimage, ("prompt_embeds", "prompt_mask"), forward_qwen,
         encode_qwen),
    _row("qwenimage_edit_plus", "QwenImageEditPlusPipeline", qwenimage, ("prompt_embeds", "prompt_mask"),
         forward_qwen, encode_qwen_plus),
    _row("flux_kontext", "FluxKontextPipeline", flux, ("prompt_embeds", "pooled"), forward_kontext, encode_kontext),
)

__all__ = [
    "EDIT_PIPELINES",
    "ROWS",
    "check_config",
    "check_records",
    "encode_kontext",
    "encode_qwen",
    "encode_qwen_plus",
    "forward_kontext",
    "forward_qwen",
    "is_edit",
    "keys",
    "pipeline_class",
]
