"""Masked-LM rollouts: confidence-threshold parallel decoding and key/value caches across denoising steps.

Invariants checked against independent references: the threshold decoder's commits re-derived from fresh
forwards of each step's state; its log-probs against one forward per token; a cached step on an unchanged
sequence against the full forward; a cache rebuilt every step (and any cache on a one-layer model, whose
keys/values are functions of token and position only) against no cache; the likelihood estimators against the
decoder that produced the completions.
"""
from __future__ import annotations

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.dllm import likelihood
from diffgrpo.dllm.grpo import METHODS
from diffgrpo.errors import ConfigError
from diffgrpo.models.hf_masked_lm import MaskedLMPolicy, load_hf_masked_lm, tiny_bert
from diffgrpo.models.kv_cache import KVCache
from diffgrpo.samplers import masked
from diffgrpo.tasks import VOCAB
from tests.helpers.remote_models import SPECIALS, build_remote_model
from tests.helpers.tiny import decoding_dllm_trainer

RECORDS = ("commit_step", "block_rank", "order")
FLOAT_RECORDS = ("confidence", "entropy", "margin", "step_log_prob")


def _policy(layers=2, seed=0, init=0.02, positions=20, shift=False):
    torch.manual_seed(seed)
    net = tiny_bert(len(VOCAB), max_positions=positions, hidden_size=32, num_hidden_layers=layers,
                    num_attention_heads=2, intermediate_size=64, initializer_range=init)
    return MaskedLMPolicy(net, vocab=VOCAB, logits_shift=shift)


def _prompts():
    return VOCAB.encode_prompts(["12+7=", "3-4=", "9+9=", "1="], 6)  # (4, 6), left-padded


def _same(a: masked.MaskedSample, b: masked.MaskedSample, atol=1e-5):
    assert torch.equal(a.sequences, b.sequences)
    for k in RECORDS:
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    for k in FLOAT_RECORDS:
        torch.testing.assert_close(getattr(a, k), getattr(b, k), atol=atol, rtol=0, msg=k)
    assert a.num_steps == b.num_steps


