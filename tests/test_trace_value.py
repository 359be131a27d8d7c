"""``dllm.trace_value``: TraceRL's value network (``diffgrpo.dllm.trace_critic``) and its step-level GAE
(``diffgrpo.dllm.trace_value``), against a hand computation and a re-derivation of the released
``compute_returns_and_advantages_from_fragments`` (Gen-Verse/dLLM-RL, ``train/train_sdar_value.py``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from diffgrpo.dllm.trace_critic import TraceCritic
from diffgrpo.dllm.trace_rl import trace_masks
from diffgrpo.dllm.trace_value import clipped_value_loss, returns_and_advantages
from diffgrpo.errors import ConfigError
from diffgrpo.types import EngineStats
from tests.helpers.interrupt import train_stopped_after

F64 = torch.float64


# ---------------------------------------------------------------------- the math
def test_advantages_match_a_hand_computation():
    """One row: steps 0, 2, 1, 2 on four trained tokens (a fifth not trained), γ = 0.9, λ = 0.5, reward 2."""
    cs = torch.tensor([[0, 2, 1, 2, 1]])
    trained = torch.tensor([[True, True, True, True, False]])
    V = torch.tensor([[0.5, 1.0, -0.2, 3.0, 7.0]], dtype=F64)
    g, lam, r = 0.9, 0.5, 2.0
    # step means: V*0 = 0.5, V*1 = -0.2 (token 4 is not trained), V*2 = (1 + 3) / 2 = 2; reward on step 2 tokens
    v0, v1, v2 = 0.5, -0.2, 2.0
    A2 = r - v2  # δ*2 (nothing after the last step)
    A1 = (0 - v1 + g * v2) + g * lam * A2
    R_exp = [g * g * r, r, g * r, r, 0.0]
    A_exp = [0 - 0.5 + g * v1 + g * lam * A1, r - 1.0, 0 - (-0.2) + g * v2 + g * lam * A2, r - 3.0, 0.0]
    R, A = returns_and_advantages(cs, trained, V, torch.tensor([r]), g, lam)
    torch.testing.assert_close(R, torch.tensor([R_exp], dtype=F64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(A, torch.tensor([A_exp], dtype=F64), rtol=1e-12, atol=1e-12)
    assert v0 == V[0, 0]


def released_fragments(step_map, trained, V, reward, gamma, lam):
    """Re-derived per sequence as the released loops: distinct trained steps in order, the reward on the last
    step's tokens, step means of r and V, backward R*, δ*, A*, then each token's R_j and A_j."""
    B, L = step_map.shape
    R_out, A_out = torch.zeros(B, L, dtype=F64), torch.zeros(B, L, dtype=F64)
    for s in range(B):
        tm = trained[s] & (step_map[s] >= 0)
        last = int(step_map[s][tm].max())
        r = torch.zeros(L, dtype=F64)
        r[(step_map[s] == last) & tm] = reward[s]
        uniq = torch.unique(step_map[s][tm], sorted=True).tolist()
        S = len(uniq)
        rs = [float(r[(step_map[s] == u) & tm].mean()) for u in uniq]
        vs = [float(V[s][(step_map[s] == u) & tm].mean()) for u in uniq]
        Rs, As = [0.0] * S, [0.0] * S
        for i in range(S - 1, -1, -1):
            Rs[i] = rs[i] + (gamma * Rs[i + 1] if i + 1 < S else 0.0)
        delta = [rs[i] - vs[i] + gamma * (vs[i + 1] if i + 1 < S else 0.0) for i in range(S)]
        for i in range(S - 1, -1, -1):
            As[i] = delta[i] + (gamma * lam * As[i + 1] if i + 1 < S else 0.0)
        for j in torch.nonzero(tm).flatten().tolist():
            i = uniq.index(int(step_map[s, j]))
            nxt = i + 1 < S
            R_out[s, j] = r[j] + gamma * (Rs[i + 1] if nxt else 0.0)
            A_out[s, j] = (r[j] - V[s, j]) + gamma * (vs[i + 1] if nxt else 0.0) + gamma * lam * (As[i + 1] if nxt
                                                                                                    else 0.0)
    return R_out, A_out


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.0), (0.95, 0.7)])
def test_advantages_match_the_released_recursion(gamma, lam):
    """Identical tensors through the vectorised form and the released per-sequence loops; γ = λ = 1 gives its
    stated check A = r − V (R = r), λ = 0 its A = r − V + V*_next."""
    g = torch.Generator().manual_seed(3)
    B, L = 5, 12
    cs = torch.randint(0, 9, (B, L), generator=g)
    cs[1, 7:] = -1  # never committed
    trained = torch.rand(B, L, generator=g) > 0.2
    trained[:, 0] = True
    V = torch.randn(B, L, generator=g, dtype=F64)
    reward = torch.randn(B, generator=g, dtype=F64)
    R, A = returns_and_advantages(cs, trained, V, reward, gamma, lam)
    R_ref, A_ref = released_fragments(cs, trained, V, reward, gamma, lam)
    torch.testing.assert_close(R, R_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(A, A_ref, rtol=1e-12, atol=1e-12)
    on = trained & (cs >= 0)
    if gamma == lam == 1.0:
        torch.testing.assert_close(A[on], (reward.unsqueeze(1) - V).expand(B, L)[on], rtol=1e-12, atol=1e-12)


def tiny_block_policy(seed=0, P=4, L=8, block=4):
    from diffgrpo.models.hf_masked_lm import MaskedLMPolicy
    from diffgrpo.models.tiny_block import tiny_block_lm
    from diffgrpo.tasks import VOCAB

    torch.manual_seed(seed)
    net = tiny_block_lm(len(VOCAB), max_positions=P + L, block_size=block, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64)
    return MaskedLMPolicy(net, vocab=VOCAB, block_size=block), VOCAB


def test_value_loss_decreases_on_a_fixed_batch_and_forwards_are_counted():
    """Twenty value steps on one fixed rollout lower the clipped value loss; each update's forwards are counted in
    the policy's counters (one per block-row with a scored token)."""
    pol, vocab = tiny_block_policy()
    g = torch.Generator().manual_seed(0)
    B, P, L = 3, 4, 8
    seq = torch.randint(4, len(vocab), (B, P + L), generator=g)
    cs = torch.stack([torch.randperm(L, generator=g) for _ in range(B)])  # one token per step
    masks, w = trace_masks(cs, P, 1)
    ret = torch.randn(B, L, generator=g)
    d = SimpleNamespace(clip_range=0.2, trace_gamma=1.0, trace_lambda=1.0)
    critic = TraceCritic(pol, d, lr=3e-3, max_grad_norm=1.0)
    with torch.no_grad():
        old = critic.values(seq, masks, w)
    assert old.abs().max() == 0  # the zero head
    traj = SimpleNamespace(sequences=seq, masks=masks, mask_weights=w,
                           records={"commit_step": cs, "value_old": old, "value_return": ret,
                                    "value_advantage": ret - old})
    ro = SimpleNamespace(traj=traj, trained=torch.ones(B, L, dtype=torch.bool))
    before = dict(pol.counters)
    losses = [critic.update(ro, EngineStats())["value_loss"] for _ in range(20)]
    rows = sum(int(w[:, :, s:s + 4].ne(0).any(-1).sum()) for s in range(0, L, 4))  # block-rows per update
    assert pol.counters["forwards_grad"] - before["forwards_grad"] == 20 * rows
    assert losses[-1] < 0.8 * losses[0], losses
    with torch.no_grad():
        v = critic.values(seq, masks, w)
    full = clipped_value_loss(v, old, ret, 0.2).mean()
    assert full < 0.5 * float((ret ** 2).mean())  # the loss at V = 0


