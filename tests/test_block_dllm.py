"""Block-diffusion LMs: the built-in block-causal model (``model.name=tiny_block``), its exact cache of finished
blocks, block rollouts of dynamic length, the estimators with the exact clean prefix, and ``dllm.method=trace_rl``."""
from __future__ import annotations

import pytest
import torch

from diffgrpo.dllm import likelihood, trace_rl
from diffgrpo.dllm.block_likelihood import block_forward_log_probs, block_token_log_probs
from diffgrpo.models.block_cache import BlockKVCache
from diffgrpo.models.hf_masked_lm import MaskedLMPolicy, tiny_bert
from diffgrpo.models.tiny_block import block_diffusion_loss, tiny_block_lm, two_stream_keep
from diffgrpo.samplers import masked
from diffgrpo.samplers.block import sample_blocks
from diffgrpo.tasks import VOCAB

B_SIZE, P, L = 4, 8, 8
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def block_policy(seed=0, block_size=B_SIZE, dtype=torch.float32):
    torch.manual_seed(seed)
    net = tiny_block_lm(len(VOCAB), max_positions=P + L, block_size=block_size, **SMALL).to(dtype)
    for p in net.parameters():  # larger weights than the init: sharp, varied logits
        p.data.normal_(0, 0.3)
    pol = MaskedLMPolicy(net, vocab=VOCAB)
    pol.block_size = block_size
    return pol


def prompts():
    return VOCAB.encode_prompts(["1+2=", "33+4=", "7-5=", "9+9="], P)  # (4, P) left-padded


def test_attention_is_causal_across_blocks_and_bidirectional_inside():
    pol = block_policy()
    x = torch.randint(4, len(VOCAB), (2, P + L))
    with torch.no_grad():
        base = pol.logits(x)
    y = x.clone()
    y[:, P + 5] = (y[:, P + 5] + 1) % len(VOCAB)  # a token of completion block 1 (positions P+4 .. P+7)
    with torch.no_grad():
        moved = (pol.logits(y) - base).abs().amax(-1)  # (2, N)
    assert float(moved[:, :P + 4].max()) == 0.0  # earlier blocks do not see it
    assert float(moved[:, P + 4:P + 8].min()) > 0  # every position of its own block does (bidirectional)


def test_two_stream_pretraining_forward_scores_each_block_with_the_clean_prefix():
    """The pretraining forward [x_0 ; x_t] gives noisy block k the logits of the plain forward of
    [clean blocks < k ; noisy block k]."""
    pol = block_policy(1)
    net = pol.model
    g = torch.Generator().manual_seed(0)
    x0 = torch.cat([prompts()[:2], torch.randint(4, len(VOCAB), (2, L), generator=g)], 1)  # (2, N)
    xt = torch.where(torch.rand(2, L, generator=g) < 0.5, torch.full((2, L), VOCAB.mask_id), x0[:, P:])
    pos = torch.cat([torch.arange(P + L), P + torch.arange(L)]).unsqueeze(0)
    keep = two_stream_keep(P, L, B_SIZE, x0 != VOCAB.pad_id)
    two = net(input_ids=torch.cat([x0, xt], 1), attention_mask=keep, position_ids=pos).logits[:, -L:]
    for s in range(0, L, B_SIZE):
        ref = pol.logits(torch.cat([x0[:, :P + s], xt[:, s:s + B_SIZE]], 1))[:, -B_SIZE:]
        torch.testing.assert_close(two[:, s:s + B_SIZE], ref, atol=1e-5, rtol=1e-5)
    loss = block_diffusion_loss(net, x0[:, :P], x0[:, P:], VOCAB.mask_id, VOCAB.pad_id, generator=g)
    assert torch.isfinite(loss) and loss > 0


