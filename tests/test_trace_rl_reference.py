"""``dllm.method=trace_rl`` against the released TraceRL code (Gen-Verse/dLLM-RL, commit
10b4fd1cba83e4496c20585dc2fd01dc02f20255, ``train/rl_sdar.py``: ``collapse_k_unique``, ``one_round_vectorized`` and
``forward_process``; ``train/train_sdar_policy.py`` has the same ``forward_process``). Those are closures inside
``main()`` of a script that imports accelerate, wandb and the model at load time, so nothing there is importable:
the released formulas are re-derived below from that reading.

Released data: every trajectory yields one row per round; round r scores, in every block, the tokens of the block's
r-th distinct decoding step (k distinct steps collapsed into one with ``shrink`` k), with the block's tokens of that
step and later masked and every earlier block clean (block-causal attention). Released loss on one micro-batch of R
rows over a completion of L1 tokens, Δ = clamp(ℓ − ℓ_old, −10, 10) on scored tokens:

    loss = −(1 / R) Σ_rows (1 / L1) Σ_t p_mask · min(e^Δ·A, clip(e^Δ, 1−ε, 1+ε)·A)
"""
from __future__ import annotations

import torch

from diffgrpo.dllm.grpo import grpo_token_loss
from diffgrpo.dllm.trace_rl import trace_masks
from diffgrpo.losses import aggregate, aggregation_weights

EPS = 0.2


