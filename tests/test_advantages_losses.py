"""Advantages, the clipped surrogate and the single aggregation function."""
import pytest
import torch

from diffgrpo.advantages import group_advantages
from diffgrpo.engines import select_steps
from diffgrpo.losses import aggregate, aggregation_weights, ppo_clip_loss


def test_group_advantages_match_definition():
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 12.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, st = group_advantages(r, gid, std_mode="group")
    for g in (0, 1):
        m = gid == g
        want = (r[m] - r[m].mean()) / (r[m].std() + 1e-4)
        torch.testing.assert_close(adv[m], want)
    adv_g, _ = group_advantages(r, gid, std_mode="global")
    want = torch.cat([(r[gid == g] - r[gid == g].mean()) for g in (0, 1)]) / (r.std() + 1e-4)
    torch.testing.assert_close(adv_g, want)
    adv_n, _ = group_advantages(r, gid, std_mode="none")
    torch.testing.assert_close(adv_n, torch.cat([(r[gid == g] - r[gid == g].mean()) for g in (0, 1)]))
    assert st["frac_reward_zero_std"] == 0.0


def test_leave_one_out_baseline():
    r = torch.tensor([1.0, 2.0, 6.0])
    adv, _ = group_advantages(r, torch.zeros(3, dtype=torch.long), std_mode="none", baseline="leave_one_out")
    torch.testing.assert_close(adv, torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5]))


def test_zero_std_groups_clip_and_invalid_rewards():
    r = torch.tensor([5.0, 5.0, 5.0, 0.0, 0.0, 100.0, float("nan"), 1.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    adv, st = group_advantages(r, gid, std_mode="global", clip=1.0)
    assert torch.all(adv[:3] == 0)  # identical rewards → no signal
    assert adv.abs().max() <= 1.0 and st["adv_clip_frac"] > 0
    assert adv[6] == 0 and adv[7] == 0  # NaN excluded; its group has one valid sample left
    assert st["num_invalid"] == 1
    assert st["frac_reward_zero_std"] == pytest.approx(2 / 3)  # group 0 (equal) and group 2 (one valid)
    # the NaN never leaks into the statistics: same result as if that sample did not exist
    keep = torch.tensor([0, 1, 2, 3, 4, 5, 7])
    adv2, _ = group_advantages(r[keep], gid[keep], std_mode="global", clip=1.0)
    torch.testing.assert_close(adv[keep], adv2)


def test_ppo_clip_loss_values_and_clip_flags():
    lp_old = torch.zeros(4)
    lp = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.05]))
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0])
    loss, ratio, clipped = ppo_clip_loss(lp, lp_old, adv, clip_range=0.2)
    torch.testing.assert_close(ratio, torch.tensor([1.0, 1.5, 0.5, 1.05]))
    # A>0, r>1+ε → clipped at 1.2; A<0, r<1−ε → clipped at 0.8; inside the range → −A·r
    torch.testing.assert_close(loss, torch.tensor([-1.0, -1.2, 0.8, 2.1]))
    assert clipped.tolist() == [False, True, True, False]


def test_surrogate_gradient_at_ratio_one_is_minus_advantage_times_score():
    lp = torch.tensor([0.3, -0.2], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss, _, _ = ppo_clip_loss(lp, lp.detach(), adv, clip_range=1e-4)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(g, -adv)


def test_aggregation_weights_modes():
    sel = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    w = aggregation_weights(sel, "mean")
    torch.testing.assert_close(w, sel.float() / 3)
    w = aggregation_weights(sel, "sample_mean")
    torch.testing.assert_close(w, torch.tensor([[0.25, 0.25, 0], [0.5, 0, 0]]))
    w = aggregation_weights(sel, "sum", sample_weights=torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0, 0], [3.0, 0, 0]]))
    assert float(aggregate(torch.ones(2, 3), aggregation_weights(sel, "mean"))) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregation_weights(sel, "median")


