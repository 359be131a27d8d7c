"""Masked diffusion LMs: sampler invariants, likelihood estimators, adapter conventions and the GRPO base methods."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from diffgrpo import ConfigError, RunConfig
from diffgrpo.dllm import likelihood
from diffgrpo.dllm.grpo import k3_kl
from diffgrpo.dllm.likelihood import completion_mask
from diffgrpo.models.hf_masked_lm import (
    MaskedLMPolicy,
    masked_diffusion_loss,
    shift_logits,
    tiny_bert,
)
from diffgrpo.samplers import masked
from diffgrpo.tasks import VOCAB
from tests.helpers.interrupt import train_stopped_after
from tests.helpers.tiny import TINY_DLLM, EnumerableMLM, make_dllm_trainer


def any_order_marginal(model, prompt, L, V):
    """p(y) = (1/L!) Σ_σ Π_j p(y_σj | prompt, y_σ<j revealed, rest masked), for every y ∈ V^L."""
    mask = V
    probs = {}
    for y in itertools.product(range(V), repeat=L):
        tot = 0.0
        for perm in itertools.permutations(range(L)):
            x = list(prompt) + [mask] * L
            p = 1.0
            for j in perm:
                logp = torch.log_softmax(model(torch.tensor([x]))[0, len(prompt) + j], -1)
                p *= float(logp[y[j]].exp())
                x[len(prompt) + j] = y[j]
            tot += p
        probs[y] = tot / math.factorial(L)
    return probs


def test_random_remasking_one_block_samples_the_any_order_marginal():
    V, P, L = 3, 1, 3
    model = EnumerableMLM(V=V, N=P + L)
    exact = any_order_marginal(model, [1], L, V)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-6)
    n = 40000
    out = masked.sample(model, torch.ones(n, P, dtype=torch.long), mask_id=V, gen_length=L, block_length=L, steps=L,
                        temperature=1.0, remasking="random", generator=torch.Generator().manual_seed(0))
    comps = out.completions
    for y, p in exact.items():
        f = float((comps == torch.tensor(y)).all(1).float().mean())
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-4, (y, f, p)
    # the any-order marginal is not the left-to-right chain rule of this model: the check has power
    l2r = {}
    for y in exact:
        x, p = [1] + [V] * L, 1.0
        for j in range(L):
            p *= float(torch.softmax(model(torch.tensor([x]))[0, P + j], -1)[y[j]])
            x[P + j] = y[j]
        l2r[y] = p
    assert max(abs(l2r[y] - exact[y]) for y in exact) > 0.01
    # recorded step log-prob is the log-prob of the committed token under the sampling distribution
    assert torch.all(out.step_log_prob <= 0) and torch.allclose(out.step_log_prob.exp(), out.confidence, atol=1e-5)


def test_temperature_zero_is_deterministic_and_low_confidence_commits_top_k():
    model = EnumerableMLM(V=5, N=10, seed=1)
    prompt = torch.randint(0, 5, (6, 2), generator=torch.Generator().manual_seed(0))
    kw = dict(mask_id=5, gen_length=8, block_length=4, steps=4, temperature=0.0, remasking="low_confidence")
    a = masked.sample(model, prompt, generator=torch.Generator().manual_seed(1), **kw)
    b = masked.sample(model, prompt, generator=torch.Generator().manual_seed(2), **kw)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.order, b.order)
    # step 0 commits the 2 most confident positions of block 0
    x = torch.cat([prompt, torch.full((6, 8), 5)], 1)
    conf = torch.softmax(model(x)[:, 2:], -1).max(-1).values[:, :4]
    top = conf.topk(2, -1).indices.sort(-1).values
    got = torch.stack([torch.nonzero(r == 0).flatten() for r in a.commit_step]).sort(-1).values
    assert torch.equal(top, got)
    assert torch.allclose(a.confidence.gather(1, top), conf.gather(1, top))


def test_commit_records_are_consistent_with_decode_order():
    model = EnumerableMLM(V=4, N=14, seed=2)
    prompt = torch.zeros(5, 2, dtype=torch.long)
    for remasking in masked.REMASKING:
        s = masked.sample(model, prompt, mask_id=4, gen_length=12, block_length=4, steps=6, temperature=1.0,
                          remasking=remasking, generator=torch.Generator().manual_seed(3))
        sched = masked.schedule(12, 4, 6)
        assert s.num_steps == len(sched)
        for i in range(5):
            order = s.order[i]
            assert sorted(order.tolist()) == list(range(12))  # a permutation
            steps_in_order = s.commit_step[i][order]
            assert torch.all(steps_in_order[1:] >= steps_in_order[:-1])  # commit steps follow the decode order
            assert torch.bincount(s.commit_step[i], minlength=6).tolist() == [k for _, k in sched]
            for blk in range(3):  # blocks decode left to right, each within its own steps
                st = s.commit_step[i, blk * 4:(blk + 1) * 4]
                assert st.min() >= 2 * blk and st.max() < 2 * (blk + 1)
                assert sorted(s.block_rank[i, blk * 4:(blk + 1) * 4].tolist()) == [0, 1, 2, 3]
        assert (s.completions != 4).all()  # nothing left masked
        assert torch.all(s.entropy >= 0) and torch.all((s.margin >= 0) & (s.margin <= 1))
        assert torch.all((s.confidence > 0) & (s.confidence <= 1))
    with pytest.raises(ValueError):
        masked.schedule(12, 5, 6)


def test_sampler_never_proposes_the_mask_token():
    """A model that puts most of its mass on <mask> (an untrained or real LM can) still gets every position
    committed exactly once with a real token, and the estimators score under the same <mask>-free distribution."""
    base = EnumerableMLM(V=3, N=8, seed=1)

    def model(ids):  # (B, N) → (B, N, V+1) with a large <mask> logit
        logits = base(ids)
        logits[..., 3] = 4.0
        return logits

    prompt = torch.zeros(16, 2, dtype=torch.long)
    s = masked.sample(model, prompt, mask_id=3, gen_length=6, block_length=3, steps=6, temperature=1.0,
                      generator=torch.Generator().manual_seed(0))
    assert (s.completions != 3).all()
    assert all(sorted(o.tolist()) == list(range(6)) for o in s.order) and (s.commit_step >= 0).all()
    assert torch.isfinite(s.entropy).all() and torch.isfinite(s.step_log_prob).all()
    m, w = likelihood.stratified(16, 2, 6, strata=s.commit_step, num_strata=6, chain=True)
    lp = likelihood.token_log_probs(model, s.sequences, m, w, 3)
    assert torch.allclose(lp, s.step_log_prob, atol=1e-5)


# ---------------------------------------------------------------------------------------------- estimators
def test_estimator_masks():
    g = torch.Generator().manual_seed(0)
    B, P, L = 64, 5, 12
    m, w = likelihood.mean_field(B, P, L, p_mask_prompt=0.0, generator=g)
    assert m.shape == (B, 1, P + L) and m[..., P:].all() and not m[..., :P].any() and (w == 1).all()
    m, _ = likelihood.mean_field(B, P, L, p_mask_prompt=1.0, generator=g)
    assert m.all()
    m, w = likelihood.coupled(B, P, L, generator=g)
    assert not m[..., :P].any() and torch.equal(m[..., P:].sum(1), torch.ones(B, L, dtype=torch.long))
    assert torch.equal(w.sum(1), torch.ones(B, L))  # each token scored exactly once
    ratio = m[:, 0, P:].float().mean(1)
    assert ratio.min() > 0.0 and ratio.max() < 1.0
    m, w = likelihood.random_mask(4096, P, L, num_samples=3, generator=g)
    assert m.shape == (4096, 3, P + L) and torch.equal(w > 0, m[..., P:])
    assert float(w.sum(1).mean()) == pytest.approx(1.0, abs=0.05)  # ELBO weights: unbiased per token
    st = torch.randint(0, 1, (B, L), generator=g)
    ms, ws = likelihood.stratified(B, P, L, strata=st, num_strata=1)
    m1, w1 = likelihood.mean_field(B, P, L, p_mask_prompt=0.0)
    assert torch.equal(ms, m1) and torch.equal(ws, w1)  # K = 1 is the mean field


def test_token_log_probs_matches_direct_forward():
    model = EnumerableMLM(V=4, N=7, seed=4)
    ids = torch.randint(0, 4, (3, 7), generator=torch.Generator().manual_seed(0))
    masks, w = likelihood.coupled(3, 3, 4, generator=torch.Generator().manual_seed(1))
    got = likelihood.token_log_probs(model, ids, masks, w, mask_id=4)
    for b in range(3):
        for j in range(4):
            m = int(torch.nonzero(masks[b, :, 3 + j]).item())
            x = torch.where(masks[b, m], torch.full_like(ids[b], 4), ids[b])
            ref = torch.log_softmax(model(x[None])[0, 3 + j], -1)[ids[b, 3 + j]]
            assert float(got[b, j]) == pytest.approx(float(ref), abs=1e-5)


def test_masked_diffusion_loss_weighting():
    """With uniform logits every masked token costs log V; the 1/t weight makes the expectation log V."""
    V = 7
    torch.manual_seed(0)
    loss = masked_diffusion_loss(lambda x: torch.zeros(*x.shape, V), torch.zeros(20000, 2, dtype=torch.long),
                                 torch.zeros(20000, 6, dtype=torch.long), mask_id=6, t_min=0.01,
                                 generator=torch.Generator().manual_seed(0))
    assert float(loss) == pytest.approx(math.log(V), rel=0.03)


def test_completion_mask_and_k3():
    c = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 2, 2, 2]])
    assert completion_mask(c, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert torch.equal(k3_kl(torch.tensor([0.3]), torch.tensor([0.3])), torch.zeros(1))
    assert float(k3_kl(torch.tensor([-1.0]), torch.tensor([-2.0]))) > 0


# ---------------------------------------------------------------------------------------------- adapters
@pytest.mark.parametrize("cls", ["BertForMaskedLM", "RobertaForMaskedLM", "ModernBertForMaskedLM"])
def test_hf_masked_lm_adapter_tiny_configs(cls):
    import transformers

    model_cls = getattr(transformers, cls)
    cfg_cls = getattr(transformers, cls.replace("ForMaskedLM", "Config"))
    kw = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=64, max_position_embeddings=40, pad_token_id=VOCAB.pad_id)
    if cls == "ModernBertForMaskedLM":
        kw.update(global_attn_every_n_layers=1, local_attention=16, bos_token_id=VOCAB.eos_id,
                  eos_token_id=VOCAB.eos_id, sep_token_id=VOCAB.eos_id, cls_token_id=VOCAB.eos_id)
    torch.manual_seed(0)
    net = model_cls(cfg_cls(**kw)).eval()
    pol = MaskedLMPolicy(net, vocab=VOCAB)
    ids = torch.cat([VOCAB.encode_prompts(["1+2=", "12+13="], 8), torch.full((2, 8), VOCAB.mask_id)], 1)
    with torch.no_grad():
        out = pol(ids)
        # bidirectional: changing a later token changes an earlier position's logits
        ids2 = ids.clone()
        ids2[:, -1] = VOCAB.index["7"]
        out2 = pol(ids2)
    assert out.shape == (2, 16, len(VOCAB)) and out.dtype == torch.float32
    assert not torch.allclose(out[:, 9], out2[:, 9])
    assert pol.counters["forwards_nograd"] == 4
    shifted = MaskedLMPolicy(net, vocab=VOCAB, logits_shift=True)
    with torch.no_grad():
        s = shifted(ids)
    assert torch.equal(s[:, 1:], out[:, :-1])  # Dream: position j−1 scores token j
    assert torch.equal(shift_logits(out)[:, 0], out[:, 0])


# ---------------------------------------------------------------------------------------------- GRPO methods
@pytest.mark.parametrize("method", ["diffu_grpo", "coupled_grpo", "random_mask"])
def test_base_method_first_ratio_is_one_and_masks_are_fixed(method):
    tr = make_dllm_trainer(f"dllm.method={method}", "loss.beta=0.04", "train.num_inner_epochs=2",
                           "dllm.p_mask_prompt=0.3", "dllm.num_mask_samples=3")
    fam = tr.family
    ro = tr.rollout()
    # make rewards vary so advantages are non-zero
    ro.advantages = torch.linspace(-1, 1, ro.batch_size)
    masks = ro.traj.masks.clone()
    M = {"diffu_grpo": 1, "coupled_grpo": 2, "random_mask": 3}[method]
    assert masks.shape == (8, M, ro.traj.sequences.shape[-1])
    rng = torch.get_rng_state()
    gm = fam.method.gen_masks.get_state()
    stats = tr.backward(ro, 0)
    assert stats.metrics["ratio_max_dev"] < 1e-5 and stats.metrics["kl"] < 1e-8 and stats.metrics["clip_ratio"] == 0
    assert stats.forwards_grad == 8 * M and stats.sample_backwards == 8 * M
    g = [p.grad for p in tr.params if p.grad is not None]
    assert g and sum(float(x.abs().sum()) for x in g) > 0
    tr.optimizer.step()
    # the stored masks reproduce ℓ_old and are what the current policy is scored with after the update
    with torch.no_grad():
        with tr.policy.reference():
            again = fam.method.log_probs(ro.traj.sequences, ro.traj.masks, ro.traj.mask_weights)
    assert torch.allclose(again, ro.traj.log_probs, atol=1e-5)
    stats2 = tr.backward(ro, 1)
    assert torch.equal(ro.traj.masks, masks)
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(fam.method.gen_masks.get_state(), gm)
    assert stats2.metrics["ratio_max_dev"] > 0 and stats2.metrics["kl"] > 0  # the policy moved


def test_method_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 1.0])
    for method, expect in [("diffu_grpo", lambda x, m, o: x - m), ("coupled_grpo", lambda x, m, o: x - o)]:
        tr = make_dllm_trainer(f"dllm.method={method}")
        fam = tr.family
        from diffgrpo.advantages import group_advantages

        adv, _ = group_advantages(r, torch.tensor([0] * 4 + [1] * 4), std_mode=fam.std_mode, baseline=fam.baseline)
        for i in range(8):
            grp = r[(i // 4) * 4:(i // 4 + 1) * 4]
            other = (grp.sum() - r[i]) / 3
            assert float(adv[i]) == pytest.approx(float(expect(r[i], grp.mean(), other)), abs=1e-6)


def test_train_step_and_evaluate_run():
    """One iteration's metrics row describes its rollout (rewards, groups, trained tokens) and its cost (one
    forward and backward per trained row and mask sample); the update moves the weights; evaluation is free."""
    tr = make_dllm_trainer("dllm.task=sudoku", "dllm.block_length=8", "dllm.diffusion_steps=8")
    collect, seen = tr.family.collect, []
    tr.family.collect = lambda: seen.append(collect()) or seen[-1]
    before = [p.detach().clone() for p in tr.params]
    row = tr.step()
    ((ro, _),) = seen
    assert row["iteration"] == 1
    assert row["reward"] == pytest.approx(float(ro.rewards.mean()))
    assert row["rewards/cell_accuracy/mean"] == pytest.approx(float(ro.reward_components["cell_accuracy"].mean()))
    zero_std = [float(ro.rewards[ro.group_ids == g].std()) == 0 for g in ro.group_ids.unique()]
    assert row["frac_reward_zero_std"] == sum(zero_std) / len(zero_std)
    assert row["first_epoch/trained_tokens"] == int(ro.selected.sum()) > 0
    rows = int(ro.selected.any(1).sum()) * ro.traj.masks.shape[1]  # trained rows × mask samples
    assert row["forwards_grad"] == row["sample_backwards"] == rows and row["forwards_nograd"] == 0
    assert row["skipped_updates"] == 0 and row["grad_norm"] > 0
    # one AdamW step moves a weight by about lr
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(before, tr.params))
    assert 0.5 * tr.cfg.train.lr < moved < 1.5 * tr.cfg.train.lr
    counters = dict(tr.policy.counters)
    ev, images = tr.evaluate()
    assert images is None and 0 <= ev["eval/accuracy"] <= 1 and "eval/rewards/cell_accuracy/mean" in ev
    assert tr.policy.counters == counters  # evaluation is not training cost


def test_interrupted_run_resumes_bit_for_bit(tmp_path):
    """Stopped after iteration 2 and resumed, a dLLM run ends with the uninterrupted run's weights: the checkpoint
    restores the sampler's and the mask estimator's streams with the trainer's (SML draws its strata there too)."""
    common = ["dllm.task=sudoku", "dllm.block_length=8", "dllm.diffusion_steps=8", "train.num_iterations=4",
              "eval.every=0", "train.save_every=0", "train.lr=3e-3", "dllm.method=coupled_grpo",
              "daca.likelihood=sml", "daca.sml_partition=random"]
    ref = make_dllm_trainer(*common, f"log.output_dir={tmp_path / 'ref'}")
    ref.train()
    train_stopped_after(make_dllm_trainer(*common, f"log.output_dir={tmp_path / 'run'}"), 2)
    again = make_dllm_trainer(*common, f"log.output_dir={tmp_path / 'run'}")
    again.train(resume=True)
    assert again.iteration == 4
    flat = lambda t: torch.cat([p.detach().flatten() for p in t.params])  # noqa: E731
    assert not torch.equal(flat(ref), flat(make_dllm_trainer(*common)))  # the run did train
    assert torch.equal(flat(again), flat(ref))


