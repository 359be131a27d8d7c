"""The newer dLLM estimators: DiffuCoder's released coupled form, SPG (sandwiched bounds, block masks) and wd1
(weighted likelihood), against the exact likelihood of enumerable models and hand-computed losses on tiny ones."""
from __future__ import annotations

import math

import pytest
import torch

from diffgrpo import ConfigError, RunConfig
from diffgrpo.consistency import replay_steps
from diffgrpo.dllm import likelihood, spg, wd1
from diffgrpo.dllm.grpo import METHODS, forwards_per_estimate
from diffgrpo.samplers import masked
from tests.helpers.tiny import EnumerableMLM, JointMLM, make_dllm_trainer

MASK = 3  # <mask> id of the V = 3 enumerable models


def corr(a, b):
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


# ---------------------------------------------------------------------------------------------- masks
def test_coupled_released_masks_weights_and_hand_computed_log_probs():
    g = torch.Generator().manual_seed(0)
    B, P, L = 256, 3, 9
    m, w = likelihood.coupled_released(B, P, L, generator=g)
    assert m.shape == (B, 3, P + L) and w.shape == (B, 3, L) and not m[..., :P].any()
    assert m[:, 0, P:].all() and torch.equal(m[:, 1, P:], ~m[:, 2, P:])  # full mask + complementary pair
    assert torch.allclose(w[:, 0], torch.full((B, L), 0.5))
    t1 = torch.where(m[:, 1, P:], 0.5 / w[:, 1].clamp_min(1e-9), 1 - 0.5 / w[:, 2].clamp_min(1e-9))  # (B, L)
    assert torch.allclose(t1, t1[:, :1].expand(B, L), atol=1e-5)  # one ratio per row
    assert t1.min() >= 0.2 - 1e-6 and t1.max() <= 0.8 + 1e-6
    # ℓ_j = ½ [log p(y_j | all masked) + m_j log p(y_j | x^(1)) / t + (1 − m_j) log p(y_j | x^(2)) / (1 − t)]
    model = EnumerableMLM(V=3, N=7, seed=2)
    ids = torch.randint(0, 3, (4, 7), generator=g)
    m, w = likelihood.coupled_released(4, 3, 4, generator=g)
    got = likelihood.token_log_probs(model, ids, m, w, mask_id=3)

    def lp(b, mask, j):
        x = torch.where(mask, torch.full_like(ids[b], 3), ids[b])
        return float(torch.log_softmax(model(x[None])[0, 3 + j, :3], -1)[ids[b, 3 + j]])

    for b in range(4):
        tb = float(0.5 / w[b, 1][m[b, 1, 3:]].max()) if m[b, 1, 3:].any() else float(1 - 0.5 / w[b, 2].max())
        for j in range(4):
            pair = lp(b, m[b, 1], j) / tb if m[b, 1, 3 + j] else lp(b, m[b, 2], j) / (1 - tb)
            assert float(got[b, j]) == pytest.approx(0.5 * (lp(b, m[b, 0], j) + pair), abs=1e-4)


def test_spg_block_masks_follow_the_block_rules():
    g = torch.Generator().manual_seed(1)
    B, P, L, bl, M = 64, 2, 12, 4, 3
    n = torch.randint(1, L + 1, (B,), generator=g)
    valid = torch.arange(L).expand(B, L) < n.unsqueeze(1)
    masks = spg.block_masks(valid, P, block_length=bl, num_t=M, t_min=0.25, t_max=0.75, p_mask_prompt=0.0,
                            generator=g)
    assert masks.shape == (B, M, P + L) and not masks[..., :P].any()
    comp = masks[..., P:]
    for b in range(B):
        nb_valid = (int(n[b]) - 1) // bl + 1
        blocks = []
        for m in range(M):
            row = comp[b, m]
            k = int(torch.nonzero(row)[0]) // bl  # first masked position lies in the chosen block
            blocks.append(k)
            assert k < nb_valid
            assert not row[:k * bl].any() and row[(k + 1) * bl:].all()  # earlier blocks visible, later masked
            ml = min(bl, int(n[b]) - k * bl)
            c = int(row[k * bl:k * bl + ml].sum())
            assert max(int(ml * 0.25), 1) <= c <= max(min(int(ml * 0.75), ml), max(int(ml * 0.25), 1))
            assert row[k * bl + ml:].all()  # the tail of the block past <eos> and everything after: masked
        if nb_valid >= M:  # distinct blocks while there are enough (a permutation, as SPG draws them)
            assert len(set(blocks)) == M
    w = spg.elbo_weights(masks, valid)
    scored = comp & valid.unsqueeze(1)
    assert torch.equal(w > 0, scored)
    assert torch.allclose((w * scored).sum(-1), n.float().unsqueeze(1).expand(B, M) / M)  # Σ_j w = n / M
    assert spg.block_masks(valid, P, block_length=bl, num_t=M, p_mask_prompt=1.0, generator=g)[..., :P].all()