@pytest.mark.parametrize("decode,temperature", [("schedule", 0.0), ("schedule", 1.0), ("threshold", 1.0)])
def test_block_kv_cache_is_exact(decode, temperature):
    """Cached and uncached block rollouts are equal token for token (and record the same steps and log-probs),
    with dynamic length on; the cache computes fewer positions."""
    pol = block_policy(2)
    out = []
    for cache in (None, BlockKVCache(pol)):
        g = torch.Generator().manual_seed(3)
        out.append(sample_blocks(pol, prompts(), mask_id=VOCAB.mask_id, gen_length=L, block_length=B_SIZE,
                                 steps=L if decode == "schedule" else 0, temperature=temperature, generator=g,
                                 decode=decode, threshold=0.3, cache=cache, eos_id=VOCAB.eos_id))
    plain, cached = out
    assert torch.equal(plain.sequences, cached.sequences)
    assert torch.equal(plain.commit_step, cached.commit_step) and torch.equal(plain.order, cached.order)
    torch.testing.assert_close(plain.step_log_prob, cached.step_log_prob, atol=1e-5, rtol=0)
    assert plain.num_steps == cached.num_steps
    assert cached.query_tokens < plain.query_tokens


def test_block_rollout_stops_each_row_at_its_end_token():
    """A row whose finished block holds <eos> stops: later blocks are <eos> without forwards."""
    V = len(VOCAB)

    def logits_fn(x):  # (n, N) → (n, N, V): row 0 (prompt token 7 first) ends at completion position 1
        out = torch.zeros(x.shape[0], x.shape[1], V)
        out[..., 10] = 5.0
        stop = x[:, 0] == 7
        out[stop, P + 1, VOCAB.eos_id] = 9.0
        return out

    ids = torch.full((2, P), 20)
    ids[0, 0] = 7
    s = sample_blocks(logits_fn, ids, mask_id=VOCAB.mask_id, gen_length=L, block_length=B_SIZE, steps=L,
                      eos_id=VOCAB.eos_id)
    comp = s.completions
    assert comp[0, 1] == VOCAB.eos_id and torch.all(comp[0, B_SIZE:] == VOCAB.eos_id)
    assert torch.all(s.commit_step[0, B_SIZE:] == -1) and torch.all(s.commit_step[1] >= 0)
    assert torch.all(comp[1] == 10)
    assert sorted(s.order[0].tolist()) == list(range(L))  # filled positions come last in the order
    assert s.forwards == 2 * B_SIZE + 1 * B_SIZE  # both rows for block 0, row 1 alone for block 1


def brute_block_log_probs(pol, ids, masks, weights):
    """Per block k, a plain forward of [prompt (masked as m) ; clean completion before k ; block k masked as m]."""
    Bn, M, N = masks.shape
    out = torch.zeros(Bn, M, L)
    for b in range(Bn):
        for m in range(M):
            noisy = torch.where(masks[b, m], torch.full_like(ids[b], VOCAB.mask_id), ids[b])
            for s in range(0, L, B_SIZE):
                x = torch.cat([noisy[:P], ids[b, P:P + s], noisy[P + s:P + s + B_SIZE]]).unsqueeze(0)
                lg = masked.token_logits(pol.logits(x)[0, -B_SIZE:], VOCAB.mask_id)
                lp = torch.log_softmax(lg, -1).gather(-1, ids[b, P + s:P + s + B_SIZE, None]).squeeze(-1)
                out[b, m, s:s + B_SIZE] = lp
    return (out * weights).sum(1)


@pytest.mark.parametrize("estimator", ["mean_field", "coupled", "random_mask"])
def test_block_estimators_score_each_block_with_the_exact_clean_prefix(estimator):
    pol = block_policy(4)
    g = torch.Generator().manual_seed(5)
    ids = torch.cat([prompts(), torch.randint(4, len(VOCAB), (4, L), generator=g)], 1)
    kw = {"p_mask_prompt": 0.3} if estimator == "mean_field" else {}
    masks, weights = likelihood.ESTIMATORS[estimator](4, P, L, generator=g, **kw)
    got = block_token_log_probs(pol, ids, masks, weights, VOCAB.mask_id, B_SIZE)
    torch.testing.assert_close(got, brute_block_log_probs(pol, ids, masks, weights), atol=1e-5, rtol=1e-5)
    if estimator == "mean_field":  # the plain masked forward shows block 1 a masked block 0 instead
        plain = likelihood.token_log_probs(pol, ids, masks, weights, VOCAB.mask_id)
        assert float((plain[:, B_SIZE:] - got[:, B_SIZE:]).abs().max()) > 1e-3
        torch.testing.assert_close(plain[:, :B_SIZE], got[:, :B_SIZE], atol=1e-5, rtol=1e-5)


