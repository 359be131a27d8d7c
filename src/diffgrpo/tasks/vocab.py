"""The built-in character vocabulary of the dLLM tasks: characters plus <pad>, <mask>, <eos> and the two tag
tokens <answer>, </answer> (kept whole so that completions stay short)."""
from __future__ import annotations

import re

import torch

# ---------------------------------------------------------------------------------------------- vocabulary
SPECIALS = ["<pad>", "<mask>", "<eos>", "<answer>", "</answer>"]
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz+-*/=()[]{}<>:,.\"' _|?")


class CharVocab:
    """Character vocabulary shared by every task. ``encode`` matches special tokens greedily first."""

    def __init__(self):
        self.tokens = SPECIALS + CHARS
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.mask_id, self.eos_id = self.index["<pad>"], self.index["<mask>"], self.index["<eos>"]
        self._special_re = re.compile("|".join(re.escape(s) for s in SPECIALS))

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        """Text → ids; specials first, then characters; unknown characters raise ValueError."""
        out, pos = [], 0
        for m in self._special_re.finditer(text):
            out += [self._char(c) for c in text[pos:m.start()]]
            out.append(self.index[m.group(0)])
            pos = m.end()
        return out + [self._char(c) for c in text[pos:]]

    def _char(self, c: str) -> int:
        if c not in self.index:
            raise ValueError(f"character {c!r} is not in the vocabulary")
        return self.index[c]

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        """Ids → text; stops at the first <eos> (else drops it); <pad> is dropped; <mask> stays "<mask>"."""
        out = []
        for i in (ids.tolist() if torch.is_tensor(ids) else ids):
            if i == self.eos_id and stop_at_eos:
                break
            if i == self.pad_id or i == self.eos_id:
                continue
            out.append(self.tokens[i])
        return "".join(out)

    def encode_prompts(self, prompts: list[str], length: int) -> torch.Tensor:
        """Left-padded prompt ids (B, length) long."""
        out = torch.full((len(prompts), length), self.pad_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids = self.encode(p)
            if len(ids) > length:
                raise ValueError(f"prompt {p!r} has {len(ids)} tokens > prompt_length {length}")
            if ids:
                out[b, length - len(ids):] = torch.tensor(ids)
        return out

    def encode_completions(self, completions: list[str], length: int) -> torch.Tensor:
        """Completion ids (B, length) long, <eos>-padded (truncated if longer)."""
        return pad_right([self.encode(c) for c in completions], length, self.eos_id)


def pad_right(seqs: list[list[int]], length: int, fill: int) -> torch.Tensor:
    """Token lists → (B, length) long, each truncated to ``length`` and padded with ``fill`` on the right."""
    out = torch.full((len(seqs), length), fill, dtype=torch.long)
    for b, ids in enumerate(seqs):
        ids = ids[:length]
        if ids:
            out[b, : len(ids)] = torch.tensor(ids)
    return out


VOCAB = CharVocab()