def test_step_selection_modes():
    g = torch.Generator().manual_seed(0)
    T = 10
    assert select_steps("all", T, 3)[:, :9].all() and not select_steps("all", T, 3)[:, 9].any()
    ff = select_steps("first_fraction", T, 2, fraction=0.5)
    assert ff.sum(1).tolist() == [5, 5] and ff[:, :5].all()
    rnd = select_steps("random", T, 50, fraction=0.3, generator=g)
    assert rnd.sum(1).eq(3).all() and not rnd[:, 9].any()
    assert len({tuple(r.nonzero().flatten().tolist()) for r in rnd}) > 1  # per-sample subsets differ
    win = select_steps("window", T, 20, window_size=3, generator=g)
    for row in win:
        idx = row.nonzero().flatten()
        assert len(idx) == 3 and (idx[-1] - idx[0]) == 2 and idx[-1] <= 8
    fixed = select_steps("window", T, 2, window_size=3, window_start=2)
    assert fixed[:, 2:5].all() and fixed.sum() == 6
    with pytest.raises(ValueError):
        select_steps("window", T, 2, window_size=3, window_start=8)


# ------------------------------------------------- issue 25, fidelity notes: population std, wd1 and SPG normalisation
@pytest.mark.parametrize("std_mode", ["group", "global"])
def test_population_std_advantages_match_numpy_convention(std_mode):
    from diffgrpo import RunConfig
    from diffgrpo.advantages import group_advantages

    g = torch.Generator().manual_seed(0)
    r, gid = torch.randn(12, generator=g), torch.arange(3).repeat_interleave(4)
    kw = {"std_mode": std_mode, "eps": 0.0, "clip": 1e9}
    pop, _ = group_advantages(r, gid, std="population", **kw)
    unb, _ = group_advantages(r, gid, **kw)
    groups = [r[gid == k] for k in range(3)]
    if std_mode == "group":
        ref = torch.cat([(x - x.mean()) / x.std(correction=0) for x in groups])
    else:
        ref = torch.cat([x - x.mean() for x in groups]) / r.std(correction=0)
    torch.testing.assert_close(pop, ref)
    torch.testing.assert_close(pop, unb * (12 / 11 if std_mode == "global" else 4 / 3) ** 0.5)
    assert RunConfig.from_overrides(["advantage.std=population"]).advantage.std == "population"


def test_wd1_token_mean_against_the_released_normalisation_is_tokens_per_group():
    """The released trainer: per micro-batch (one group) Σ_i c_i Σ_j ℓ_ij, averaged over the groups; ours: the token
    mean. Their ratio is the completion tokens per group (the wd1 docstring's statement)."""
    from diffgrpo.dllm.wd1 import wd1_coefficients, wd1_token_loss
    from diffgrpo.losses import aggregation_weights

    g = torch.Generator().manual_seed(0)
    G, n, L = 3, 6, 12
    gid = torch.arange(G).repeat_interleave(n)
    lengths = torch.randint(3, L + 1, (G * n,), generator=g)
    mask = torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)  # (B, L) completion tokens
    lp = -torch.rand(G * n, L, generator=g)
    coef = wd1_coefficients(torch.rand(G * n, generator=g), gid)
    per_token = wd1_token_loss(lp, coef) * mask
    ours = (aggregation_weights(mask, "mean") * per_token).sum()
    released = torch.stack([per_token[gid == k].sum() for k in range(G)]).mean()
    torch.testing.assert_close(released / ours, mask.sum().float() / G)
    assert abs(float(mask.sum()) / G - float(lengths.float().mean())) > 1  # not the mean completion length


def test_spg_batch_token_mean_against_the_released_per_group_normalisation():
    from diffgrpo.losses import aggregation_weights

    g = torch.Generator().manual_seed(1)
    G, n, L = 3, 4, 10
    gid = torch.arange(G).repeat_interleave(n)
    lengths = torch.randint(2, L + 1, (G * n,), generator=g)
    mask = torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)
    terms = torch.randn(G * n, L, generator=g) * mask  # −A_i·ℓ_ij
    T_g = torch.stack([mask[gid == k].sum() for k in range(G)]).float()
    per_group_ours = torch.stack([(aggregation_weights(mask, "mean") * terms)[gid == k].sum() for k in range(G)])
    per_group_released = torch.stack([terms[gid == k].sum() / T_g[k] for k in range(G)]) / G
    torch.testing.assert_close(per_group_ours / per_group_released, G * T_g / T_g.sum())
