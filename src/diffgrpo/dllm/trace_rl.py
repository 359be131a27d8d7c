"""TraceRL (``dllm.method=trace_rl``): the policy gradient over the sampler's own decoding steps.

A rollout records for every completion token the global step that committed it (``commit_step``). Decoding step s
saw the state x_s: the prompt, the tokens committed at steps < s, and <mask> everywhere else; it committed the
tokens of step s from softmax(logits(x_s) / T). The trajectory's log-likelihood is therefore

    log π(τ) = Σ_s Σ_{j: step(j) = s} log p_θ(y_j | x_s)

and TraceRL's objective is the PPO-clipped, group-normalised (A = (r − mean) / std) policy gradient on those
per-token terms, with ℓ_old the same terms under the rollout's weights (with an exact sampler they equal the
recorded step log-probs: the first update's ratio is 1). Here each decoding step (each ``dllm.trace_shrink``
consecutive steps) is one masked forward (:func:`trace_masks`): forward g masks every completion token committed
at step >= g·k (and any never committed) and scores those committed in [g·k, (g+1)·k). k = 1 is exact; k > 1 scores
the later steps of a group with fewer tokens visible than the sampler had (TraceRL's "shrink"). On a block-causal
model the forwards run block by block with the clean prefix (:mod:`.block_likelihood`), which is the sampler's own
context; on a bidirectional masked LM the full masked sequence is the sampler's state without a cache (with
``dllm.kv_cache`` prefix or dual the sampler saw approximate logits instead).

Differences from the released code (Gen-Verse/dLLM-RL): its value model (a second network scoring the trajectory's
states for per-step advantages, optional there) is ``dllm.trace_value=on`` (:mod:`.trace_critic`, :mod:`.trace_value`);
off, the advantage is the sequence's group-normalised reward for every step; it divides each micro-batch's summed token terms by (rows · L), one row per round of
decoding steps, here ``loss.aggregation`` (``sum`` / (rows · L) reproduces it); it clamps ℓ − ℓ_old to ±10 before
the ratio; its β term is k3 against ℓ_old, here against the reference; with k > 1 it groups k distinct steps of each
block, here k consecutive global steps (the same when every block takes a multiple of k steps).
``tests/test_trace_rl_reference.py`` checks these against a re-derivation of its ``train/rl_sdar.py``.
Cost: ⌈S / k⌉ forwards per completion for S decoding steps (on a block model each forward covers one block).
"""
from __future__ import annotations

import torch


def trace_masks(commit_step: torch.Tensor, P: int, shrink: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """commit_step (B, L) long (−1 = never committed) → masks (B, G, P+L) bool, weights (B, G, L) float,
    G = ⌈(max step + 1) / shrink⌉: forward g masks tokens of step >= g·shrink (and the uncommitted), scores steps
    [g·shrink, (g+1)·shrink)."""
    B, L = commit_step.shape
    dev = commit_step.device
    G = max(1, -(-(int(commit_step.max()) + 1) // shrink))
    g0 = (torch.arange(G, device=dev) * shrink).view(1, G, 1)  # (1, G, 1)
    cs = commit_step.unsqueeze(1)  # (B, 1, L)
    comp = (cs >= g0) | (cs < 0)  # (B, G, L)
    scored = (cs >= g0) & (cs < g0 + shrink)  # (B, G, L)
    masks = torch.cat([torch.zeros(B, G, P, dtype=torch.bool, device=dev), comp], -1)
    return masks, scored.float()


def forwards_per_completion(steps: int, shrink: int) -> int:
    """Masked forwards per completion of ``steps`` decoding steps scored ``shrink`` at a time."""
    return -(-steps // shrink)


__all__ = ["forwards_per_completion", "trace_masks"]
