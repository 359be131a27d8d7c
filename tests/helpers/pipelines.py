"""Tiny random-weight diffusers pipelines built from the pipelines' own classes, nothing downloaded.

Text-to-image: character-level CLIP and T5 tokenizers, a one-block transformer of each family (SD3, FLUX, Wan,
Qwen-Image) with a stub text encoding and a stub decoder for adapter-level tests, and a full
``StableDiffusion3Pipeline`` saved to a directory. Image editing, with a JSONL of (source image, instruction)
pairs: ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` (a tiny Qwen2.5-VL text encoder with its vision
tower, a Qwen2-VL processor over a character-level tokenizer with the chat's special tokens, the Qwen-Image VAE and
transformer) and ``FluxKontextPipeline`` (CLIP + T5, a KL VAE, the FLUX transformer). Text-to-image and video of
the newer pipelines: ``QwenImage21Pipeline`` (a Qwen3-VL text encoder, the 2.1 VAE and block-causal transformer),
``HunyuanVideo15Pipeline`` (Qwen2.5-VL text and ByT5 glyph encoders, the 1.5 VAE and transformer, its CFG guider) and
``LTX2Pipeline`` (a Gemma 3 text encoder and connectors, the video and audio VAEs, the vocoder, the transformer).

Without torchvision (this project's CPU test machines) transformers cannot build Qwen2-VL's video processor, which
``Qwen2VLProcessor`` requires; :func:`image_only_processor` lets the processor hold its image processor and
tokenizer alone (editing never passes videos), for saving and loading both."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import string
import zlib
from pathlib import Path

import numpy as np
import torch

RES = 64  # output side (8×8 latents); sources are RES × RES too
T = 2
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
           "<|endoftext|>"]
INSTRUCTIONS = ["make it red", "add a hat", "turn it blue"]
PROMPTS = ["a red cat", "a blue dog on the grass", "the sun"]


# ------------------------------------------------------------------------------------------- text-to-image
def clip_tokenizer():
    from transformers import CLIPTokenizer

    chars = list(string.ascii_lowercase + string.digits + ".,!?'-")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for c in chars:
            vocab[c + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16)


def t5_tokenizer():
    from transformers import T5Tokenizer

    chars = list(string.ascii_lowercase + string.digits + ".,!?'-")
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def tiny_transformer(family: str):
    torch.manual_seed(0)
    if family == "sd3":
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                     attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                     caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=8)
    if family == "flux":
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                      attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                      pooled_projection_dim=8, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    if family == "wan":
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                     in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                     num_layers=1, rope_max_seq_len=32)
    if family == "qwenimage":
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                           attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                           axes_dims_rope=(2, 2, 4))
    raise ValueError(family)


LATENTS = {"sd3": (4, 8, 8), "flux": (4, 8, 8), "wan": (4, 2, 8, 8), "qwenimage": (4, 8, 8)}


def stub_encoder(family: str):
    """Deterministic per-prompt embeddings of the shapes the family's pipeline produces (Qwen: varying length)."""

    def encode(prompts):
        out = {}
        for p in prompts:
            g = torch.Generator().manual_seed(zlib.crc32(p.encode()))
            L = 3 + len(p.split()) if family == "qwenimage" else 6
            item = {"prompt_embeds": torch.randn(1, L, 16, generator=g)}
            if family in ("sd3", "flux"):
                item["pooled"] = torch.randn(1, 16 if family == "sd3" else 8, generator=g)
            if family == "qwenimage":
                item["prompt_mask"] = torch.ones(1, L, dtype=torch.long)
            for k, v in item.items():
                out.setdefault(k, []).append(v)
        if family == "qwenimage":  # the pipeline pads a batch to its longest prompt and masks the padding
            L = max(v.shape[1] for v in out["prompt_embeds"])
            out["prompt_embeds"] = [torch.nn.functional.pad(v, (0, 0, 0, L - v.shape[1])) for v in out["prompt_embeds"]]
            out["prompt_mask"] = [torch.nn.functional.pad(v, (0, L - v.shape[1])) for v in out["prompt_mask"]]
        return {k: torch.cat(v) for k, v in out.items()}

    return encode