# ---------------------------------------------------------------------- re-derivation of the released code
def released_collapse(steps: list[int], k: int) -> list[int]:
    """``collapse_k_unique``: the sorted distinct values in runs of k, each mapped to its run's last value."""
    uniq = sorted(set(steps))
    rep = {v: uniq[min((i // k + 1) * k - 1, len(uniq) - 1)] for i, v in enumerate(uniq)}
    return [rep[s] for s in steps]


def released_rounds(step_map: torch.Tensor, block: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``one_round_vectorized`` until empty, after the per-block collapse. step_map (L1,) → [(scored (L1,) bool,
    masked (L1,) bool)] per round: in each block the minimum remaining step is scored, steps >= it masked."""
    L1 = step_map.shape[0]
    s = step_map.clone()
    for j in range(0, L1, block):
        s[j:j + block] = torch.tensor(released_collapse(s[j:j + block].tolist(), k))
    out = []
    while True:
        scored, masked = torch.zeros(L1, dtype=torch.bool), torch.zeros(L1, dtype=torch.bool)
        for j in range(0, L1, block):
            blk = s[j:j + block]
            if (blk >= 0).any():
                m = blk[blk >= 0].min()
                scored[j:j + block] = blk == m
                masked[j:j + block] = blk >= m
        if not scored.any():
            return out
        out.append((scored, masked))
        s = torch.where(scored, torch.full_like(s, -1), s)


def released_loss(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, p_mask: torch.Tensor,
                  beta: float = 0.0) -> torch.Tensor:
    """``forward_process`` (``use_kl_estimator_k3``): lp, old, p_mask (R, L1), adv (R,) → scalar."""
    R, L1 = p_mask.shape
    d = torch.where(p_mask, lp - old, torch.zeros_like(lp)).clamp(-10.0, 10.0)
    ratio = torch.exp(d)  # (R, L1)
    a = adv.unsqueeze(1)
    sur = torch.min(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a) * p_mask
    kl = torch.where(p_mask, lp - old, torch.zeros_like(lp))
    kl = ((-kl).clamp(-10.0, 10.0).exp() - 1.0 + kl) * p_mask  # k3 against ℓ_old
    return -(sur.sum(1) / L1).sum() / R + beta * (kl.sum(1) / L1).sum() / R


# ---------------------------------------------------------------------- a tiny block trajectory
BLOCK, L1 = 4, 8


def global_steps(per_block: list[list[int]]) -> torch.Tensor:
    """Local decoding steps of each block (B, blocks, BLOCK) → the sampler's global ``commit_step`` (B, L1): the
    blocks are decoded in order, each after the previous one finished."""
    rows = []
    for blocks in per_block:
        off, row = 0, []
        for blk in blocks:
            row += [off + s for s in blk]
            off += max(blk) + 1
        rows.append(row)
    return torch.tensor(rows)


# two trajectories; block steps: 4, 2 (two tokens at once), 2 and 4 distinct steps
LOCAL = [[[0, 2, 1, 3], [1, 0, 1, 0]], [[1, 0, 0, 1], [3, 1, 0, 2]]]


def contexts_project(commit: torch.Tensor, k: int) -> dict:
    """(row, token) → (masked positions of its own block, whether any earlier block had a masked token)."""
    masks, scored = trace_masks(commit, 0, k)  # (B, G, L1), (B, G, L1)
    out = {}
    for b, g, j in scored.nonzero().tolist():
        lo = j // BLOCK * BLOCK
        own = frozenset(i for i in range(lo, lo + BLOCK) if masks[b, g, i])
        out[b, j] = (own, bool(masks[b, g, :lo].any()))
    return out


def contexts_released(commit: torch.Tensor, k: int) -> dict:
    out = {}
    for b in range(commit.shape[0]):
        for scored, masked in released_rounds(commit[b], BLOCK, k):
            for j in scored.nonzero().flatten().tolist():
                lo = j // BLOCK * BLOCK
                out[b, j] = (frozenset(i for i in range(lo, lo + BLOCK) if masked[i]), False)
    return out


def test_each_token_is_scored_in_the_released_context():
    """k = 1, and k = 2 where every block takes an even number of steps: every token is scored once, with the same
    masked tokens of its block and a clean prefix, so ℓ per token is the same forward on a block-causal model."""
    commit = global_steps(LOCAL)
    ours, ref = contexts_project(commit, 1), contexts_released(commit, 1)
    assert len(ours) == commit.numel() and ours == ref
    even = global_steps([[[0, 1, 2, 3], [1, 0, 1, 0]], [[3, 2, 1, 0], [0, 1, 1, 0]]])
    assert contexts_project(even, 2) == contexts_released(even, 2)


def test_shrink_groups_differ_when_a_block_takes_an_odd_number_of_steps():
    """Stated difference: k > 1 groups k consecutive global steps; the released code k distinct steps of each
    block. Trajectory 0's first block takes 4 steps, its second 2; trajectory 1's first 2, its second 4 — with k = 3
    the groups cross block boundaries here and not there."""
    commit = global_steps(LOCAL)
    ours, ref = contexts_project(commit, 3), contexts_released(commit, 3)
    assert ours.keys() == ref.keys()  # every token scored once either way
    diff = [key for key in ours if ours[key] != ref[key]]
    assert diff and all(key[1] >= BLOCK or key[0] == 0 for key in diff)


def rollout(seed: int = 0):
    commit = global_steps(LOCAL)
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(2, L1, generator=g, dtype=torch.float64) * 3).requires_grad_(True)  # (B, L1) ℓ_θ per token
    old = lp.detach() + 0.3 * torch.randn(2, L1, generator=g, dtype=torch.float64)  # ratios inside and outside 1±ε
    reward = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)  # a group of 4; the test keeps rows 0, 1
    adv = ((reward - reward.mean()) / reward.std(unbiased=False))[:2]  # released: population std
    return commit, lp, old, adv


def released_on(commit, lp, old, adv, beta=0.0):
    """The released rows of the rollout (one per round) and its loss on them, all rows in one micro-batch."""
    rows = [(b, s) for b in range(commit.shape[0]) for s, _ in released_rounds(commit[b], BLOCK, 1)]
    idx = torch.tensor([b for b, _ in rows])
    p_mask = torch.stack([s for _, s in rows])  # (R, L1)
    return released_loss(lp[idx], old[idx], adv[idx], p_mask, beta), len(rows)


def test_loss_and_gradient_match_the_released_up_to_its_normalisation():
    """Per-token surrogate identical; the released divides by R·L1 (R rows = rounds in the micro-batch), here
    ``loss.aggregation``: ``sum`` / (R·L1) reproduces it, ``mean`` (1 / tokens) is it times R·L1 / tokens."""
    commit, lp, old, adv = rollout()
    ref, R = released_on(commit, lp, old, adv)
    g_ref, = torch.autograd.grad(ref, lp)
    tok, terms = grpo_token_loss(lp, old, adv, EPS)  # (B, L1)
    assert terms["clipped"].any() and not terms["clipped"].all()
    sel = commit >= 0
    ours_sum = aggregate(tok, aggregation_weights(sel, "sum")) / (R * L1)
    g_sum, = torch.autograd.grad(ours_sum, lp, retain_graph=True)
    dl, dg = (ours_sum - ref).abs().item(), (g_sum - g_ref).abs().max().item()
    assert dl < 1e-12 and dg < 1e-12, (dl, dg)
    ours_mean = aggregate(tok, aggregation_weights(sel, "mean"))
    g_mean, = torch.autograd.grad(ours_mean, lp)
    scale = R * L1 / sel.sum().item()  # the stated difference: normalisation
    assert scale != 1.0
    torch.testing.assert_close(ours_mean, ref * scale, rtol=1e-12, atol=0)
    torch.testing.assert_close(g_mean, g_ref * scale, rtol=1e-12, atol=0)


def test_released_clamps_the_log_ratio_at_ten():
    """A difference the released code has and this objective not: Δ clamped to ±10 before exp. With A < 0 and
    Δ = 12 the unclipped branch wins; the released term is e^10·|A| with zero gradient, here e^12·|A|."""
    commit, lp, old, adv = rollout()
    old = old.clone()
    old[1, 0] = lp[1, 0].detach() - 12.0  # trajectory 1 has A < 0
    assert adv[1] < 0
    ref, R = released_on(commit, lp, old, adv)
    g_ref, = torch.autograd.grad(ref, lp)
    tok, _ = grpo_token_loss(lp, old, adv, EPS)
    ours = aggregate(tok, aggregation_weights(commit >= 0, "sum")) / (R * L1)
    g, = torch.autograd.grad(ours, lp)
    e = torch.exp(torch.tensor([12.0, 10.0], dtype=torch.float64))
    gap = -adv[1] * (e[0] - e[1]) / (R * L1)
    torch.testing.assert_close(ours - ref, gap.detach(), rtol=1e-9, atol=0)
    assert g_ref[1, 0] == 0 and g[1, 0] != 0
    keep = torch.ones_like(g, dtype=torch.bool)
    keep[1, 0] = False
    torch.testing.assert_close(g[keep], g_ref[keep], rtol=1e-12, atol=1e-15)


def test_kl_term_is_k3_against_the_rollout_weights_there_the_reference_here():
    """Same k3 estimator and normalisation; the released code takes it against ℓ_old, this objective against the
    reference: given ℓ_old as the reference the losses agree, given another reference they differ."""
    commit, lp, old, adv = rollout()
    ref, R = released_on(commit, lp, old, adv, beta=0.01)
    g_ref, = torch.autograd.grad(ref, lp)
    sel = commit >= 0
    for ref_lp, agree in ((old, True), (old - 0.5, False)):
        tok, _ = grpo_token_loss(lp, old, adv, EPS, ref_log_prob=ref_lp, beta=0.01)
        ours = aggregate(tok, aggregation_weights(sel, "sum")) / (R * L1)
        g, = torch.autograd.grad(ours, lp)
        assert torch.allclose(ours, ref, rtol=1e-12, atol=0) == agree
        assert torch.allclose(g, g_ref, rtol=1e-12, atol=1e-15) == agree