# ---------------------------------------------------------------------------------------------- enumerable models
def test_spg_sandwich_lower_and_upper_bound_the_exact_likelihood():
    """One block, t ∈ [0, 1]: E[ELBO] is exactly the any-order log-likelihood (the masked count is uniform on
    1..n); the population EUBO (many forwards) is ≥ it; with SPG's M = 2 the EUBO estimate sits above the ELBO on
    average but is not a bound sample by sample (a log of a 2-term mean)."""
    torch.manual_seed(0)
    for model in (JointMLM(seed=0), JointMLM(seed=3)):
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            seqs = model.X[torch.multinomial(model.log_prob(model.X).exp(), 8, replacement=True, generator=g)]
            exact = likelihood.any_order_log_likelihood(model, seqs, 6, MASK)  # (8,)
            R = 600
            x = seqs.repeat_interleave(R, 0)
            valid = torch.ones(len(x), 6, dtype=torch.bool)
            m = spg.block_masks(valid, 0, block_length=6, num_t=2, generator=g)
            lp = likelihood.forward_log_probs(model, x, m, 6, MASK)  # (8R, 2, 6)
            elbo = (lp * spg.elbo_weights(m, valid)).sum((1, 2)).view(8, R)
            eubo2 = spg.eubo_terms(lp, m, valid, 1.5).sum(1).view(8, R)
            se = elbo.std(1) / math.sqrt(R)
            assert torch.all((elbo.mean(1) - exact).abs() < 4 * se + 1e-3), (elbo.mean(1), exact, se)
            assert float((eubo2.mean(1) - elbo.mean(1)).mean()) > 0
            big = spg.block_masks(torch.ones(8, 6, dtype=torch.bool), 0, block_length=6, num_t=1024, generator=g)
            lpb = likelihood.forward_log_probs(model, seqs, big, 6, MASK)
            eubo_pop = spg.eubo_terms(lpb, big, torch.ones(8, 6, dtype=torch.bool), 1.5).sum(1)
            assert torch.all(eubo_pop > exact), (eubo_pop, exact)