# ---------------------------------------------------------------------------------------------- threshold decoding
@pytest.mark.parametrize("block_length", [12, 4])
def test_threshold_commits_every_token_above_threshold_and_at_least_the_most_confident(block_length):
    pol = _policy(init=0.3)  # confident enough that several tokens pass the threshold at some steps
    prompts, P, L, thr = _prompts(), 6, 12, 0.3
    smp = masked.sample(pol, prompts, mask_id=VOCAB.mask_id, gen_length=L, block_length=block_length, steps=L,
                        decode="threshold", threshold=thr)
    assert (smp.commit_step >= 0).all()  # every completion token committed
    for b in range(prompts.shape[0]):
        assert sorted(smp.order[b].tolist()) == list(range(L))  # ... exactly once
    several = 0
    for s in range(smp.num_steps):
        state = smp.sequences.clone()
        state[:, P:][smp.commit_step >= s] = VOCAB.mask_id  # the sequence as step s saw it
        with torch.no_grad():
            p = torch.softmax(masked.token_logits(pol(state)[:, P:], VOCAB.mask_id), -1)  # (B, L, V)
        conf = p.max(-1).values  # (B, L) argmax confidence (T = 0)
        for b in range(prompts.shape[0]):
            done = smp.commit_step[b] < s
            blk = int(smp.commit_step[b].eq(s).nonzero()[0]) // block_length if smp.commit_step[b].eq(s).any() \
                else None
            if blk is None:  # this row's block was finished; it waits for the others
                assert done[(torch.arange(L) // block_length) == int(done.sum()) // block_length - 1].all()
                continue
            cand = (~done) & (torch.arange(L) // block_length == blk)
            want = cand & (conf[b] >= thr)
            want[torch.where(cand, conf[b], torch.tensor(-1.0)).argmax()] = True
            assert torch.equal(smp.commit_step[b] == s, want), (s, b)
            assert torch.equal(smp.sequences[b, P:][want], p[b].argmax(-1)[want])
            torch.testing.assert_close(smp.confidence[b][want], conf[b][want], atol=1e-5, rtol=0)
            several += int(want.sum()) > 1
    assert several > 0  # the test saw parallel commits
    assert smp.forwards < prompts.shape[0] * L  # rows whose block is done are not forwarded


def test_threshold_one_is_the_one_token_per_step_schedule():
    """No probability reaches 1, so the threshold decoder commits exactly the most confident token per step:
    LLaDA's sampler at steps = gen_length."""
    pol = _policy()
    kw = {"mask_id": VOCAB.mask_id, "gen_length": 12, "block_length": 4, "steps": 12, "temperature": 0.0}
    a = masked.sample(pol, _prompts(), decode="threshold", threshold=1.0, **kw)
    b = masked.sample(pol, _prompts(), **kw)
    _same(a, b)
    assert a.forwards == b.forwards == 4 * 12


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_threshold_log_probs_are_the_chain_likelihood_of_its_steps(cache):
    """At T > 0 the threshold decoder's log-prob of each committed token is log softmax(logits / T) given the
    tokens committed before its step (one forward per token, independent of the sampler); with the cache rebuilt
    every step the cached path agrees too. The chain likelihood with strata = commit steps reproduces it."""
    pol, T, P = _policy(init=0.3), 0.7, 6
    kv = None if cache == "none" else KVCache(pol, cache, prompt_length=P, gen_length=8)
    smp = masked.sample(pol, _prompts()[:2], mask_id=VOCAB.mask_id, gen_length=8, block_length=4, steps=8,
                        temperature=T, decode="threshold", threshold=0.2, cache=kv, cache_refresh=1,
                        generator=torch.Generator().manual_seed(0))
    ref = torch.empty(2, 8)
    with torch.no_grad():
        for b in range(2):
            for j in range(8):
                ids = smp.sequences[b].clone()
                ids[P:][smp.commit_step[b] >= smp.commit_step[b, j]] = VOCAB.mask_id
                z = masked.token_logits(pol(ids[None])[0, P + j].float(), VOCAB.mask_id)
                ref[b, j] = torch.log_softmax(z / T, -1)[smp.sequences[b, P + j]]
        m, w = likelihood.stratified(2, P, 8, strata=smp.commit_step, num_strata=smp.num_steps, chain=True)
        lp = likelihood.token_log_probs(pol, smp.sequences, m, w, VOCAB.mask_id, temperature=T)
    torch.testing.assert_close(smp.step_log_prob, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)


def test_forwards_are_counted_and_threshold_spends_fewer():
    pol = _policy(init=0.3)
    kw = {"mask_id": VOCAB.mask_id, "gen_length": 12, "block_length": 12, "steps": 12}
    before = pol.counters["forwards_nograd"]
    a = masked.sample(pol, _prompts(), **kw)
    mid = pol.counters["forwards_nograd"]
    b = masked.sample(pol, _prompts(), decode="threshold", threshold=0.3, **kw)
    assert a.forwards == mid - before == 4 * 12 and a.query_tokens == a.forwards * 18
    assert b.forwards == pol.counters["forwards_nograd"] - mid < a.forwards  # finished rows are not forwarded
    c = masked.sample(pol, _prompts(), cache=KVCache(pol, "dual", prompt_length=6, gen_length=12), **kw)
    assert c.forwards == a.forwards and c.query_tokens == 4 * 18 + 4 * 11 * 12  # first step full, then the block


# ---------------------------------------------------------------------------------------------- key/value cache
def _dream_cache_policy(tmp_path, kind="dream_cache"):
    d = build_remote_model(tmp_path / kind, kind, d_model=32, n_heads=2, mlp_hidden=64)
    return load_hf_masked_lm(str(d), trust_remote_code=True, mask_token_id=SPECIALS.index("<|mask|>"))


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("model", ["tiny_bert", "dream_cache"])
def test_cached_step_on_an_unchanged_sequence_is_the_full_forward(model, mode, tmp_path):
    """The exact part of the cache: keys/values of the same sequence, the window computed against them, equals
    the full forward on the window (padding, position ids and the Dream logit shift included), for all rows and
    for a subset of them."""
    pol = _policy(init=0.3) if model == "tiny_bert" else _dream_cache_policy(tmp_path)
    P, L = 6, 12
    x = torch.cat([VOCAB.encode_prompts(["12+7=", "3-4=", "9+9="], P) if model == "tiny_bert" else
                   pol.vocab.encode_prompts(["12+7=", "3-4=", "9+9="], P),
                   torch.full((3, L), pol.mask_id)], 1)
    x[:, P:P + 5] = x[:, P - 5:P]  # some committed tokens in the completion
    kv = KVCache(pol, mode, prompt_length=P, gen_length=L)
    with torch.no_grad():
        full = pol(x)[:, P:]  # (3, L, V)
        for start, end in [(0, 4), (4, 8), (8, 12)]:
            out = kv.begin(x, torch.arange(3), start, end)
            torch.testing.assert_close(out, full, atol=1e-5, rtol=0)
            for rows in (torch.arange(3), torch.tensor([0, 2])):
                got, w0 = kv.step(x, rows)
                assert w0 == start and got.shape[1] == (L - start if mode == "prefix" else end - start)
                torch.testing.assert_close(got, full[rows, w0:w0 + got.shape[1]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("decode", ["schedule", "threshold"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cache_rebuilt_every_step_is_no_cache(decode, mode, temperature):
    pol = _policy(init=0.3)
    kw = {"mask_id": VOCAB.mask_id, "gen_length": 12, "block_length": 4, "steps": 12, "temperature": temperature,
              "decode": decode, "threshold": 0.3}
    a = masked.sample(pol, _prompts(), generator=torch.Generator().manual_seed(0), **kw)
    b = masked.sample(pol, _prompts(), generator=torch.Generator().manual_seed(0),
                      cache=KVCache(pol, mode, prompt_length=6, gen_length=12), cache_refresh=1, **kw)
    _same(a, b)
    assert b.query_tokens == a.query_tokens


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cache_is_exact_for_one_layer_and_approximate_beyond(mode):
    """Layer 0's keys/values depend on token and position only: on a one-layer model the cache changes nothing
    (whatever the refresh). With two layers the stale prefix/suffix changes the logits (the approximation is
    real, measured in benchmarks/dllm_decode.py)."""
    kw = {"mask_id": VOCAB.mask_id, "gen_length": 12, "block_length": 4, "steps": 12, "temperature": 1.0, "decode": "threshold",
              "threshold": 0.3}
    one = _policy(layers=1, init=0.3)
    a = masked.sample(one, _prompts(), generator=torch.Generator().manual_seed(0), **kw)
    b = masked.sample(one, _prompts(), generator=torch.Generator().manual_seed(0),
                      cache=KVCache(one, mode, prompt_length=6, gen_length=12), **kw)
    _same(a, b, atol=1e-4)
    assert b.query_tokens < a.query_tokens
    two = _policy(layers=2, init=0.3)
    P, L = 6, 12
    x = torch.cat([_prompts(), torch.full((4, L), VOCAB.mask_id)], 1)
    kv = KVCache(two, mode, prompt_length=P, gen_length=L)
    with torch.no_grad():
        kv.begin(x, torch.arange(4), 4, 8)
        x[:, P + 4:P + 6] = x[:, P - 2:P]  # the block commits two tokens
        got, w0 = kv.step(x, torch.arange(4))
        full = two(x)[:, P + w0:P + w0 + got.shape[1]]
    assert (got - full).abs().max() > 1e-3


def test_models_without_a_cache_are_refused_in_one_line(tmp_path):
    for kind in ("llada", "dream"):
        pol = _dream_cache_policy(tmp_path, kind)
        with pytest.raises(ConfigError, match=r"^dllm\.kv_cache: value 'prefix' needs a model whose forward fills") \
                as e:
            KVCache(pol, "prefix", prompt_length=4, gen_length=8)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("overrides,key", [
    (["dllm.decode=threshold", "dllm.remasking=random"], "dllm.remasking"),
    (["dllm.decode=threshold", "dllm.diffusion_steps=4"], "dllm.diffusion_steps"),
    (["dllm.decode_threshold=0.5"], "dllm.decode_threshold"),
    (["dllm.cache_refresh=2"], "dllm.cache_refresh"),
    (["dllm.decode=threshold", "dllm.decode_threshold=0"], "dllm.decode_threshold"),
    (["dllm.decode=threshold", "dllm.decode_threshold=1.5"], "dllm.decode_threshold"),
    (["dllm.kv_cache=full"], "dllm.kv_cache"),
])
def test_decoding_keys_are_validated_before_any_model_loads(overrides, key):
    from diffgrpo.validation import validate

    with pytest.raises(ConfigError, match=rf"^{key}") as e:
        validate(RunConfig.from_overrides(["model.name=tiny_mlm", *overrides]))
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- the family
_trainer = decoding_dllm_trainer


@pytest.mark.parametrize("method", sorted(METHODS))
def test_likelihood_estimators_do_not_depend_on_the_decoder(method):
    """The same completions scored by a family that decodes by schedule and by one that decodes by threshold with
    a dual cache (same mask stream) give the same masks and the same ℓ_old and ℓ_ref, whichever decoder produced
    them; the DPS settling weights use the steps the decoder ran."""
    extra = [f"dllm.method={method}", "loss.beta=0.04" if method != "spg" else "loss.beta=0",
             "daca.dps_score=settling"]
    fast = _trainer(*extra, "dllm.decode=threshold", "dllm.decode_threshold=0.3", "dllm.kv_cache=dual")
    slow = _trainer(*extra)
    ro = fast.family.rollout()
    assert ro.traj.token_weights is not None and torch.isfinite(ro.traj.token_weights).all()
    seqs, L = ro.traj.sequences, fast.family.gen_length
    order, steps = ro.traj.records["order"], ro.traj.records["commit_step"]  # trace_rl scores the decoder's own steps
    out = []
    for tr in (fast, slow, fast):
        tr.family.method.gen_masks.manual_seed(5)
        out.append(tr.family.method.score_rollout(seqs, L, order, steps))
    for other in out[1:]:
        for k in ("masks", "log_probs", "ref_log_probs"):
            if out[0][k] is None:
                assert other[k] is None
            else:
                torch.testing.assert_close(other[k], out[0][k], atol=1e-6, rtol=0, msg=k)
    fast.step()  # and a GRPO step trains on the threshold rollout
