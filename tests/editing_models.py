"""Tiny random-weight image-editing pipelines built from the pipelines' own classes and saved locally, with a
JSONL of (source image, instruction) pairs: ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` (a tiny
Qwen2.5-VL text encoder with its vision tower, a Qwen2-VL processor over a character-level tokenizer with the
chat's special tokens, the Qwen-Image VAE and transformer) and ``FluxKontextPipeline`` (CLIP + T5, a KL VAE,
the FLUX transformer).

Without torchvision (this project's CPU test machines) transformers cannot build Qwen2-VL's video processor, which
``Qwen2VLProcessor`` requires; :func:`image_only_processor` lets the processor hold its image processor and
tokenizer alone (editing never passes videos), for saving and loading both."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import string
from pathlib import Path

import numpy as np
import torch

RES = 64  # output side (8×8 latents); sources are RES × RES too
T = 2
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
           "<|endoftext|>"]
INSTRUCTIONS = ["make it red", "add a hat", "turn it blue"]


@contextlib.contextmanager
def image_only_processor():
    """``Qwen2VLProcessor`` with (image_processor, tokenizer) only, when torchvision is missing (see module doc)."""
    from transformers import Qwen2VLProcessor

    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    saved = Qwen2VLProcessor.__dict__.get("get_attributes")
    Qwen2VLProcessor.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])
    try:
        yield
    finally:
        if saved is None:
            del Qwen2VLProcessor.get_attributes
        else:
            Qwen2VLProcessor.get_attributes = saved


def _eval(pipe):
    """Every module in eval mode, as ``from_pretrained`` leaves them (T5's dropout is on in a fresh model)."""
    for m in pipe.components.values():
        if isinstance(m, torch.nn.Module):
            m.eval()
    return pipe


def _qwen_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1}
    for c in string.ascii_letters + string.digits + " .,!?'-:()\n/":
        vocab[c] = len(vocab)
    for s in SPECIAL:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=SPECIAL), vocab


def _qwen_text_encoder(vocab):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(vocab), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "bos_token_id": None, "eos_token_id": None,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16,
                           "fullatt_block_indexes": [0], "window_size": 56, "patch_size": 14, "spatial_merge_size": 2,
                           "temporal_patch_size": 2},
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(cfg)


def qwen_edit_pipeline(plus: bool = False):
    """A tiny QwenImageEditPipeline (``plus``: QwenImageEditPlusPipeline) of seeded random weights."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor

    torch.manual_seed(0)
    tok, vocab = _qwen_tokenizer()
    proc = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=448 * 448),
                            tokenizer=tok)
    text = _qwen_text_encoder(vocab)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                                 latents_std=[1.5, 2.0, 1.0, 0.8])
    tr = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=8,
                                     num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                            base_image_seq_len=16, max_image_seq_len=256)
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return _eval(cls(scheduler=sched, vae=vae, text_encoder=text, tokenizer=tok, processor=proc, transformer=tr))


def kontext_pipeline():
    """A tiny FluxKontextPipeline of seeded random weights (guidance-distilled transformer)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxKontextPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from tests.test_diffusers_models import _clip_tokenizer, _t5_tokenizer

    torch.manual_seed(0)
    clip = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "max_position_embeddings": 16, "projection_dim": 8, "vocab_size": 100, "bos_token_id": 0, "eos_token_id": 1,
                "pad_token_id": 1}
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, sample_size=64, scaling_factor=0.36, shift_factor=0.1,
                        use_quant_conv=False, use_post_quant_conv=False)
    tr = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                                guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                            base_image_seq_len=16, max_image_seq_len=256)
    return _eval(FluxKontextPipeline(
        scheduler=sched, vae=vae, text_encoder=CLIPTextModel(CLIPTextConfig(**clip)), tokenizer=_clip_tokenizer(),
        text_encoder_2=T5EncoderModel(T5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_heads=2)),
        tokenizer_2=_t5_tokenizer(), transformer=tr))


def write_sources(d: Path, n: int = 3, seed: int = 0, side: int = RES) -> list[str]:
    """``n`` smooth random RGB sources (PNG) in ``d/images`` → their paths relative to ``d``."""
    from PIL import Image

    (d / "images").mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        low = g.random((4, 4, 3))
        arr = np.asarray(Image.fromarray((low * 255).astype("uint8")).resize((side, side), Image.BILINEAR))
        Image.fromarray(arr).save(d / "images" / f"src{i}.png")
        out.append(f"images/src{i}.png")
    return out


def write_edit_jsonl(d: Path, n_sources: int = 1) -> Path:
    """``d/edits.jsonl``: one (source(s), instruction) record per instruction; the paths relative to ``d``."""
    paths = write_sources(d, len(INSTRUCTIONS) + n_sources)
    rows = []
    for i, ins in enumerate(INSTRUCTIONS):
        srcs = paths[i:i + n_sources]
        rows.append({"prompt": ins, **({"image": srcs[0]} if n_sources == 1 else {"images": srcs})})
    (d / "edits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "edits.jsonl"