# ---------------------------------------------------------------------- through the trainer and the command line
COMMON = ["model.name=tiny_block", "dllm.method=trace_rl", "pretrain.steps=10", "pretrain.batch_size=8",
          "train.prompts_per_batch=2", "train.group_size=3", "log.progress=false", "log.save_images=false",
          "dllm.eval_size=4", "dllm.temperature=1.0", "eval.every=0", "train.lr=3e-3"]


def trainer(tmp_path, name, *more):
    from diffgrpo import RunConfig, Trainer

    cfg = RunConfig.from_overrides([*COMMON, *more, f"log.output_dir={tmp_path / name}",
                                    f"model.cache_dir={tmp_path / 'c'}"])
    tr = Trainer(cfg, log=lambda *a: None)
    scored = tr.family.rewards  # a reward that differs inside every group
    tr.family.rewards = lambda texts, ex: {**scored(texts, ex), "reward": torch.arange(len(texts)).float() % 3}
    return tr


def test_value_on_first_update_equals_off_bitwise(tmp_path):
    """With γ = λ = 1 and the zero head, the first update's per-token advantage is the group-normalised reward:
    the policy's gradient with the value network equals today's trace_rl bit for bit; off keeps no value state."""
    grads = {}
    for v in ("off", "on"):
        tr = trainer(tmp_path, v, f"dllm.trace_value={v}")
        ro = tr.family.rollout()
        assert ("value_advantage" in ro.traj.records) == (v == "on")
        assert (tr.family.extra_state() is None) == (v == "off")
        for p in tr.params:
            p.grad = None
        stats = tr.family.backward(ro, 0)
        grads[v] = torch.cat([p.grad.flatten() for p in tr.params])
        if v == "on":
            assert stats.metrics["value_loss"] > 0 and stats.forwards_grad > 0
            rec = ro.traj.records
            sel = ro.trained
            assert torch.equal(rec["value_advantage"][sel], ro.advantages.unsqueeze(1).expand_as(sel)[sel].float())
    assert grads["off"].abs().sum() > 0
    assert torch.equal(grads["on"], grads["off"])