def test_every_estimator_bias_and_log_ratio_correlation_against_the_exact_likelihood():
    """300 exact samples of an enumerable consistent model; per estimator the bias of Σ_j ℓ_j against the exact
    log-likelihood and the correlation of its log-ratio to a nearby θ' with the exact one (same masks).
    Properties: the mean field (d1, wd1) is biased low (Σ marginal entropies ≥ joint entropy); SPG's ELBO and
    random_mask's ELBO weights are (nearly) unbiased and track the log-ratio better than the mean field; chain SML
    with K = L is exact; DiffuCoder's released form weighs each token ~1.5× (½ full mask + ½ pair at 1/t), so it
    is far below the log-likelihood scale."""
    torch.manual_seed(0)
    model, model2 = JointMLM(seed=0), JointMLM(seed=0)
    g = torch.Generator().manual_seed(100)
    B, L = 300, 6
    with torch.no_grad():
        for p1, p2 in zip(model.parameters(), model2.parameters()):
            p2.add_(0.05 * p1.std() * torch.randn(p1.shape, generator=g))
        seqs = model.X[torch.multinomial(model.log_prob(model.X).exp(), B, replacement=True, generator=g)]
        exact = likelihood.any_order_log_likelihood(model, seqs, L, MASK)
        exact2 = likelihood.any_order_log_likelihood(model2, seqs, L, MASK)
        valid = torch.ones(B, L, dtype=torch.bool)
        est = {"mean_field": likelihood.mean_field(B, 0, L, generator=g),
               "coupled": likelihood.coupled(B, 0, L, generator=g),
               "coupled_released": likelihood.coupled_released(B, 0, L, generator=g),
               "random_mask": likelihood.random_mask(B, 0, L, num_samples=2, t_min=0.0, generator=g)}
        sm = spg.block_masks(valid, 0, block_length=L, num_t=2, generator=g)
        est["spg_elbo"] = (sm, spg.elbo_weights(sm, valid))
        st = likelihood.assign_strata(valid, L, "random", generator=g)
        est["sml_chain_K=L"] = likelihood.stratify(*likelihood.mean_field(B, 0, L), st, L, chain=True)
        row = {}
        for name, (m, w) in est.items():
            e = likelihood.token_log_probs(model, seqs, m, w, MASK).sum(1)
            e2 = likelihood.token_log_probs(model2, seqs, m, w, MASK).sum(1)
            row[name] = (float((e - exact).mean()), corr(exact2 - exact, e2 - e), float((e - exact).std()))
        lp1 = likelihood.forward_log_probs(model, seqs, sm, L, MASK)
        lp2 = likelihood.forward_log_probs(model2, seqs, sm, L, MASK)
        for beta in (1.0, 1.5):
            u1, u2 = (spg.eubo_terms(x, sm, valid, beta).sum(1) for x in (lp1, lp2))
            row[f"spg_eubo(β={beta})"] = (float((u1 - exact).mean()), corr(exact2 - exact, u2 - u1), 0.0)
    b = {k: v[0] for k, v in row.items()}
    c = {k: v[1] for k, v in row.items()}
    assert b["mean_field"] < -0.2
    for k in ("spg_elbo", "random_mask"):
        se = row[k][2] / math.sqrt(B)
        assert abs(b[k]) < 4 * se + 0.02 and abs(b[k]) < 0.5 * abs(b["mean_field"]), (k, b[k], se)
    assert abs(b["sml_chain_K=L"]) < 1e-4 and c["sml_chain_K=L"] > 0.999
    assert b["coupled_released"] < b["mean_field"]  # ½ MF + a pair term at ~1 log-likelihood: ~1.5× the scale
    assert b["spg_eubo(β=1.5)"] > b["spg_elbo"]  # the upper estimate sits above the lower one on average
    for k, v in c.items():  # every estimator's log-ratio moves with the exact one
        assert v > 0.5, (k, v)


# ---------------------------------------------------------------------------------------------- losses
def _hand_log_probs(tr, ids, mask_rows):
    """log p(y_j | x^(m)) by one direct forward per (row, mask). → (n, M, L)."""
    pol = tr.policy
    out = []
    for b in range(ids.shape[0]):
        rows = []
        for m in range(mask_rows.shape[1]):
            x = torch.where(mask_rows[b, m], torch.full_like(ids[b], pol.vocab.mask_id), ids[b])
            logits = masked.token_logits(pol(x[None]).float(), pol.vocab.mask_id)[0]  # (N, V)
            rows.append(torch.log_softmax(logits, -1).gather(-1, ids[b].unsqueeze(-1)).squeeze(-1))
        out.append(torch.stack(rows))
    return torch.stack(out)  # (n, M, N)


def _grads(tr):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in tr.params]


def _rollout_with_advantages(tr, adv):
    ro = tr.rollout()
    ro.advantages = adv.to(ro.advantages.device)
    return ro


@pytest.mark.parametrize("negative", ["mix", "eubo", "elbo"])
def test_spg_loss_gradient_equals_the_hand_computed_sandwich(negative):
    tr = make_dllm_trainer("dllm.method=spg", f"dllm.spg_negative={negative}", "dllm.spg_beta=1.3",
                           "dllm.spg_mix_weight=0.3", "dllm.spg_num_t=3")
    adv = torch.tensor([0.5, -0.25, 0.0, -1.0, 1.5, 0.25, -0.75, 0.0])
    ro = _rollout_with_advantages(tr, adv)
    tj = ro.traj
    tr.optimizer.zero_grad(set_to_none=True)
    tr.backward(ro, 0)
    got = _grads(tr)
    L = tj.mask_weights.shape[-1]
    ids = tj.sequences
    lp = _hand_log_probs(tr, ids, tj.masks)[..., -L:]  # (B, M, L)
    total, ntok = 0.0, 0
    for i in range(ids.shape[0]):
        valid = likelihood.completion_mask(ids[i:i + 1, -L:], tr.policy.vocab.eos_id)[0]
        n = int(valid.sum())
        ntok += n
        M = tj.masks.shape[1]
        sc = tj.masks[i, :, -L:] & valid  # (M, L)
        c = sc.sum(1).float()
        elbo = sum(n / c[m] * lp[i, m][sc[m]].sum() for m in range(M)) / M
        terms = []
        for j in range(L):
            if sc[:, j].any():
                terms.append(torch.log(sum(torch.exp(1.3 * lp[i, m, j]) / (c[m] / n) for m in range(M) if sc[m, j])
                                       / M) / 1.3)
        eubo = n / len(terms) * sum(terms)
        neg = {"eubo": eubo, "mix": 0.3 * eubo + 0.7 * elbo, "elbo": elbo}[negative]
        bound = elbo if adv[i] > 0 else neg
        total = total - adv[i] * bound
    ref = torch.autograd.grad(total / ntok, tr.params, allow_unused=True)
    ref = [r if r is not None else torch.zeros_like(p) for r, p in zip(ref, tr.params)]
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert sum(float(x.abs().sum()) for x in got) > 0