def stub_decoder(z):
    """Latents → a 3-channel image in [0, 1] (first frame for video)."""
    if z.dim() == 5:
        z = z[:, :, 0]
    return torch.sigmoid(z[:, :3].float()).repeat_interleave(2, -1).repeat_interleave(2, -2)


def adapter_policy(family, **kw):
    """A policy of the table row ``family`` over its tiny transformer; ``kw``: its ``PolicyOptions``."""
    from diffgrpo.models.diffusers_adapter import DiffusersFlowPolicy, PolicyOptions

    return DiffusersFlowPolicy(tiny_transformer(family), family, PolicyOptions(**kw), latent_shape=LATENTS[family],
                               encoder=stub_encoder(family), decoder=stub_decoder)


def save_sd3_pipeline(d: Path) -> Path:
    """A full StableDiffusion3Pipeline of tiny random components saved at ``d`` (save_pretrained), with
    ``PROMPTS`` in ``d/prompts.txt``."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    torch.manual_seed(0)
    clip = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=16, projection_dim=8, vocab_size=100, bos_token_id=0, eos_token_id=1,
                pad_token_id=1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, sample_size=16, scaling_factor=1.5, shift_factor=0.06,
                        use_quant_conv=False, use_post_quant_conv=False)
    pipe = StableDiffusion3Pipeline(
        transformer=tiny_transformer("sd3"), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer=clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer_2=clip_tokenizer(),
        text_encoder_3=T5EncoderModel(T5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)),
        tokenizer_3=t5_tokenizer())
    pipe.save_pretrained(str(d))
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return d


# ------------------------------------------------------------------------------------------- image editing


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
        scheduler=sched, vae=vae, text_encoder=CLIPTextModel(CLIPTextConfig(**clip)), tokenizer=clip_tokenizer(),
        text_encoder_2=T5EncoderModel(T5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_heads=2)),
        tokenizer_2=t5_tokenizer(), transformer=tr))


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


# ------------------------------------------------------------------------------------------- Qwen-Image 2.1

QWEN3VL_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{{ c['text'] }}"
                "{% endfor %}<|im_end|>\n{% endfor %}")


@contextlib.contextmanager
def qwen3vl_image_only_processor():
    """``Qwen3VLProcessor`` with (image_processor, tokenizer) only when torchvision is missing (text-to-image
    never passes videos); as :func:`image_only_processor`."""
    from transformers import Qwen3VLProcessor

    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    saved = Qwen3VLProcessor.__dict__.get("get_attributes")
    Qwen3VLProcessor.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])
    try:
        yield
    finally:
        if saved is None:
            del Qwen3VLProcessor.get_attributes
        else:
            Qwen3VLProcessor.get_attributes = saved


def qwenimage21_pipeline(sample_sigmas: list[float] | None = None):
    """A tiny QwenImage21Pipeline of seeded random weights: a one-layer Qwen3-VL text encoder over a character
    tokenizer, a two-level Qwen-Image 2.1 VAE (16× spatial: 8 levels of 2× would be the published one), a
    one-block transformer with 8 latent channels. Build it inside :func:`qwen3vl_image_only_processor`."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    torch.manual_seed(0)
    tok, vocab = _qwen_tokenizer()
    proc = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=256 * 256),
                            tokenizer=tok, chat_template=QWEN3VL_CHAT)
    cfg = Qwen3VLConfig(
        text_config={"vocab_size": len(vocab), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    text = Qwen3VLForConditionalGeneration(cfg)
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False, True, True, True],
                                   latents_mean=[0.1 * i for i in range(8)], latents_std=[1.0 + 0.1 * i for i in range(8)])
    tr = QwenImage21Transformer2DModel(in_channels=8, out_channels=8, num_layers=1, attention_head_dim=8,
                                       num_attention_heads=2, context_in_dim=16, mlp_ratio=2, axes_dims_rope=(2, 2, 4))
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                            base_image_seq_len=16, max_image_seq_len=256, time_shift_type="exponential")
    return _eval(QwenImage21Pipeline(scheduler=sched, vae=vae, text_encoder=text, processor=proc, transformer=tr,
                                     sample_sigmas=sample_sigmas))