def varied_rewards(monkeypatch):
    """Every command-line run in this process scores with a reward that differs inside each group (the briefly
    pretrained model answers nothing right), so the value network has returns to fit."""
    from diffgrpo.dllm.family import DLLMFamily

    scored = DLLMFamily.rewards
    monkeypatch.setattr(DLLMFamily, "rewards", lambda self, texts, ex: {
        **scored(self, texts, ex), "reward": torch.tensor([float(len(t) % 3) for t in texts])})


def test_cli_train_runs_and_resume_restores_the_value_network_bitwise(tmp_path, monkeypatch):
    """`diffgrpo train … dllm.trace_value=on` runs to the end and checkpoints the value network
    (family.safetensors); stopped after iteration 2 and resumed, the run ends with the uninterrupted run's value
    network and optimizer moments, bit for bit."""
    from diffgrpo.cli.app import main

    varied_rewards(monkeypatch)

    more = ["dllm.trace_value=on", "train.num_iterations=4", "train.save_every=1", "dllm.trace_gamma=0.9",
            "dllm.trace_lambda=0.8"]
    assert main(["train", *COMMON, *more, f"log.output_dir={tmp_path / 'ref'}",
                 f"model.cache_dir={tmp_path / 'c'}"]) == 0
    ref = load_file(str(tmp_path / "ref" / "checkpoints" / "iter_000004" / "family.safetensors"))
    assert any(k.startswith("opt.") for k in ref) and ref["net.head.weight"].abs().sum() > 0  # trained
    from diffgrpo import RunConfig, Trainer

    cfg = RunConfig.from_overrides([*COMMON, *more, f"log.output_dir={tmp_path / 'run'}",
                                    f"model.cache_dir={tmp_path / 'c'}"])
    train_stopped_after(Trainer(cfg, log=lambda *a: None), 2)
    assert main(["train", *COMMON, *more, f"log.output_dir={tmp_path / 'run'}", f"model.cache_dir={tmp_path / 'c'}",
                 "--resume", str(tmp_path / "run")]) == 0
    got = load_file(str(tmp_path / "run" / "checkpoints" / "iter_000004" / "family.safetensors"))
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("over,key", [(["dllm.method=diffu_grpo"], "dllm.method=trace_rl"),
                                      (["model.name=tiny_mlm"], "model.name=tiny_block"),
                                      (["dist.mode=fsdp2"], "dist.mode must be")])
def test_refused_in_one_line_where_it_cannot_work(over, key):
    from diffgrpo import RunConfig
    from diffgrpo.validation import validate

    base = ["model.name=tiny_block", "dllm.method=trace_rl", "dllm.trace_value=on"]
    with pytest.raises(ConfigError) as e:
        validate(RunConfig.from_overrides([*base, *over]))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("dllm.trace_value: value on") and key in msg, msg
