"""Learning-rate schedules, the metrics row, and micro-batched sampling (sampler.batch_size, eval.batch_size)."""
import math

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.errors import ConfigError
from diffgrpo.trainer import lr_factor
from tests.helpers.tensors import flat_grad, rel_err


def test_lr_factor_shapes():
    assert [lr_factor(u, "constant", 0, 10) for u in range(10)] == [1.0] * 10
    assert [lr_factor(u, "linear", 2, 6) for u in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    cos = [lr_factor(u, "cosine", 0, 4) for u in range(4)]
    assert cos[0] == 1.0 and math.isclose(cos[2], 0.5) and cos == sorted(cos, reverse=True)
    assert lr_factor(99, "cosine", 0, 4) == 0.0  # past the end (a resume with fewer iterations)


def test_schedule_keys_validated_and_shared_by_families():
    with pytest.raises(ConfigError, match="train.lr_schedule"):
        RunConfig.from_overrides(["train.lr_schedule=exp"])
    with pytest.raises(ConfigError, match="train.warmup_iterations"):
        RunConfig.from_overrides(["train.warmup_iterations=-1"])
    RunConfig.from_overrides(["model.name=tiny_mlm", "train.lr_schedule=cosine", "train.warmup_iterations=2"])
    with pytest.raises(ConfigError, match="eval.batch_size"):
        RunConfig.from_overrides(["model.name=tiny_mlm", "eval.batch_size=4"])


def test_schedule_drives_the_optimizer_and_the_metrics_row(make_trainer):
    tr = make_trainer("train.lr_schedule=cosine", "train.warmup_iterations=1", "train.num_iterations=3",
                      "train.num_inner_epochs=2", "train.lr=0.01")
    lrs = []
    for _ in range(3):
        row = tr.step()
        lrs.append(row["learning_rate"])
        assert math.isfinite(row["loss"]) and "rewards/jpeg_incompressibility/std" in row
    assert lrs == [0.01 * lr_factor(u, "cosine", 2, 6) for u in (0, 2, 4)]
    assert lrs[0] == 0.005


def test_constant_schedule_is_todays_adamw(make_trainer):
    """The default schedule keeps the learning rate exactly at train.lr (and so the old updates, bit for bit)."""
    tr = make_trainer("train.lr=0.003")
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in tr.params], lr=0.003)
    for _ in range(2):
        row = tr.step()
        assert row["learning_rate"] == 0.003
    assert tr.optimizer.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


def test_scheduler_state_in_checkpoint_and_resume_with_new_lr(make_trainer, tmp_path):
    from diffgrpo.run.checkpoint import load_checkpoint, save_checkpoint, set_base_lr
    tr = make_trainer("train.lr_schedule=linear", "train.num_iterations=4", "train.lr=0.01")
    tr.step()
    tr.step()
    st = tr.state()
    ck = save_checkpoint(tmp_path, 2, trainable=st.trainable, optimizer=st.optimizer, rng=st.rng,
                         config={}, extra=st.extra)
    loaded = load_checkpoint(ck)  # weights_only=True
    tr2 = make_trainer("train.lr_schedule=linear", "train.num_iterations=4", "train.lr=0.01")
    loaded.iteration = 2
    tr2.load_state(loaded)
    assert tr2.scheduler.last_epoch == 2 and tr2.optimizer.param_groups[0]["lr"] == tr.optimizer.param_groups[0]["lr"]
    set_base_lr(tr2.optimizer, tr2.scheduler, 0.02)  # what a resume with train.lr=0.02 does
    assert tr2.optimizer.param_groups[0]["lr"] == 0.02 * lr_factor(2, "linear", 0, 4)
    tr2.scheduler.step()
    assert tr2.optimizer.param_groups[0]["lr"] == 0.02 * lr_factor(3, "linear", 0, 4)


def _rollout_with(make_trainer, batch_size, *overrides):
    tr = make_trainer("train.prompts_per_batch=3", "train.group_size=3", f"sampler.batch_size={batch_size}",
                      *overrides)
    torch.manual_seed(0)
    return tr, tr.family._rollout(tr.family.plan())


def test_chunked_rollout_draws_the_same_noise(make_trainer):
    """Chunks of rows draw the step noise once for the whole batch: identical draws; the states agree to float
    rounding (CPU matmuls of 4 and of 9 rows do not sum in the same order)."""
    _, a = _rollout_with(make_trainer, 0)
    _, b = _rollout_with(make_trainer, 4)
    assert torch.equal(a.traj.noise, b.traj.noise)
    assert torch.equal(a.traj.xs[:, 0], b.traj.xs[:, 0])
    assert torch.allclose(a.traj.xs, b.traj.xs, atol=1e-5) and torch.allclose(a.traj.log_probs, b.traj.log_probs,
                                                                               atol=1e-5)
    _, c = _rollout_with(make_trainer, 9)  # one chunk = the unchunked loop, bit for bit
    assert torch.equal(a.traj.xs, c.traj.xs) and torch.equal(a.traj.log_probs, c.traj.log_probs)


@pytest.mark.parametrize("engine", [["engine.name=retain"], ["engine.name=reweight", "loss.beta=0.1"],
                                    ["engine.name=jagg", "engine.evaluation=retain", "engine.window=2"]],
                         ids=lambda e: e[0].split("=")[1])
def test_chunked_rollout_gradient_matches_unchunked(make_trainer, engine):
    grads = []
    for bs in (0, 2):
        tr, ro = _rollout_with(make_trainer, bs, *engine)
        tr.optimizer.zero_grad(set_to_none=True)
        tr.family.backward(ro, 0)
        grads.append(flat_grad(tr.params))
    assert grads[0].norm() > 0
    assert rel_err(grads[1], grads[0]) < 1e-6


def test_chunked_evaluation_matches_and_caps_images(make_trainer):
    row0, im0 = make_trainer().evaluate()
    row1, im1 = make_trainer("eval.batch_size=3").evaluate()
    assert row0.keys() == row1.keys()
    assert all(math.isclose(row0[k], row1[k], rel_tol=1e-5, abs_tol=1e-6) for k in row0)
    assert torch.allclose(im0, im1, atol=1e-5)
    row2, im2 = make_trainer("eval.batch_size=64").evaluate()  # one chunk: the unchunked path
    assert row2 == row0 and torch.equal(im2, im0)


def _eval_peak(make_trainer, tmp_path, n_prompts):
    """Peak bytes of CPU tensors allocated during one evaluation and alive together (torch profiler records)."""
    from torch.profiler import ProfilerActivity, profile
    f = tmp_path / f"p{n_prompts}.txt"
    f.write_text("".join(f"a picture of the digit {i % 10}\n" for i in range(n_prompts)))
    tr = make_trainer(f"eval.prompts_file={f}", "eval.batch_size=4", "eval.seeds_per_prompt=4")
    tr.evaluate()  # warm-up (lazily built reward models)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tr.evaluate()
    live = peak = 0  # each op's own (self) allocations net of frees, and the unattributed records, in time order
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.slow  # a minute of evaluations at several prompt counts
def test_evaluation_memory_does_not_grow_with_prompts(make_trainer, tmp_path):
    small, big = _eval_peak(make_trainer, tmp_path, 4), _eval_peak(make_trainer, tmp_path, 64)
    print(f"eval peak bytes: 4 prompts {small}, 64 prompts {big}, ratio {big / small:.3f}")
    assert big / small < 1.5