def test_wd1_loss_gradient_equals_the_hand_computed_weighted_likelihood():
    tr = make_dllm_trainer("dllm.method=wd1", "dllm.p_mask_prompt=0.3")
    ro = tr.rollout()
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3])  # second group: equal rewards
    adv = r - r.view(2, 4).mean(1).repeat_interleave(4)
    ro.advantages = adv
    tj = ro.traj
    tr.optimizer.zero_grad(set_to_none=True)
    tr.backward(ro, 0)
    got = _grads(tr)
    L = tj.mask_weights.shape[-1]
    lp = _hand_log_probs(tr, tj.sequences, tj.masks)[:, 0, -L:]  # (B, L) mean field
    total, ntok = 0.0, 0
    gids = ro.group_ids.tolist()
    for i in range(8):
        grp = [k for k in range(8) if gids[k] == gids[i]]
        wp = math.exp(float(adv[i])) / sum(math.exp(float(adv[k])) for k in grp)
        wn = math.exp(-float(adv[i])) / sum(math.exp(-float(adv[k])) for k in grp)
        valid = likelihood.completion_mask(tj.sequences[i:i + 1, -L:], tr.policy.vocab.eos_id)[0]
        ntok += int(valid.sum())
        total = total - (wp - wn) * lp[i][valid].sum()
    ref = torch.autograd.grad(total / ntok, tr.params, allow_unused=True)
    ref = [x if x is not None else torch.zeros_like(p) for x, p in zip(ref, tr.params)]
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    coef = wd1.wd1_coefficients(adv, ro.group_ids.cpu())
    assert torch.all(coef[4:] == 0) and float(coef[:4].sum()) == pytest.approx(0.0, abs=1e-6)
    assert torch.all(coef[[0, 3]] > 0) and torch.all(coef[[1, 2]] < 0)


def test_coupled_released_first_update_gradient_is_the_hand_computed_policy_gradient():
    """At the first update ρ = 1 and the clip is inactive: ∇L = −Σ_i A_i Σ_j ∇ℓ_ij / N with the released ℓ."""
    tr = make_dllm_trainer("dllm.method=coupled_grpo", "dllm.coupled_form=released")
    adv = torch.tensor([0.5, -0.25, 0.0, -1.0, 1.5, 0.25, -0.75, 0.1])
    ro = _rollout_with_advantages(tr, adv)
    tj = ro.traj
    assert tj.masks.shape[1] == 3
    tr.optimizer.zero_grad(set_to_none=True)
    stats = tr.backward(ro, 0)
    assert stats.metrics["ratio_max_dev"] < 1e-5
    got = _grads(tr)
    L = tj.mask_weights.shape[-1]
    lp = _hand_log_probs(tr, tj.sequences, tj.masks)[..., -L:]  # (B, 3, L)
    total, ntok = 0.0, 0
    for i in range(8):
        valid = likelihood.completion_mask(tj.sequences[i:i + 1, -L:], tr.policy.vocab.eos_id)[0]
        m1 = tj.masks[i, 1, -L:]
        t = float(0.5 / tj.mask_weights[i, 1][m1].max()) if m1.any() else float(1 - 0.5 / tj.mask_weights[i, 2].max())
        ell = 0.5 * (lp[i, 0] + torch.where(m1, lp[i, 1] / t, lp[i, 2] / (1 - t)))
        ntok += int(valid.sum())
        total = total - adv[i] * ell[valid].sum()
    ref = torch.autograd.grad(total / ntok, tr.params, allow_unused=True)
    ref = [x if x is not None else torch.zeros_like(p) for x, p in zip(ref, tr.params)]
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("overrides", [("dllm.method=spg",), ("dllm.method=spg", "dllm.spg_negative=eubo"),
                                       ("dllm.method=wd1",), ("dllm.method=wd1", "daca.likelihood=sml"),
                                       ("dllm.method=coupled_grpo", "dllm.coupled_form=released")])