def test_trace_masks_reproduce_the_samplers_step_log_probs():
    """trace_rl's estimate of a cached block rollout is the sampler's own step log-probs (temperature 1), one
    forward per step; the same holds for the bidirectional masked LM without a cache."""
    pol = block_policy(6)
    g = torch.Generator().manual_seed(7)
    s = sample_blocks(pol, prompts(), mask_id=VOCAB.mask_id, gen_length=L, block_length=B_SIZE, steps=L,
                      temperature=1.0, generator=g, cache=BlockKVCache(pol), eos_id=VOCAB.eos_id)
    masks, w = trace_rl.trace_masks(s.commit_step, P)
    assert masks.shape[1] == s.num_steps == L
    lp = block_token_log_probs(pol, s.sequences, masks, w, VOCAB.mask_id, B_SIZE)
    done = s.commit_step >= 0
    torch.testing.assert_close(lp[done], s.step_log_prob[done], atol=1e-5, rtol=0)
    torch.manual_seed(0)
    mlm = MaskedLMPolicy(tiny_bert(len(VOCAB), max_positions=P + L, **SMALL), vocab=VOCAB)
    s = masked.sample(mlm, prompts(), mask_id=VOCAB.mask_id, gen_length=L, block_length=B_SIZE, steps=4,
                      temperature=1.0, generator=g)
    masks, w = trace_rl.trace_masks(s.commit_step, P)
    assert masks.shape[1] == 4
    torch.testing.assert_close(likelihood.token_log_probs(mlm, s.sequences, masks, w, VOCAB.mask_id),
                               s.step_log_prob, atol=1e-5, rtol=0)
    # shrink 2: two steps per forward, each token scored once
    masks, w = trace_rl.trace_masks(s.commit_step, P, shrink=2)
    assert masks.shape[1] == 2 and torch.all(w.sum(1) == 1)


def test_block_estimate_with_blocks_of_one_token_is_the_autoregressive_likelihood():
    """b = 1: the mean field with the clean prefix is log p(y_j | y_<j) exactly (trace of a one-token-per-block
    rollout)."""
    pol = block_policy(8, block_size=1)
    g = torch.Generator().manual_seed(9)
    s = sample_blocks(pol, prompts(), mask_id=VOCAB.mask_id, gen_length=L, block_length=1, steps=L,
                      temperature=1.0, generator=g, cache=BlockKVCache(pol))
    masks, w = likelihood.mean_field(4, P, L)
    lp = block_forward_log_probs(pol, s.sequences, masks, w, VOCAB.mask_id, 1)[:, 0]
    torch.testing.assert_close(lp, s.step_log_prob, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["trace_rl", "diffu_grpo"])
def test_tiny_block_trains_through_the_trainer(method, tmp_path):
    """model.name=tiny_block (pretrained, cached) runs an iteration of each objective; trace_rl's first update
    starts at ratio 1 (its ℓ_old is the sampler's own)."""
    from diffgrpo import RunConfig, Trainer

    cfg = RunConfig.from_overrides([
        "model.name=tiny_block", f"dllm.method={method}", "pretrain.steps=10", "pretrain.batch_size=8",
        "train.prompts_per_batch=2", "train.group_size=3", "log.progress=false", "log.save_images=false",
        "dllm.eval_size=4", "dllm.temperature=1.0", f"log.output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'c'}"])
    tr = Trainer(cfg, log=lambda *a: None)
    assert tr.policy.block_size == 4 and tr.family.prompt_length % 4 == 0
    scored = tr.family.rewards  # a reward that differs inside every group (the briefly pretrained model is wrong)
    tr.family.rewards = lambda texts, ex: {**scored(texts, ex), "reward": torch.arange(len(texts)).float() % 3}
    row = tr.step()
    assert row["grad_norm"] > 0 and row["skipped_updates"] == 0 and row["first_epoch/trained_tokens"] > 0
    if method == "trace_rl":
        assert row["first_epoch/ratio_max_dev"] < 1e-5


