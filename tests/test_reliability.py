"""Runs that survive: crash/resume, faults, bad input, EMA, the HTML report."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffgrpo.cli.app import main
from diffgrpo.rewards import REWARDS, RewardError
from diffgrpo.run.checkpoint import (
    latest_complete,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from diffgrpo.trainer import TrainingError
from tests.helpers.cli import browser, run_cli
from tests.helpers.tiny import FAST_CLI, TINY_CLI

VOLATILE = ("time/", "peak_memory_bytes")  # wall-clock and allocator readings differ between any two runs


def _stable_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.parametrize("schedule", [pytest.param([], id="constant"),
                                      pytest.param(["train.lr_schedule=cosine", "train.warmup_iterations=2"],
                                                   id="cosine_warmup", marks=pytest.mark.slow)])  # the same path
def test_sigkill_mid_run_then_resume_matches_uninterrupted_run(tmp_path, schedule):
    """Bitwise: on CPU with a fixed thread count every kernel is deterministic, and the checkpoint restores
    weights, optimizer, learning-rate schedule, EMA and every RNG stream exactly, so the resumed run replays the
    same arithmetic."""
    n_iter = 6
    args = [*TINY_CLI, f"train.num_iterations={n_iter}", "train.save_every=1", *schedule]
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    p = run_cli(["train", *args, f"log.output_dir={ref}"])
    assert p.wait(timeout=300) == 0, p.stdout.read()

    rng = random.Random(1234)
    target = rng.choice([2, 3, 4])
    p = run_cli(["train", *args, f"log.output_dir={crash}"])
    deadline = time.time() + 300
    while time.time() < deadline:
        m = crash / "checkpoints" / "latest.json"
        if m.is_file() and json.loads(m.read_text())["iteration"] >= target:
            break
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside the next iteration
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (crash / "weights.safetensors").exists(), "the run finished before it could be killed"
    killed_at = json.loads((crash / "checkpoints" / "latest.json").read_text())["iteration"]
    assert killed_at < n_iter

    p = run_cli(["train", "--resume", str(crash)])
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    assert f"resumed from {crash / 'checkpoints'}" in out
    a, b = load_file(str(ref / "weights.safetensors")), load_file(str(crash / "weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ea, eb = load_file(str(ref / "weights_ema.safetensors")), load_file(str(crash / "weights_ema.safetensors"))
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    assert _stable_rows(ref) == _stable_rows(crash)


def test_truncated_checkpoint_is_detected_and_previous_used(tmp_path):
    w = {"w": torch.randn(3, 3)}
    for it in (1, 2, 3):
        save_checkpoint(tmp_path, it, trainable={"w": w["w"] * it}, optimizer={"state": {}, "param_groups": []},
                        rng={"torch": torch.get_rng_state()}, config={}, keep_last=5)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["iter_000001", "iter_000002", "iter_000003"]
    newest = tmp_path / "checkpoints" / "iter_000003" / "trainable.safetensors"
    newest.write_bytes(newest.read_bytes()[:20])  # a write cut short
    logs = []
    ck = latest_complete(tmp_path, log=logs.append)
    assert ck.name == "iter_000002" and "incomplete" in logs[0]
    assert torch.equal(load_checkpoint(ck).trainable["w"], w["w"] * 2)
    (tmp_path / "checkpoints" / "iter_000002" / "state.json").write_text("{")  # half-written manifest
    assert latest_complete(tmp_path, log=logs.append).name == "iter_000001"
    # pruning keeps the newest N
    save_checkpoint(tmp_path, 4, trainable=w, optimizer={}, rng={}, config={}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["iter_000003", "iter_000004"]


def test_checkpoint_loading_refuses_pickled_objects(tmp_path):
    save_checkpoint(tmp_path, 1, trainable={"w": torch.zeros(1)}, optimizer={}, rng={}, config={})
    ck = tmp_path / "checkpoints" / "iter_000001"

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": Evil()}, ck / "optimizer.pt")
    state = json.loads((ck / "state.json").read_text())
    state["files"]["optimizer.pt"] = (ck / "optimizer.pt").stat().st_size
    (ck / "state.json").write_text(json.dumps(state))
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        load_checkpoint(ck)


def test_sigterm_finishes_iteration_checkpoints_and_resumes(make_trainer, tmp_path, monkeypatch):
    calls = {"n": 0}

    def reward_then_sigterm(images, prompts, metadata):
        calls["n"] += 1
        if calls["n"] == 3:  # rollouts call the reward once per iteration (evals too): inside iteration 2
            os.kill(os.getpid(), signal.SIGTERM)
        return images.flatten(1).std(1)

    monkeypatch.setitem(REWARDS, "sigterm_reward", reward_then_sigterm)
    common = ["reward.weights={sigterm_reward: 1.0}", "train.num_iterations=4", "eval.every=0",
              "train.save_every=0", "train.lr=1e-3"]
    ref = make_trainer(*common, f"log.output_dir={tmp_path / 'ref'}")
    calls["n"] = -10**9  # no signal in the reference run
    ref.train()
    calls["n"] = 0
    tr = make_trainer(*common, f"log.output_dir={tmp_path / 'run'}")
    handler = signal.getsignal(signal.SIGTERM)
    summary = tr.train()
    assert summary["interrupted"] == signal.SIGTERM and tr.iteration == 2
    assert json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["iteration"] == 2
    assert signal.getsignal(signal.SIGTERM) is handler  # the job's handler is gone: the previous one restored
    calls["n"] = -10**9
    tr2 = make_trainer(*common, f"log.output_dir={tmp_path / 'run'}")
    tr2.train(resume=True)
    assert tr2.iteration == 4
    assert torch.equal(torch.cat([p.detach().flatten() for p in tr2.params]),
                       torch.cat([p.detach().flatten() for p in ref.params]))


def test_reward_raising_once_is_retried(make_trainer, monkeypatch):
    state = {"n": 0}

    def flaky(images, prompts, metadata):
        state["n"] += 1
        if state["n"] == 1:
            raise ConnectionError("scoring server hiccup")
        return images.flatten(1).mean(1)

    monkeypatch.setitem(REWARDS, "flaky", flaky)
    logs = []
    tr = make_trainer("reward.weights={flaky: 1.0}")
    tr.log = logs.append
    ro = tr.rollout()
    assert state["n"] == 2 and ro.valid.all()
    assert any("reward 'flaky' raised ConnectionError: scoring server hiccup; retrying once" in m for m in logs)


def test_reward_raising_always_stops_with_a_clear_error(make_trainer, monkeypatch, tmp_path, capsys):
    def down(images, prompts, metadata):
        raise TimeoutError("no answer")

    monkeypatch.setitem(REWARDS, "down", down)
    tr = make_trainer("reward.weights={down: 1.0}")
    with pytest.raises(RewardError, match="reward 'down' raised TimeoutError: no answer .after one retry."):
        tr.rollout()


def test_non_finite_gradient_skips_update_then_stops(make_trainer, monkeypatch):
    tr = make_trainer("train.max_bad_updates=2")
    before = torch.cat([p.detach().flatten() for p in tr.params]).clone()
    real = tr.family.engine.backward

    def poisoned(ctx, ro, epoch=0):
        stats = real(ctx, ro, epoch)
        tr.params[0].grad.view(-1)[0] = float("nan")
        return stats

    monkeypatch.setattr(tr.family.engine, "backward", poisoned)
    row = tr.step()
    assert row["skipped_updates"] == 1 and tr.bad_updates == 1
    assert torch.equal(torch.cat([p.detach().flatten() for p in tr.params]), before)  # nothing applied
    with pytest.raises(TrainingError, match=r"2 consecutive updates were skipped \(non-finite loss/gradient"):
        tr.step()
    monkeypatch.setattr(tr.family.engine, "backward", real)
    tr.bad_updates = 1
    tr.step()
    assert tr.bad_updates == 0  # a good update resets the count


def test_ema_weights_are_used_for_evaluation(make_trainer):
    tr = make_trainer("train.ema_decay=0.5", "train.lr=1e-2", "eval.seeds_per_prompt=1")
    init = {n: p.detach().clone() for n, p in tr.policy.named_trainable_parameters().items()}
    tr.step()
    live = {n: p.detach().clone() for n, p in tr.policy.named_trainable_parameters().items()}
    for n in init:
        torch.testing.assert_close(tr.ema.shadow[n], 0.5 * init[n] + 0.5 * live[n])
    with_ema, _ = tr.evaluate()
    for n, p in tr.policy.named_trainable_parameters().items():
        assert torch.equal(p.detach(), live[n])  # live weights restored after evaluation
    tr.ema = None
    without, _ = tr.evaluate()
    assert with_ema != without


def test_occupied_output_dir_needs_resume(make_trainer, tmp_path):
    make_trainer("train.num_iterations=1", f"log.output_dir={tmp_path}", "eval.seeds_per_prompt=1").train()
    with pytest.raises(TrainingError, match="already holds a run; resume it with --resume"):
        make_trainer("train.num_iterations=1", f"log.output_dir={tmp_path}").train()


# ------------------------------------------------------------------------------------------ bad input
BAD_INPUT = [
    (["train", "engine.nmae=jagg"], "error: unknown config key 'engine.nmae' (did you mean 'engine.name'?)"),
    (["train", "sampler.sde_typ=cps"], "error: unknown config key 'sampler.sde_typ' (did you mean 'sampler.sde_type'?)"),
    (["train", "trian.lr=1e-4"], "error: unknown config key 'trian.lr' (did you mean 'train.lr'?)"),
    (["train", "engine.name=fastest"], "error: engine.name: value 'fastest' is not a registered engine"),
    (["train", "sampler.sde_type=euler"],
     "error: sampler.sde_type: value 'euler' is not allowed; choose one of ['flow_sde', 'dance_sde', 'flash_sde', 'cps', 'ode']"),
    (["train", "sampler.sde_type=ode"], "error: sampler.sde_type: 'ode' has no exploration noise and cannot be trained"),
    (["train", "sampler.num_steps=0"], "error: sampler.num_steps: value 0 is out of range; must be >= 1"),
    (["train", "sampler.num_steps=1"], "error: sampler.num_steps: must be >= 2"),
    (["train", "train.lr=-0.1"], "error: train.lr: value -0.1 is out of range; must be >= 0.0"),
    (["train", "train.group_size=1"], "error: train.group_size: value 1 is out of range; must be >= 2"),
    (["train", "train.group_size=four"], "error: train.group_size: value 'four' is not a valid int"),
    (["train", "loss.clip_range=-1"], "error: loss.clip_range: value -1.0 is out of range; must be >= 0.0"),
    (["train", "steps.fraction=1.5"], "error: steps.fraction: value 1.5 is out of range; must be <= 1.0"),
    (["train", "steps.mode=every"], "error: steps.mode: value 'every' is not allowed"),
    (["train", "advantage.std_mode=batch"], "error: advantage.std_mode: value 'batch' is not allowed"),
    (["train", "log.progress=sometimes"], "error: log.progress: value 'sometimes' is not a valid bool"),
    (["train", "reward.weights={aesthetics: 1}"], "error: reward.weights: unknown reward 'aesthetics'"),
    (["train", "reward.weights={digit_alignment: lots}"],
     "error: reward.weights.digit_alignment: weight 'lots' must be a number"),
    (["train", "reward.weights={nosuchmodule:fn: 1}"], "error: reward.weights: cannot import reward 'nosuchmodule:fn'"),
    (["train", "train.digits=[1, 10]"], "error: train.digits: value [1, 10] must be a non-empty list of digits 0..9"),
    (["train", "train.prompts_file=/nonexistent/prompts.txt"], "error: train.prompts_file"),
    (["train", "seed"], "error: override 'seed' is not key=value (e.g. train.lr=1e-5)"),
    (["train", "engine=jagg"], "error: engine: is a section; set its keys"),
    (["train", "--config", "/nonexistent.yaml"], "error: --config: file '/nonexistent.yaml' does not exist"),
    (["train", "--resume", "/nonexistent/run"], "error: --resume: '/nonexistent/run' is not a run directory"),
    (["sample", "--weights", "/nonexistent/w.safetensors"], "error: --weights: '/nonexistent/w.safetensors' does not exist"),
    (["report", "/nonexistent/run"], "error: report: '/nonexistent/run' is not a run directory (no metrics.jsonl)"),
    (["train", "train.ema_decay=1.0"], "error: train.ema_decay: value 1.0 is out of range; must be <= 0.9999"),
    (["train", "engine.name=jagg", "engine.window=12"],
     "error: engine.window: W=12 is larger than the 9 steps selected per trajectory (steps.mode=all, "
     "sampler.num_steps=10); choose 2 <= W <= 9"),
    (["train", "engine.name=recompute", "engine.evaluation=retain"],
     "error: engine.evaluation: does not apply to engine.name=recompute; it is read only by ['jagg', 'single_step']"),
    (["train", "engine.name=retain", "engine.wave_size=2", "advantage.std_mode=global"],
     "error: engine.wave_size: rollout waves need per-group advantages"),
    (["train", "model.name=diffusers"], "error: model.pretrained: required for model.name=diffusers"),
    (["train", "model.name=diffusers", "model.pretrained=/nonexistent/sd35"],
     "error: model.pretrained: path '/nonexistent/sd35' does not exist"),
    (["train", "model.name=diffusers", "model.pretrained=org/flux", "model.pipeline=flux", "model.negative_prompt=blurry"],
     "error: model.negative_prompt: FLUX is guidance-distilled"),
    (["train", "dllm.task=chess"], "error: dllm.task: value 'chess' is not allowed"),
]


@pytest.mark.parametrize("argv, line", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_table(argv, line, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err  # one line, no traceback
    assert err[0].startswith(line), err[0]


def test_bad_config_file_contents(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("- just\n- a list\n")
    assert main(["train", "--config", str(p)]) == 2
    assert "must hold a mapping of sections" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ report
def _tiny_run(make_trainer, out):
    make_trainer("train.num_iterations=2", "eval.every=1", "eval.seeds_per_prompt=1", f"log.output_dir={out}",
                 "log.save_images=true").train()


def test_html_report_is_self_contained(make_trainer, tmp_path, capsys):
    _tiny_run(make_trainer, tmp_path / "run")
    assert main(["report", str(tmp_path / "run")]) == 0
    html = (tmp_path / "run" / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4  # reward, eval, stats curves + sample grids
    assert "Resolved config" in html and "jpeg_incompressibility" in html and "time/rollout" in html
    assert "src='http" not in html and "src=\"http" not in html  # nothing fetched from outside


@pytest.mark.browser
def test_html_report_renders_in_headless_chromium(make_trainer, tmp_path):
    chromium = browser()
    from PIL import Image

    _tiny_run(make_trainer, tmp_path / "run")
    main(["report", str(tmp_path / "run")])
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,2400",
                    f"--screenshot={shot}", (tmp_path / "run" / "report.html").as_uri()],
                   check=True, timeout=120, capture_output=True)
    img = Image.open(shot).convert("L")
    colours = img.getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 50  # plots and samples rendered, not a blank page


def test_sample_writes_text_completions_for_diffusion_lms(tmp_path, capsys):
    out = tmp_path / "completions.png"  # an image name is turned into .txt for text models
    assert main(["sample", "model.name=tiny_mlm", "dllm.task=arithmetic", "pretrain.steps=5", "pretrain.batch_size=8",
                 "log.progress=false", "--prompt", "3+4=", "--prompt", "9-2=", "--num", "2",
                 "--out", str(out)]) == 0
    lines = (tmp_path / "completions.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["3+4=", "9-2="]  # greedy by default: one per prompt


# ----------------------------------------------------------------------------- issue 25 M-10: a signal delivered twice
def test_a_signal_delivered_twice_still_checkpoints(tmp_path):  # M-10
    from diffgrpo.run.checkpoint import latest_complete

    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "diffgrpo.cli", "train", *FAST_CLI, "train.num_iterations=200",
                          "train.save_every=50", f"log.output_dir={out}"], env=dict(os.environ, OMP_NUM_THREADS="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None and not (out / "metrics.jsonl").is_file():
        time.sleep(0.05)
    while time.time() < deadline and p.poll() is None and len((out / "metrics.jsonl").read_text().splitlines()) < 2:
        time.sleep(0.05)  # the start evaluation and one iteration: inside the training loop
    p.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # handled apart (two signals sent at once may merge into one in the kernel)
    p.send_signal(signal.SIGTERM)  # e.g. a scheduler signalling the process group, then the process
    text = p.communicate(timeout=120)[0]
    # 143: the stop, once; -15: the second signal arrived after the run had restored the default handlers on its
    # way out, its checkpoint written. Never 130 (stopped before a checkpoint could be written).
    assert p.returncode in (143, -signal.SIGTERM) and "received signal 15" in text, text[-2000:]
    assert latest_complete(out) is not None