def test_policy_state_dict_saves_with_tied_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    pol = MaskedLMPolicy(tiny_bert(len(VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32), vocab=VOCAB)
    save_file(pol.state_dict(), str(tmp_path / "w.safetensors"))
    other = MaskedLMPolicy(tiny_bert(len(VOCAB), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32), vocab=VOCAB)
    other.load_state_dict(load_file(str(tmp_path / "w.safetensors")))
    ids = torch.randint(0, len(VOCAB), (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(pol(ids), other(ids))


def _marginal_prob(tr, token_id):
    """Mean probability of ``token_id`` at the fully masked completion positions, over the train prompts."""
    fam = tr.family
    ex = fam.task.instances("train")[:32]
    ids = VOCAB.encode_prompts([e.prompt for e in ex], fam.task.prompt_length)
    x = torch.cat([ids, torch.full((len(ex), fam.gen_length), VOCAB.mask_id)], 1)
    with torch.no_grad():
        p = torch.softmax(tr.policy(x)[:, -fam.gen_length:], -1)[..., token_id]
    return float(p.mean())


@pytest.mark.parametrize("method,sign", [("diffu_grpo", 1.0), ("diffu_grpo", -1.0), ("coupled_grpo", 1.0),
                                         ("random_mask", 1.0)])
def test_grpo_steps_move_a_rewarded_token_in_the_reward_direction(method, sign):
    """Synthetic reward = ±(number of '7' in the completion): a few GRPO steps must raise (lower) p('7')."""
    tr = make_dllm_trainer(f"dllm.method={method}", "train.lr=3e-3", "train.prompts_per_batch=4",
                           "train.group_size=8", "dllm.p_mask_prompt=0.0")
    seven = VOCAB.index["7"]
    fam = tr.family

    def rewards(texts, examples):
        return {"reward": torch.tensor([sign * t.count("7") for t in texts], dtype=torch.float32),
                "correct": torch.zeros(len(texts))}

    fam.task.rewards = rewards
    ro = tr.rollout()
    # the rewards belong to the decoded completions they were computed from
    assert torch.equal(ro.rewards, rewards([VOCAB.decode(c) for c in ro.traj.sequences[:, -fam.gen_length:]], None)["reward"])
    assert ro.rewards.std() > 0
    before = _marginal_prob(tr, seven)
    for _ in range(4):
        tr.step()
    after = _marginal_prob(tr, seven)
    assert (after - before) * sign > 0.25 * before, (before, after)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_likelihood_at_rollout_temperature_matches_sampler_log_probs(temperature):
    """Scoring each committed token with the chain masks of its decode step, at the rollout temperature,
    reproduces the sampler's own log-prob of that token (the likelihood is of the sampled distribution)."""
    torch.manual_seed(0)
    net = tiny_bert(len(VOCAB), max_positions=14, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64)
    pol = MaskedLMPolicy(net, vocab=VOCAB)
    prompts = VOCAB.encode_prompts(["12+7=", "3-4="], 6)
    smp = masked.sample(pol, prompts, mask_id=VOCAB.mask_id, gen_length=8, block_length=4, steps=8,
                        temperature=temperature, generator=torch.Generator().manual_seed(0))
    m, w = likelihood.stratified(2, 6, 8, strata=smp.commit_step, num_strata=8, chain=True)
    with torch.no_grad():
        lp = likelihood.token_log_probs(pol, smp.sequences, m, w, VOCAB.mask_id, temperature=temperature)
        lp1 = likelihood.token_log_probs(pol, smp.sequences, m, w, VOCAB.mask_id)
        # reference, one forward per token: the sequence with every token committed at or after its step masked,
        # <mask> removed from the logits, log-softmax of logits / t
        P, done = 6, smp.commit_step  # (2, 8)
        ref = {t: torch.empty(2, 8) for t in (temperature, 1.0)}
        for b in range(2):
            for j in range(8):
                ids = smp.sequences[b].clone()
                ids[P:][done[b] >= done[b, j]] = VOCAB.mask_id
                z = pol(ids[None])[0, P + j].float()
                z[VOCAB.mask_id] = float("-inf")
                for t in ref:
                    ref[t][b, j] = torch.log_softmax(z / t, -1)[smp.sequences[b, P + j]]
    torch.testing.assert_close(smp.step_log_prob, ref[temperature], atol=1e-4, rtol=0)
    torch.testing.assert_close(lp, ref[temperature], atol=1e-4, rtol=0)
    torch.testing.assert_close(lp1, ref[1.0], atol=1e-4, rtol=0)  # without the temperature: the T = 1 likelihood


def test_dllm_clip_range_has_its_own_key():
    """Token ratios clip at dllm.clip_range (d1's 0.2 by default); the flow key loss.clip_range is refused."""
    assert make_dllm_trainer().family.ctx.clip_range == 0.2
    tr = make_dllm_trainer("dllm.clip_range=0.3")
    assert tr.family.ctx.clip_range == 0.3
    ro = tr.rollout()
    tr.optimizer.zero_grad(set_to_none=True)
    ro.traj.log_probs = ro.traj.log_probs - 0.25  # every ratio exp(0.25) = 1.28: inside 0.3, outside 0.2
    assert tr.family.backward(ro, 1).metrics["clip_ratio"] == 0.0
    tr.family.ctx.clip_range = 0.2
    assert tr.family.backward(ro, 1).metrics["clip_ratio"] == 1.0
    with pytest.raises(ConfigError, match="loss.clip_range: does not apply to model.name=tiny_mlm"):
        RunConfig.from_overrides([*TINY_DLLM, "loss.clip_range=0.3"])


def test_score_averages_samples_per_prompt_and_is_not_training_cost():
    """eval_samples > 1 decodes every prompt that many times (seeded) and averages; greedy repeats are identical;
    the policy's forward counters are left as they were."""
    tr = make_dllm_trainer("dllm.eval_temperature=1.0", "dllm.eval_samples=3")
    fam = tr.family
    ex = fam.task.instances("test")[:4]
    before = dict(tr.policy.counters)
    one = fam.score(ex, temperature=0.0, samples=1, seed=5)
    three = fam.score(ex, temperature=0.0, samples=3, seed=5)
    assert one == three  # greedy: every repeat decodes the same completion
    assert tr.policy.counters == before
    calls = []
    orig = fam.generate
    fam.generate = lambda e, **kw: calls.append(len(e)) or orig(e, **kw)
    ev, _ = tr.evaluate()
    assert calls == [3 * 8] and 0 <= ev["eval/accuracy"] <= 1  # eval_size 8 prompts × 3 samples
    a = fam.score(ex, temperature=1.0, samples=3, seed=5)
    assert a == fam.score(ex, temperature=1.0, samples=3, seed=5)  # seeded
