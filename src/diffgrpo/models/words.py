"""The built-in image models' text side: word-level tokens over a fixed vocabulary and a small prompt encoder.

Exact and cheap: a prompt is a handful of words; each prompt is encoded on its own, so an encoding never depends on
which prompts were encoded together (the policy caches encodings per prompt, and a resumed run, whose cache starts
empty, repeats the uninterrupted one bit for bit)."""
from __future__ import annotations

import torch
import torch.nn as nn


def tokenize(prompts: list[str], vocab: list[str], max_tokens: int) -> torch.Tensor:
    """Word-level ids (B, max_tokens): <bos> then words; unknown words map to <unk>; padded with <pad> (id 0)."""
    idx = {w: i for i, w in enumerate(vocab)}
    out = torch.zeros(len(prompts), max_tokens, dtype=torch.long)
    for b, p in enumerate(prompts):
        words = p.lower().replace(",", " ").replace(".", " ").split()[: max_tokens - 1]
        ids = [idx["<bos>"]] + [idx.get(w, idx["<unk>"]) for w in words]
        out[b, : len(ids)] = torch.tensor(ids)
    return out


class WordPromptEncoder(nn.Module):
    """Tokens (B, L) → sequence embeddings (B, L, D) and pooled embedding (B, D), over ``vocab`` (``vocab[0]`` the
    padding word) and at most ``max_tokens`` tokens."""

    def __init__(self, dim: int, vocab: list[str], max_tokens: int):
        super().__init__()
        self.vocab, self.max_tokens = list(vocab), max_tokens
        self.tok = nn.Embedding(len(vocab), dim)
        self.pos = nn.Parameter(torch.zeros(max_tokens, dim))
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.pool = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tok(tokens) + self.pos  # (B, L, D)
        h = h + self.mix(h)
        m = (tokens != 0).float().unsqueeze(-1)  # (B, L, 1)
        pooled = self.pool((h * m).sum(1) / m.sum(1).clamp(min=1))  # (B, D)
        return h, pooled

    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        return tokenize(prompts, self.vocab, self.max_tokens)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Prompts → {"prompt_embeds": (B, L, D), "pooled": (B, D)} on this encoder's device (no grad), each prompt
        encoded on its own (see the module docstring)."""
        rows = [self(t[None]) for t in self.tokenize(prompts).to(self.pos.device)]
        return {"prompt_embeds": torch.cat([e for e, _ in rows]), "pooled": torch.cat([p for _, p in rows])}


__all__ = ["WordPromptEncoder", "tokenize"]
