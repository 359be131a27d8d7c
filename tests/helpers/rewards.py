"""Rewards the tests use. Tiny, seeded reward models built and ``save_pretrained`` locally (nothing is
downloaded): a CLIP with its processor (the PickScore / CLIPScore / aesthetic / colour towers), an aesthetic MLP
head, and an OWL-ViT zero-shot detector with its processor. And reward callables named by dotted path
(``tests.helpers.rewards:<name>``) that misbehave as careless users' rewards do: hang, edit their inputs, raise
KeyboardInterrupt, return NaN or values beyond float32; and text rewards in TRL's convention."""
from __future__ import annotations

import os
import string
import threading
from pathlib import Path

import torch

SIDE = 32  # the tiny image towers' input side
HANG_MARK = "DIFFGRPO_TEST_HANG_MARK"


def clip_tokenizer(max_length: int = 16):
    """A character-level CLIP tokenizer built offline (every lowercase letter, digit and some punctuation), its
    start and end tokens last (OWL-ViT reads a query whose first id is 0 as padding)."""
    from transformers import CLIPTokenizer

    chars = list(string.ascii_lowercase + string.digits + ".,!?'-")
    vocab = {c + suffix: i for i, (suffix, c) in enumerate((s, c) for s in ("", "</w>") for c in chars)}
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def _text_config(tok) -> dict:
    bos, eos = tok.convert_tokens_to_ids(["<|startoftext|>", "<|endoftext|>"])
    return dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)


def save_tiny_clip(path: Path, seed: int = 0) -> Path:
    """A random CLIPModel (projection 16) and a CLIPProcessor (32 px crop) saved at ``path``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tok = clip_tokenizer()
    torch.manual_seed(seed)
    text = _text_config(tok)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=SIDE, patch_size=8)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(str(path))
    img = CLIPImageProcessor(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    CLIPProcessor(image_processor=img, tokenizer=tok).save_pretrained(str(path))
    return path


def aesthetic_state(dim: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random state dict with the LAION aesthetic MLP's names and shapes (input ``dim``)."""
    from diffgrpo.rewards.clip_models import AestheticHead

    torch.manual_seed(seed)
    return {k: v.clone() for k, v in AestheticHead(dim).state_dict().items()}


def save_tiny_owlvit(path: Path, seed: int = 0, v2: bool = False) -> Path:
    """A random OWL-ViT (``v2``: OWLv2) detector (32 px, 8 px patches: 16 boxes) and its processor saved at
    ``path``."""
    if v2:
        from transformers import Owlv2Config as OwlViTConfig
        from transformers import Owlv2ForObjectDetection as OwlViTForObjectDetection
        from transformers import Owlv2ImageProcessor as OwlViTImageProcessor
        from transformers import Owlv2Processor as OwlViTProcessor
    else:
        from transformers import (
            OwlViTConfig,
            OwlViTForObjectDetection,
            OwlViTImageProcessor,
            OwlViTProcessor,
        )

    tok = clip_tokenizer()
    torch.manual_seed(seed)
    text = _text_config(tok)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=SIDE, patch_size=8)
    OwlViTForObjectDetection(OwlViTConfig(text_config=text, vision_config=vision, projection_dim=16)
                             ).save_pretrained(str(path))
    img = (OwlViTImageProcessor(size={"height": SIDE, "width": SIDE}) if v2 else
           OwlViTImageProcessor(size={"height": SIDE, "width": SIDE}, crop_size={"height": SIDE, "width": SIDE}))
    OwlViTProcessor(image_processor=img, tokenizer=tok).save_pretrained(str(path))
    return path


# ------------------------------------------------------------------------------------------ reward callables
def brightness(images, prompts, metadata):
    return images.flatten(1).mean(1)


def constant(images, prompts, metadata):
    """A reward that ties every group: the policy gradient is zero."""
    return torch.zeros(len(prompts))


def hang(images, prompts, metadata):
    """A reward that never returns (after touching the file named by $DIFFGRPO_TEST_HANG_MARK, if set); with
    $DIFFGRPO_TEST_HANG_MARK set it scores the evaluations (main thread) and hangs in the background scorer only."""
    mark = os.environ.get(HANG_MARK)
    if mark and not threading.current_thread().name.startswith("diffgrpo-reward"):
        return images.flatten(1).mean(1)
    if mark:
        Path(mark).write_text("scoring")
    threading.Event().wait()


def zap(images, prompts, metadata):
    """A careless reward: edits its inputs in place."""
    images.mul_(0)
    for m in metadata:
        m["digit"] = -1
    return torch.zeros(len(prompts))


def interrupting(images, prompts, metadata):
    raise KeyboardInterrupt


def huge(images, prompts, metadata):
    return torch.full((len(prompts),), 1e39, dtype=torch.float64)


def nan_reward(images, prompts, metadata):
    return torch.full((len(prompts),), float("nan"))


def brevity(completions, **kwargs):
    """A TRL-style text reward: shorter completions score higher, in (0, 1]."""
    return [1.0 / (1 + len(c)) for c in completions]


def digits_only(completions, **kwargs):
    """A TRL-style text reward that applies to some samples only: None (not scored) for a completion without a
    digit, as TRL's rewards return for samples they do not judge."""
    return [None if not any(ch.isdigit() for ch in c) else float(c.strip().isdigit()) for c in completions]