# ------------------------------------------------------------------------------------------- HunyuanVideo 1.5

HY_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
           "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def hunyuanvideo15_pipeline(guidance_scale: float = 6.0):
    """A tiny HunyuanVideo15Pipeline of seeded random weights: a two-layer Qwen2.5-VL text model over a character
    tokenizer with a chat template, a one-layer ByT5 (T5) glyph encoder, a two-level 16× VAE (4× in time), a
    one-block transformer (4 latent channels: in 2·4 + 1), CFG through the pipeline's guider."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    tok, vocab = _qwen_tokenizer()
    tok.chat_template = HY_CHAT
    text = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}))
    glyph = T5EncoderModel(T5Config(vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4, scaling_factor=0.9)
    tr = HunyuanVideo15Transformer3DModel(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                          num_layers=1, num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=16,
                                          image_embed_dim=16, rope_axes_dim=(2, 2, 4), target_size=64, task_type="t2v")
    return _eval(HunyuanVideo15Pipeline(
        text_encoder=text, tokenizer=tok, transformer=tr, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=glyph, tokenizer_2=ByT5Tokenizer(), guider=ClassifierFreeGuidance(guidance_scale=guidance_scale)))


# ------------------------------------------------------------------------------------------- LTX-2


def ltx2_pipeline():
    """A tiny LTX2Pipeline of seeded random weights: a two-layer Gemma 3 text encoder over a character tokenizer,
    one-layer connectors, a one-level video VAE (2× in space and time) and audio VAE with non-trivial latent
    statistics, a small vocoder, a two-block transformer (4 video and 4 audio token channels), a scheduler with
    dynamic shifting (mu from the video token count)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    tok, vocab = _qwen_tokenizer()
    text = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={"vocab_size": len(vocab), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 8},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, image_token_index=vocab["<|image_pad|>"], boi_token_index=vocab["<|vision_start|>"],
        eoi_token_index=vocab["<|vision_end|>"]))
    tr = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=16, rope_double_precision=False, rope_type="split")
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=4, video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        rope_type="split")
    vae = AutoencoderKLLTX2Video(
        latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,), layers_per_block=(1,),
        decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,),
        upsample_factor=(1,), patch_size=1, patch_size_t=1, decoder_causal=False, scaling_factor=0.9)
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    audio_vae = AutoencoderKLLTX2Audio(base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1,
                                       in_channels=2, resolution=32, latent_channels=2, mel_bins=8)
    with torch.no_grad():  # latent statistics that are not the identity, so the (de)normalisation is exercised
        vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.0, 0.3]))
        vae.latents_std.copy_(torch.tensor([1.5, 2.0, 1.0, 0.8]))
        audio_vae.latents_mean.copy_(torch.tensor([0.2, 0.0, -0.1, 0.1]))
        audio_vae.latents_std.copy_(torch.tensor([1.2, 0.9, 1.1, 2.0]))
    vocoder = LTX2Vocoder(in_channels=16, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          output_sampling_rate=16000)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                            base_image_seq_len=256, max_image_seq_len=1024,
                                            time_shift_type="exponential")
    return _eval(LTX2Pipeline(scheduler=sched, vae=vae, audio_vae=audio_vae, text_encoder=text, tokenizer=tok,
                              connectors=connectors, transformer=tr, vocoder=vocoder))
