"""Tiny models and the override lists the tests build them from: the built-in flow model (``TINY`` in-process,
``TINY_CLI`` on the command line), a tiny masked LM trainer, and two enumerable masked LMs whose exact
conditionals the likelihood tests compare against."""
from __future__ import annotations

import math

import torch

# A model small enough for unit tests: 8×8 images, one transformer block, 6 sampling steps.
TINY = [
    "train.task=digits", "model.image_size=8", "model.patch_size=2", "model.num_layers=1", "model.num_heads=2",
    "model.head_dim=8",
    "model.text_dim=16", "sampler.num_steps=6", "train.prompts_per_batch=2", "train.group_size=3",
    "log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
]

# The built-in model at its smallest through ``diffgrpo train``: a 20-step pretraining, 4 sampling steps, EMA 0.5.
TINY_CLI = ["train.task=digits", "model.image_size=8", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8",
            "model.text_dim=16",
            "pretrain.steps=20", "pretrain.batch_size=16", "sampler.num_steps=4", "train.prompts_per_batch=2",
            "train.group_size=2", "eval.seeds_per_prompt=1", "eval.every=2", "log.progress=false",
            "reward.weights={jpeg_incompressibility: 1.0}", "train.lr=1e-3", "train.ema_decay=0.5"]
FAST_CLI = [*TINY_CLI, "train.ema_decay=0.0"]  # without the EMA copy

# The tiny diffusers pipelines through the trainer: three sampling steps, two prompts of two samples.
QUIET = ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
         "sampler.num_steps=3", "train.prompts_per_batch=2", "train.group_size=2"]

TINY_DLLM = ["model.name=tiny_mlm", "train.prompts_per_batch=2", "train.group_size=4", "log.progress=false",
             "log.save_images=false", "dllm.eval_size=8", "dllm.clip_range=0.2"]


def make_dllm_trainer(*overrides, seed=0, layers=1, base=TINY_DLLM, **bert):
    """A Trainer on a random BERT masked LM of ``layers`` layers (``bert``: more of ``tiny_bert``'s settings, e.g.
    ``initializer_range``) over the built-in task vocabulary, configured by ``base`` and ``overrides``."""
    from diffgrpo import RunConfig, Trainer
    from diffgrpo.models.hf_masked_lm import MaskedLMPolicy, tiny_bert
    from diffgrpo.tasks import VOCAB, get_task

    cfg = RunConfig.from_overrides([*base, f"seed={seed}", *overrides])
    torch.manual_seed(seed)
    task = get_task(cfg.dllm.task)
    net = tiny_bert(len(VOCAB), max_positions=task.prompt_length + task.gen_length, hidden_size=32,
                    num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64, **bert)
    policy = MaskedLMPolicy(net, vocab=VOCAB, keep_reference=cfg.loss.beta > 0)
    return Trainer(cfg, policy=policy, log=lambda *a: None)


# The decoding tests' masked LM: countdown in blocks of 4, a two-layer BERT with a wide initialisation (confident,
# varied decodes)
DECODE_DLLM = ["model.name=tiny_mlm", "train.prompts_per_batch=2", "train.group_size=4", "log.progress=false",
               "log.save_images=false", "dllm.eval_size=8", "dllm.task=countdown", "dllm.block_length=4"]


def decoding_dllm_trainer(*overrides, seed=0):
    return make_dllm_trainer(*overrides, seed=seed, layers=2, base=DECODE_DLLM, initializer_range=0.3)


class EnumerableMLM(torch.nn.Module):
    """A bidirectional model over V content tokens + <mask> (id V) small enough to enumerate: the logits of
    every position depend on the whole (flattened one-hot) sequence through a random MLP."""

    def __init__(self, V=3, N=4, hidden=32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.V, self.N = V, N
        self.w1 = torch.randn(N * (V + 1), hidden, generator=g)
        self.w2 = torch.randn(hidden, N * V, generator=g) * 0.7

    def forward(self, ids):  # (B, N) → (B, N, V+1); the mask token is never predicted
        x = torch.nn.functional.one_hot(ids, self.V + 1).float().flatten(1)
        out = torch.tanh(x @ self.w1) @ self.w2
        logits = out.view(-1, self.N, self.V)
        return torch.cat([logits, torch.full_like(logits[..., :1], -1e9)], -1)


class JointMLM(torch.nn.Module):
    """Exact conditionals of an enumerable joint p_θ(x) ∝ exp E_θ(x) over V^N (Potts + MLP energy): position j
    of a row with visible set U gets logits log Σ_{x: x_U fixed, x_j = v} exp E_θ(x). <mask> = id V."""

    def __init__(self, V=3, N=6, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.V, self.N = V, N
        self.h = torch.nn.Parameter(torch.randn(N, V, generator=g) * 0.5)
        self.J = torch.nn.Parameter(torch.randn(N, N, V, V, generator=g) / math.sqrt(N))
        self.w1 = torch.nn.Parameter(torch.randn(N * V, 16, generator=g) * 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(16, generator=g) * 0.5)
        self.register_buffer("X", torch.cartesian_prod(*[torch.arange(V)] * N).view(-1, N))

    def energy(self, X):
        oh = torch.nn.functional.one_hot(X, self.V).float()  # (S, N, V)
        J = torch.triu(self.J.permute(2, 3, 0, 1), 1).permute(2, 3, 0, 1)  # pairs i < j
        return (oh * self.h).sum((1, 2)) + torch.einsum("sia,ijab,sjb->s", oh, J, oh) + \
            torch.tanh(oh.flatten(1) @ self.w1) @ self.w2

    def log_prob(self, x):
        return self.energy(x) - torch.logsumexp(self.energy(self.X), 0)

    def forward(self, ids):  # (B, N) → (B, N, V+1)
        E = self.energy(self.X)
        pe = torch.exp(E - E.max())
        visible = ids != self.V
        compat = ((self.X.unsqueeze(0) == ids.unsqueeze(1)) | ~visible.unsqueeze(1)).all(-1).float()  # (B, S)
        oh = torch.nn.functional.one_hot(self.X, self.V).float()
        logits = torch.log((compat @ (pe.unsqueeze(1) * oh.flatten(1))).clamp_min(1e-30)).view(-1, self.N, self.V)
        return torch.cat([logits, torch.full_like(logits[..., :1], -1e9)], -1)
