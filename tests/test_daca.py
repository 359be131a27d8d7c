"""DACA-GRPO plug-ins: Denoising Progress Scores and Stratified Masking Likelihood on every dLLM base method."""
from __future__ import annotations

import pytest
import torch

from diffgrpo.dllm import credit, likelihood
from diffgrpo.tasks import VOCAB
from tests.helpers.tiny import JointMLM, make_dllm_trainer

METHODS = ["diffu_grpo", "coupled_grpo", "random_mask"]


def sml_estimate(model, seqs, K, mode, g):
    B, L = seqs.shape
    m, w = likelihood.mean_field(B, 0, L)
    st = likelihood.assign_strata(torch.ones(B, L, dtype=torch.bool), K, "random", generator=g)
    m, w = likelihood.stratify(m, w, st, K, chain=mode == "chain")
    return likelihood.token_log_probs(model, seqs, m, w, model.V).sum(1), (m, w)


def test_any_order_log_likelihood_is_exact_on_a_consistent_model():
    model = JointMLM(seed=1)
    x = model.X[torch.randint(0, len(model.X), (8,), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        assert torch.allclose(likelihood.any_order_log_likelihood(model, x, 6, 3), model.log_prob(x), atol=1e-4)
        # K = L chain with a random partition is one decoding order: exact for a consistent model
        est, _ = sml_estimate(model, x, 6, "chain", torch.Generator().manual_seed(1))
    assert torch.allclose(est, model.log_prob(x), atol=1e-4)


def test_sml_bias_log_ratio_and_gradient_against_exact_likelihood():
    """300 sequences from an enumerable consistent model: SML (leave_one_out, K = 2) has under half the mean
    field's bias; chain K = 3 tracks the exact log-ratio better than mean field; both have gradients closer to the
    exact ∇θ log p. (The mean field's log-ratio correlation is already ≈ 0.9 here; leave_one_out K = 2 does NOT
    beat it by 0.1, see benchmarks/results/daca/bias.md.)"""
    torch.manual_seed(0)
    model, model2 = JointMLM(seed=0), JointMLM(seed=0)
    g = torch.Generator().manual_seed(100)
    with torch.no_grad():
        for p1, p2 in zip(model.parameters(), model2.parameters()):
            p2.add_(0.05 * p1.std() * torch.randn(p1.shape, generator=g))
        seqs = model.X[torch.multinomial(model.log_prob(model.X).exp(), 300, replacement=True, generator=g)]
        exact = likelihood.any_order_log_likelihood(model, seqs, 6, 3)
        exact2 = likelihood.any_order_log_likelihood(model2, seqs, 6, 3)
        mf_m, mf_w = likelihood.mean_field(300, 0, 6)
        mf = likelihood.token_log_probs(model, seqs, mf_m, mf_w, 3).sum(1)
        mf2 = likelihood.token_log_probs(model2, seqs, mf_m, mf_w, 3).sum(1)
        loo, (lm, lw) = sml_estimate(model, seqs, 2, "leave_one_out", torch.Generator().manual_seed(5))
        ch, (cm, cw) = sml_estimate(model, seqs, 3, "chain", torch.Generator().manual_seed(5))
        ch2 = likelihood.token_log_probs(model2, seqs, cm, cw, 3).sum(1)
    bias_mf, bias_loo = float((mf - exact).mean()), float((loo - exact).mean())
    assert bias_mf < -0.2  # the mean field under-counts dependencies
    assert abs(bias_loo) < 0.5 * abs(bias_mf), (bias_loo, bias_mf)
    assert float((loo - exact).pow(2).mean()) < float((mf - exact).pow(2).mean())

    def corr(a, b):
        return float(torch.corrcoef(torch.stack([a, b]))[0, 1])

    c_mf, c_ch = corr(exact2 - exact, mf2 - mf), corr(exact2 - exact, ch2 - ch)
    assert c_ch > c_mf + 0.05, (c_ch, c_mf)

    params = list(model.parameters())

    def grad(v):
        return torch.cat([x.flatten() for x in torch.autograd.grad(v, params)])

    cos = {"mf": [], "loo": [], "chain": []}
    for i in range(24):
        s = seqs[i:i + 1]
        ge = grad(likelihood.any_order_log_likelihood(model, s, 6, 3).sum())
        for name, (m, w) in {"mf": (mf_m, mf_w), "loo": (lm, lw), "chain": (cm, cw)}.items():
            gs = grad(likelihood.token_log_probs(model, s, m[i:i + 1], w[i:i + 1], 3).sum())
            cos[name].append(float(torch.nn.functional.cosine_similarity(ge, gs, 0)))
    mean = {k: sum(v) / len(v) for k, v in cos.items()}
    assert mean["loo"] > mean["mf"] and mean["chain"] > mean["mf"] + 0.05, mean


# ---------------------------------------------------------------------------------------------- SML masks
def test_stratify_masks_and_weights():
    g = torch.Generator().manual_seed(0)
    B, P, L, K = 16, 3, 10, 3
    valid = torch.arange(L).expand(B, L) < torch.randint(4, L + 1, (B, 1), generator=g)
    for base in (likelihood.mean_field(B, P, L, p_mask_prompt=0.5, generator=g),
                 likelihood.coupled(B, P, L, generator=g), likelihood.random_mask(B, P, L, num_samples=2, generator=g)):
        m0, w0 = base
        M = m0.shape[1]
        assert [torch.equal(a, b) for a, b in zip(likelihood.stratify(m0, w0, torch.where(valid, 0, -1), 1), base)] \
            == [True, True]  # K = 1 is the base estimator
        for part in likelihood.SML_PARTITIONS:
            order = torch.stack([torch.randperm(L, generator=g) for _ in range(B)])
            st = likelihood.assign_strata(valid, K, part, order=order, generator=g)
            assert torch.equal(st >= 0, valid)
            counts = torch.stack([(st == k).sum(1) for k in range(K)], 1)  # balanced strata
            assert (counts.max(1).values - counts.min(1).values).max() <= 1
            for chain in (False, True):
                m, w = likelihood.stratify(m0, w0, st, K, chain=chain)
                assert m.shape == (B, K * M, P + L) and w.shape == (B, K * M, L)
                # every token keeps its base total weight, split over groups; prompt masks unchanged
                assert torch.allclose(w.view(B, K, M, L).sum(1), w0)
                assert torch.equal(m.view(B, K, M, -1)[..., :P], m0[:, None, :, :P].expand(B, K, M, P))
                comp = m.view(B, K, M, -1)[..., P:]
                for k in range(K):
                    allowed = ((st >= k) if chain else (st == k)) | ~valid
                    assert torch.equal(comp[:, k], m0[..., P:] & allowed[:, None])
                    assert torch.all(w.view(B, K, M, L)[:, k][(st != k)[:, None].expand(B, M, L) & valid[:, None]] == 0)
    # decode_order: stratum 0 holds the tokens decoded first
    order = torch.arange(L - 1, -1, -1).expand(2, L)
    st = likelihood.assign_strata(torch.ones(2, L, dtype=torch.bool), 2, "decode_order", order=order)
    assert st[0].tolist() == [1] * 5 + [0] * 5


# ---------------------------------------------------------------------------------------------- DPS weights
def test_dps_weights_mean_one_and_clipped():
    g = torch.Generator().manual_seed(0)
    B, L = 32, 12
    valid = torch.arange(L).expand(B, L) < torch.randint(1, L + 1, (B, 1), generator=g)
    rec = {"entropy": torch.rand(B, L, generator=g) ** 4 * 2, "confidence": torch.rand(B, L, generator=g),
           "margin": torch.rand(B, L, generator=g), "commit_step": torch.randint(0, L, (B, L), generator=g),
           "block_rank": torch.randint(0, 4, (B, L), generator=g)}
    rec["entropy"][0] = 0.0  # degenerate row: uniform weights
    for score in credit.DPS_SCORES[1:]:
        for lo, hi, lam in [(0.2, 5.0, 1.0), (0.5, 1.5, 1.0), (0.2, 5.0, 0.3)]:
            w = credit.dps_weights(rec, valid, score=score, mix=lam, clip_min=lo, clip_max=hi, steps=L,
                                   block_length=4)
            mean = (w * valid).sum(1) / valid.sum(1)
            assert torch.allclose(mean, torch.ones(B), atol=1e-5), score
            assert w[valid].min() >= lo - 1e-6 and w[valid].max() <= hi + 1e-6
            assert torch.all(w[~valid] == 1) and not w.requires_grad
        w = credit.dps_weights(rec, valid, score=score, mix=0.0, steps=L, block_length=4)
        assert torch.all(w == 1)
    w = credit.dps_weights(rec, valid, score="entropy", mix=1.0, steps=L, block_length=4)
    assert torch.all(w[0] == 1)
    # higher raw score → no lower weight (monotone within a row)
    r = valid[1]
    s = rec["entropy"][1][r]
    assert torch.all(w[1][r][s.argsort()].diff() >= -1e-6)
    st = credit.weight_stats(w, valid)
    assert set(st) == {"dps/mean", "dps/std", "dps/max", "dps/top20_share"} and 0.2 <= st["dps/top20_share"] <= 1


# ---------------------------------------------------------------------------------------------- GRPO wiring
DACA_DEFAULTS = ["loss.beta=0.04", "dllm.p_mask_prompt=0.3", "dllm.num_mask_samples=2"]


def make_trainer(*overrides, seed=0):
    return make_dllm_trainer(*DACA_DEFAULTS, *overrides, seed=seed)


def grads_after_update(tr, ro):
    """Gradient of epoch 1 after one optimizer step (ratios ≠ 1, KL > 0), plus the loss metrics."""
    torch.manual_seed(1)
    ro.advantages = torch.linspace(-1, 1, ro.batch_size)
    tr.backward(ro, 0)
    tr.optimizer.step()
    stats = tr.backward(ro, 1)
    return torch.cat([p.grad.flatten() for p in tr.params]), stats


@pytest.mark.parametrize("method", METHODS)
def test_dps_mix_zero_and_one_stratum_reproduce_the_base_method(method):
    base = make_trainer(f"dllm.method={method}")
    ro = base.rollout()
    g0, s0 = grads_after_update(base, ro)
    for extra in (["daca.dps_score=entropy", "daca.dps_mix=0"], ["daca.likelihood=sml", "daca.sml_strata=1"],
                  ["daca.dps_score=confidence", "daca.dps_mix=0", "daca.likelihood=sml", "daca.sml_strata=1"]):
        tr = make_trainer(f"dllm.method={method}", *extra)
        r = tr.rollout()
        assert torch.equal(r.traj.sequences, ro.traj.sequences) and torch.equal(r.traj.masks, ro.traj.masks)
        assert torch.equal(r.traj.log_probs, ro.traj.log_probs) and torch.equal(r.traj.ref_log_probs, ro.traj.ref_log_probs)
        g, s = grads_after_update(tr, r)
        assert torch.equal(g, g0), extra
        assert s.metrics["kl"] == s0.metrics["kl"] and s.metrics["ratio_mean"] == s0.metrics["ratio_mean"]


@pytest.mark.parametrize("method", METHODS)
def test_sml_per_group_backward_equals_one_backward_over_all_forwards(method):
    """K = 3 (chain and leave_one_out): the per-stratum backward gives the gradient of the full loss built from
    one forward over all K·M masks; ratios are 1 at epoch 0 (old log-probs use the same stored masks)."""
    from diffgrpo.dllm.grpo import grpo_token_loss
    from diffgrpo.losses import aggregate

    for mode, part in (("leave_one_out", "random"), ("chain", "decode_order")):
        tr = make_trainer(f"dllm.method={method}", "daca.likelihood=sml", "daca.sml_strata=3",
                          f"daca.sml_mode={mode}", f"daca.sml_partition={part}", "daca.dps_score=entropy")
        fam = tr.family
        ro = tr.rollout()
        ro.advantages = torch.linspace(-1, 1, ro.batch_size)
        M = {"diffu_grpo": 1, "coupled_grpo": 2, "random_mask": 2}[method]
        assert ro.traj.masks.shape[1] == 3 * M and ro.traj.groups == 3
        st = ro.traj.strata
        from diffgrpo.dllm.likelihood import completion_mask

        assert torch.equal(st >= 0, completion_mask(ro.traj.sequences[:, -fam.gen_length:], VOCAB.eos_id))
        f0 = tr.policy.counters["forwards_grad"]
        stats = tr.backward(ro, 0)
        assert stats.metrics["ratio_max_dev"] < 1e-5
        rows = int(ro.selected.any(1).sum())
        assert tr.policy.counters["forwards_grad"] - f0 == rows * 3 * M and stats.backward_calls == 3
        g_groups = torch.cat([p.grad.flatten() for p in tr.params])
        tr.optimizer.zero_grad(set_to_none=False)
        lp = fam.method.log_probs(ro.traj.sequences, ro.traj.masks, ro.traj.mask_weights)  # one big forward
        loss, _ = grpo_token_loss(lp, ro.traj.log_probs, ro.advantages, fam.ctx.clip_range,
                                  ref_log_prob=ro.traj.ref_log_probs, beta=fam.ctx.beta,
                                  token_weights=ro.traj.token_weights)
        aggregate(loss, ro.loss_weights).backward()
        g_one = torch.cat([p.grad.flatten() for p in tr.params])
        assert float((g_groups - g_one).norm() / g_one.norm()) < 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_dps_costs_no_forward_and_weights_only_the_policy_term(method):
    base = make_trainer(f"dllm.method={method}")
    ro_b = base.rollout()
    tr = make_trainer(f"dllm.method={method}", "daca.dps_score=entropy", "daca.dps_mix=1")
    ro = tr.rollout()
    assert tr.policy.counters == base.policy.counters  # zero extra forwards in the rollout
    w = ro.traj.token_weights
    assert torch.equal(ro.traj.sequences, ro_b.traj.sequences) and not torch.all(w == 1)
    from diffgrpo.dllm.likelihood import completion_mask

    valid = completion_mask(ro.traj.sequences[:, -tr.family.gen_length:], VOCAB.eos_id)
    c = dict(tr.policy.counters)
    d = tr.cfg.daca
    again = credit.dps_weights(ro.traj.records, valid, score="entropy", mix=1.0, clip_min=d.dps_clip_min,
                               clip_max=d.dps_clip_max, steps=tr.family.steps, block_length=tr.family.block_length)
    assert torch.equal(again, w) and tr.policy.counters == c
    assert torch.allclose((w * valid).sum(1) / valid.sum(1), torch.ones(len(w)), atol=1e-5)
    # the weights multiply the policy term only: with zero advantages the loss is the (unweighted) KL
    from diffgrpo.dllm.grpo import grpo_token_loss

    lp = ro.traj.log_probs + 0.1
    zero = torch.zeros(ro.batch_size)
    l_w, _ = grpo_token_loss(lp, ro.traj.log_probs, zero, 0.2, ref_log_prob=ro.traj.log_probs, beta=0.5, token_weights=w)
    l_1, _ = grpo_token_loss(lp, ro.traj.log_probs, zero, 0.2, ref_log_prob=ro.traj.log_probs, beta=0.5)
    assert torch.equal(l_w, l_1)
    adv = torch.ones(ro.batch_size)
    p_w, _ = grpo_token_loss(lp, ro.traj.log_probs, adv, 0.2, token_weights=w)
    p_1, _ = grpo_token_loss(lp, ro.traj.log_probs, adv, 0.2)
    assert torch.allclose(p_w, p_1 * w)
    stats = tr.backward(ro, 0)
    assert {"dps/mean", "dps/std", "dps/max", "dps/top20_share"} <= set(stats.metrics)
    assert stats.metrics["dps/mean"] == pytest.approx(1.0, abs=1e-5)


def test_daca_train_step_runs():
    tr = make_trainer("dllm.method=coupled_grpo", "daca.dps_score=progress", "daca.likelihood=sml",
                      "daca.sml_strata=2", "dllm.task=sudoku", "dllm.block_length=8", "dllm.diffusion_steps=8")
    collect, seen = tr.family.collect, []
    tr.family.collect = lambda: seen.append(collect()) or seen[-1]
    before = [p.detach().clone() for p in tr.params]
    row = tr.step()
    ((ro, _),) = seen
    assert row["reward"] == pytest.approx(float(ro.rewards.mean()))
    # DPS weights of the trained tokens, normalised to mean 1
    w = ro.traj.token_weights[ro.selected]
    assert float(w.mean()) == pytest.approx(1.0, abs=1e-5)
    assert row["first_epoch/dps/mean"] == pytest.approx(float(w.mean()), abs=1e-6)
    assert row["first_epoch/dps/max"] == pytest.approx(float(w.max())) and row["first_epoch/dps/std"] > 0
    assert 0.2 <= row["first_epoch/dps/top20_share"] <= 1
    # K = 2 SML groups × M = 2 coupled forwards per trained row, each back-propagated once
    assert ro.traj.groups == 2 and ro.traj.masks.shape[1] == 2 * 2
    rows = int(ro.selected.any(1).sum())
    assert row["forwards_grad"] == row["sample_backwards"] == rows * 2 * 2 and row["forwards_nograd"] == 0
    assert row["first_epoch/trained_tokens"] == int(ro.selected.sum())
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(before, tr.params))
    assert row["skipped_updates"] == 0 and 0.5 * tr.cfg.train.lr < moved < 1.5 * tr.cfg.train.lr  # one AdamW step


@pytest.mark.parametrize("blocks", [1, 2])
def test_decode_order_chain_with_one_stratum_per_token_is_the_sampler_path_log_likelihood(blocks):
    """SML chain mode with the decode_order partition and K = L scores every token in the context the sampler
    committed it in (one token per step, semi-autoregressive blocks included), so it reproduces the sampler's
    recorded step log-probs: the path log-likelihood of the policy GRPO optimises. Random partitions do not."""
    tr = make_trainer("dllm.p_mask_prompt=0", f"dllm.block_length={8 // blocks}", "dllm.gen_length=8",
                      "dllm.diffusion_steps=8", "dllm.task=arithmetic")
    fam = tr.family
    ex = fam.task.sample("train", 6, torch.Generator().manual_seed(0))
    smp = fam.generate(ex, temperature=1.0, generator=torch.Generator().manual_seed(1))
    B, N = smp.sequences.shape
    L = fam.gen_length
    m, w = likelihood.mean_field(B, N - L, L)
    everything = torch.ones(B, L, dtype=torch.bool)
    with torch.no_grad():
        for part, exact in (("decode_order", True), ("random", False)):
            st = likelihood.assign_strata(everything, L, part, order=smp.order, generator=torch.Generator().manual_seed(2))
            sm, sw = likelihood.stratify(m, w, st, L, chain=True)
            lp = fam.method.log_probs(smp.sequences, sm, sw)  # (B, L)
            err = float((lp - smp.step_log_prob).abs().max())
            assert (err < 1e-5) if exact else (err > 1e-4), (part, err)