def test_pretrain_builds_the_named_built_in_model_and_refuses_a_hub_model(tmp_path, capsys):
    """`diffgrpo pretrain model.name=tiny_block` caches the block model (it used to pretrain the image model
    instead, silently); a model that is not built in is refused in one line before anything loads."""
    from diffgrpo.cli.app import main

    small = ["pretrain.steps=4", "pretrain.batch_size=4", f"model.cache_dir={tmp_path}", "log.progress=false"]
    assert main(["pretrain", "model.name=tiny_block", "--task", "arithmetic", *small]) == 0
    out = capsys.readouterr().out
    assert "built-in tiny_block model for task 'arithmetic' cached in" in out
    cached = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert len(cached) == 1 and cached[0].startswith("tiny-block-arithmetic-"), cached  # the block model, nothing else
    assert main(["pretrain", "model.name=hf_masked_lm", "dllm.model_path=org/some-llada"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.name: value 'hf_masked_lm' is not a built-in model")


def test_train_export_reload_and_sample_from_the_command_line(tmp_path, capsys):
    """tiny_block through the command line: train → export (the checkpoint holds every weight, so nothing is
    pretrained again: the base's cache is gone by then) → reload with ``AutoModelForCausalLM`` (the exported weights
    are the run's) → ``diffgrpo sample``, whose greedy completions an uncached block rollout of the reloaded model
    reproduces."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from diffgrpo.cli.app import main
    from diffgrpo.models.tiny_block import block_lm_classes, block_prompt_length
    from diffgrpo.tasks import get_task

    run, exp, cache = tmp_path / "run", tmp_path / "exp", tmp_path / "c"
    assert main(["train", "model.name=tiny_block", "pretrain.steps=40", "pretrain.batch_size=16",
                 "train.num_iterations=2", "train.prompts_per_batch=2", "train.group_size=3", "train.save_every=1",
                 "dllm.eval_size=4", "dllm.temperature=1.0", "train.lr=3e-3", "log.progress=false",
                 f"model.cache_dir={cache}", f"log.output_dir={run}"]) == 0
    shutil.rmtree(cache)
    assert main(["export", str(run), "--out", str(exp)]) == 0
    assert not cache.exists()  # built at random init and overwritten by the checkpoint, not pretrained
    block_lm_classes()  # registers the built-in classes with the Auto classes
    net = AutoModelForCausalLM.from_pretrained(str(exp)).eval()
    assert net.config.block_size == 4
    weights = load_file(str(run / "weights.safetensors"))
    assert set(weights) == set(net.state_dict())
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
    prompts = ["1+2=", "13+4=", "7-5="]
    out = tmp_path / "s.txt"
    capsys.readouterr()
    assert main(["sample", "--weights", str(run), "--sde-type", "ode", "--out", str(out),
                 *sum((["--prompt", p] for p in prompts), [])]) == 0
    sampled = [line.split("\t", 1)[1] for line in out.read_text().splitlines()]
    task = get_task("arithmetic")
    pol = MaskedLMPolicy(net, vocab=VOCAB, block_size=4)
    ids = VOCAB.encode_prompts(prompts, block_prompt_length(task.prompt_length, 4))
    s = sample_blocks(pol, ids, mask_id=VOCAB.mask_id, gen_length=task.gen_length, block_length=4,
                      steps=task.gen_length, temperature=0.0, eos_id=VOCAB.eos_id)
    assert [VOCAB.decode(c) for c in s.completions] == sampled