def test_zero_advantages_give_zero_gradient(overrides):
    tr = make_dllm_trainer(*overrides)
    ro = _rollout_with_advantages(tr, torch.zeros(8))
    tr.optimizer.zero_grad(set_to_none=True)
    tr.backward(ro, 0)
    assert all(float(g.abs().max()) == 0.0 for g in _grads(tr))


@pytest.mark.parametrize("method", ["spg", "wd1"])
def test_dps_composes_and_mix_zero_is_the_base_method(method):
    adv = torch.linspace(-1, 1, 8)
    grads = {}
    for name, extra in {"base": (), "mix0": ("daca.dps_score=entropy", "daca.dps_mix=0"),
                        "dps": ("daca.dps_score=entropy", "daca.dps_mix=1")}.items():
        tr = make_dllm_trainer(f"dllm.method={method}", *extra)
        ro = _rollout_with_advantages(tr, adv)
        tr.optimizer.zero_grad(set_to_none=True)
        tr.backward(ro, 0)
        grads[name] = _grads(tr)
    assert all(torch.equal(a, b) for a, b in zip(grads["base"], grads["mix0"]))
    assert any(not torch.allclose(a, b) for a, b in zip(grads["base"], grads["dps"]))


@pytest.mark.parametrize("overrides,M,old_forwards", [
    (("dllm.method=diffu_grpo",), 1, True), (("dllm.method=coupled_grpo",), 2, True),
    (("dllm.method=coupled_grpo", "dllm.coupled_form=released"), 3, True),
    (("dllm.method=coupled_grpo", "dllm.coupled_form=released", "daca.likelihood=sml"), 6, True),
    (("dllm.method=spg",), 2, False), (("dllm.method=spg", "dllm.spg_num_t=3"), 3, False),
    (("dllm.method=wd1",), 1, False), (("dllm.method=wd1", "daca.likelihood=sml", "daca.sml_strata=3"), 3, False)])
def test_forwards_per_update(overrides, M, old_forwards):
    """Grad-forwards per update = B·M (what the equal-forwards study budgets); ratio-free methods spend no
    ℓ_old forwards; the rollout–train consistency check replays one decoding step per third (none when off)."""
    for check in ("warn", "off"):
        tr = make_dllm_trainer(*overrides, f"train.on_inconsistency={check}")
        assert forwards_per_estimate(tr.cfg.dllm, tr.cfg.daca) == M
        before = dict(tr.policy.counters)
        ro = tr.rollout()
        sampling, replay = 8 * tr.family.steps, 8 * len(replay_steps(tr.family.steps)) if check != "off" else 0
        assert tr.policy.counters["forwards_nograd"] - before.get("forwards_nograd", 0) == \
            sampling + replay + (8 * M if old_forwards else 0)
    ro.advantages = torch.linspace(-1, 1, 8)
    stats = tr.backward(ro, 0)
    assert stats.forwards_grad == 8 * M and stats.sample_backwards == 8 * M


def test_method_config_checks():
    assert {"spg", "wd1"} <= set(METHODS)
    for bad, key in [(["dllm.method=spg", "loss.beta=0.04"], "loss.beta"),
                     (["dllm.method=spg", "daca.likelihood=sml"], "daca.likelihood"),
                     (["dllm.method=spg", "dllm.spg_t_min=0.8", "dllm.spg_t_max=0.2"], "dllm.spg_t_min"),
                     (["dllm.method=spg", "dllm.spg_block_length=5"], "dllm.spg_block_length"),
                     (["dllm.coupled_form=both"], "dllm.coupled_form"),
                     (["dllm.spg_beta=0"], "dllm.spg_beta"),
                     (["dllm.spg_negative=zero"], "dllm.spg_negative"),
                     (["dllm.method=wd1", "dist.group_layout=spread"], "dist.group_layout")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
            RunConfig.from_overrides(["model.name=tiny_mlm", *bad])
        assert "\n" not in str(e.value)
    RunConfig.from_overrides(["model.name=tiny_mlm", "dllm.method=wd1", "loss.beta=0.04", "daca.likelihood=sml"])
    RunConfig.from_overrides(["model.name=tiny_mlm", "dllm.method=spg", "dllm.spg_block_length=4",
                              "daca.dps_score=entropy"])
