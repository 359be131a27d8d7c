"""Rewards as users write them: TRL's keyword convention beside (images, prompts, metadata), checked at validation;
reward.options reaching plug-ins; the current directory importable; ``__main__:fn``; Trainer(cfg, rewards=...);
the ``http`` reward against a server on 127.0.0.1 that the test starts."""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffgrpo import RunConfig, Trainer
from diffgrpo.cli.app import main
from diffgrpo.errors import ConfigError, RewardError
from diffgrpo.models.tiny import build_tiny_policy
from diffgrpo.rewards import SUPPLIED, calling, make_rewards
from diffgrpo.rewards.http import http
from tests.helpers.rewards import HANG_MARK
from tests.helpers.tiny import FAST_CLI, TINY_CLI

FAST = [*TINY_CLI, "train.ema_decay=0.0", "train.num_iterations=2", "eval.every=0", "train.save_every=0"]
# the built-in task's reward: mean pixel brightness, computed independently of the library
TRL_MODULE = '''
CALLS = []

def brightness(completions, prompts=None, scale=1.0, **kwargs):
    CALLS.append({"prompts": list(prompts), "kwargs": {k: v for k, v in kwargs.items()}, "scale": scale,
                  "shape": tuple(completions.shape), "same": kwargs["images"] is completions})
    return [scale * float(im.mean()) for im in completions]
'''


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_trl_style_reward_from_the_current_directory_trains_two_iterations(tmp_path, monkeypatch, capsys):
    """``def brightness(completions, prompts=None, **kwargs)`` in ./trl_rewards_cwd.py (not on sys.path), with an
    option, trains 2 iterations through the CLI: it receives prompts, the images (as completions and images), the
    metadata field ``digit`` by name, and ``scale`` from reward.options."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trl_rewards_cwd.py").write_text(TRL_MODULE)
    assert str(tmp_path) not in sys.path
    monkeypatch.setattr(sys, "path", list(sys.path))  # the import below may add the cwd: undone after the test
    monkeypatch.delitem(sys.modules, "trl_rewards_cwd", raising=False)
    name = "trl_rewards_cwd:brightness"
    out = tmp_path / "run"
    rc = main(["train", *FAST, f"log.output_dir={out}", f'reward.weights={{"{name}": 1.0}}',
               f'reward.options={{"{name}": {{scale: 2.0}}}}'])
    assert rc == 0, capsys.readouterr().err
    mod = sys.modules["trl_rewards_cwd"]
    train_calls = [c for c in mod.CALLS if len(c["prompts"]) == 4]  # 2 prompts × group 2
    assert len(train_calls) >= 2
    for c in train_calls:
        assert c["scale"] == 2.0 and c["same"] and c["shape"][0] == 4
        assert set(c["kwargs"]) == {"images", "digit"}  # completions and prompts are named parameters
        assert c["kwargs"]["digit"] == [int(p.rsplit(" ", 1)[-1]) for p in c["prompts"]]
    rows = [r for r in _rows(out) if f"rewards/{name}/mean" in r]
    assert len(rows) == 2 and all(0.0 <= r[f"rewards/{name}/mean"] <= 2.0 for r in rows)


def test_reward_signatures_are_checked_before_any_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "sig_rewards_cwd.py").write_text(
        "def one(x):\n    return x\n"
        "def needs(completions, answer_key, *, scale):\n    return completions\n"
        "def positional(images, prompts, metadata):\n    return [0.0] * len(prompts)\n")
    loaded = []
    monkeypatch.setattr("diffgrpo.trainer.POLICIES", {"tiny": lambda *a, **k: loaded.append(1)})

    def train(weights, *extra):
        return main(["train", *FAST, f"log.output_dir={tmp_path / 'r'}", f'reward.weights={{"{weights}": 1}}', *extra])

    assert train("sig_rewards_cwd:one") == 2
    assert "cannot be called as fn(images, prompts, metadata)" in capsys.readouterr().err
    # keywords: answer_key may be a metadata field, but the option below is not a parameter
    assert train("sig_rewards_cwd:needs", 'reward.options={"sig_rewards_cwd:needs": {scale: 1, nope: 2}}') == 2
    assert "takes no parameter 'nope'" in capsys.readouterr().err
    assert train("sig_rewards_cwd:positional", 'reward.options={"sig_rewards_cwd:positional": {k: 1}}') == 2
    assert "cannot be called as fn(images, prompts, metadata, k=)" in capsys.readouterr().err
    assert loaded == []  # refused at validation: no policy was built


def test_conventions_and_signature_rules():
    def legacy(images, prompts, metadata=None, **kwargs):
        return [0.0] * len(prompts)

    def trl(prompts, completions, **kwargs):
        return [float(len(p)) for p in prompts]

    def kwonly(*, completions, answer):
        return [1.0 if a == 3 else 0.0 for a in answer]

    assert calling.convention(legacy) == "positional" and calling.convention(trl) == "keywords"
    assert calling.convention(kwonly) == "keywords"
    imgs = torch.zeros(3, 1, 4, 4)
    meta = [{"answer": 3}, {"answer": 1}, {}]
    assert calling.bind(kwonly)(imgs, ["a", "bb", "c"], meta) == [1.0, 0.0, 0.0]  # a record without it: None
    assert calling.bind(trl)(imgs, ["a", "bb", "ccc"], meta) == [1.0, 2.0, 3.0]
    calling.check_signature("kwonly", kwonly, fields={"answer"})
    with pytest.raises(ConfigError, match="requires 'answer'"):
        calling.check_signature("kwonly", kwonly, fields={"digit"})
    with pytest.raises(ConfigError, match="positional-only"):
        calling.check_signature("po", lambda x, /, **kw: x)


def test_notebook_function_through_main(monkeypatch):
    """``__main__:fn``: a function defined in a notebook or script resolves and trains like a plug-in."""
    main_mod = sys.modules["__main__"]

    def nb_reward(completions, **kwargs):
        return completions.flatten(1).mean(1)

    monkeypatch.setattr(main_mod, "nb_reward", nb_reward, raising=False)
    cfg = RunConfig.from_overrides(['reward.weights={"__main__:nb_reward": 1.0}'])
    fns = make_rewards(cfg.reward.weights, cfg.reward.options)
    x = torch.rand(2, 1, 4, 4)
    assert torch.allclose(torch.as_tensor(fns["__main__:nb_reward"](x, ["p", "q"], [{}, {}])), x.flatten(1).mean(1))


def test_trainer_takes_rewards_as_callables(monkeypatch):
    """Trainer(cfg, rewards={name: fn}) trains on exactly those callables; a name may not shadow the registry."""
    monkeypatch.setattr("diffgrpo.rewards.registry.SUPPLIED", dict(SUPPLIED))
    seen = []

    def darkness(completions, prompts, digit, **kw):
        seen.append(list(digit))
        return 1.0 - completions.flatten(1).mean(1)

    from tests.helpers.tiny import TINY

    cfg = RunConfig.from_overrides([*TINY, "train.prompts_per_batch=2", "train.group_size=2"])
    policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
    trainer = Trainer(cfg, policy=policy, rewards={"darkness": darkness}, log=lambda *a: None)
    assert trainer.cfg.reward.weights == {"darkness": 1.0} and cfg.reward.weights != trainer.cfg.reward.weights
    ro = trainer.rollout()
    assert set(ro.reward_components) == {"darkness"} and seen and len(seen[0]) == 4
    assert torch.allclose(ro.rewards, ro.reward_components["darkness"])
    with pytest.raises(ConfigError, match="must be a new name"):
        Trainer(cfg, policy=policy, rewards={"digit_alignment": darkness}, log=lambda *a: None)


# ------------------------------------------------------------------------------ masked LMs: reward.weights
MLM = ["model.name=tiny_mlm", "dllm.task=arithmetic", "train.prompts_per_batch=2", "train.group_size=4",
       "log.progress=false", "log.save_images=false", "dllm.eval_size=4", "pretrain.steps=5", "pretrain.batch_size=8"]


def _mlm_trainer(*overrides, rewards=None):
    from diffgrpo.models.hf_masked_lm import build_tiny_mlm_policy

    cfg = RunConfig.from_overrides([*MLM, *overrides])
    torch.manual_seed(0)
    return Trainer(cfg, policy=build_tiny_mlm_policy(cfg, progress=False, pretrained=False), rewards=rewards,
                   log=lambda *a: None)


def test_masked_lm_rewards_are_added_to_the_task_verifier(monkeypatch):
    """reward.weights on a masked LM: reward = weights.task × the task's verifier + Σ weight × reward, each reward
    a component under its name; a TRL-style function gets the completions, the prompts and the reference
    (``answer``) by name; a registry text verifier scores as called directly."""
    monkeypatch.setattr("diffgrpo.rewards.registry.SUPPLIED", dict(SUPPLIED))
    seen = []

    def shortness(completions, prompts, answer, **kw):
        seen.append((list(completions), list(prompts), list(answer)))
        return [1.0 / (1 + len(c)) for c in completions]

    tr = _mlm_trainer("reward.weights={task: 0.5, verify_gsm8k: 0.25}", rewards={"shortness": shortness})
    assert tr.cfg.reward.weights == {"task": 0.5, "shortness": 1.0}  # Trainer(rewards=) keeps the task weight
    ro = tr.rollout()
    texts, ex = ro.traj.completions, ro.traj.examples
    task = tr.family.task.rewards(texts, ex)["reward"]
    short = torch.tensor([1.0 / (1 + len(c)) for c in texts])
    assert torch.allclose(ro.rewards, 0.5 * task + short)
    assert torch.allclose(ro.reward_components["shortness"], short)
    assert seen[0] == (texts, [e.prompt for e in ex], [e.answer for e in ex])

    from diffgrpo.rewards.verifiers import verify_gsm8k

    tr = _mlm_trainer("reward.weights={task: 0.0, verify_gsm8k: 0.25}")
    ro = tr.rollout()
    texts, ex = ro.traj.completions, ro.traj.examples
    ref = torch.as_tensor(verify_gsm8k(texts, [e.prompt for e in ex], [{"answer": e.answer} for e in ex]),
                          dtype=torch.float32)
    assert torch.allclose(ro.rewards, 0.25 * ref) and torch.allclose(ro.reward_components["verify_gsm8k"], ref)


def test_masked_lm_reward_weights_are_checked_before_the_model_loads(monkeypatch, tmp_path, capsys):
    loaded = []
    monkeypatch.setattr("diffgrpo.trainer.POLICIES", {"tiny_mlm": lambda *a, **k: loaded.append(1)})
    cases = {"reward.weights={task: 1, pickscore: 1}": "reward.weights: 'pickscore' scores images and cannot score "
                                                       "a masked diffusion LM's completions",
             "reward.weights={task: 1, http: 1}": "reward.options.http.url: required for reward 'http'",
             "reward.options={verify_code: {workers: 2}}": "reward.options.verify_code: reward 'verify_code' is not "
                                                           "in reward.weights []"}
    for override, msg in cases.items():
        assert main(["train", *MLM, f"log.output_dir={tmp_path / 'r'}", override]) == 2
        assert msg in capsys.readouterr().err
    assert not loaded


def test_masked_lm_trl_reward_trains_two_iterations_from_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "mlm_rewards_cwd", raising=False)
    (tmp_path / "mlm_rewards_cwd.py").write_text(
        "CALLS = []\n"
        "def has_digit(completions, prompts=None, **kwargs):\n"
        "    CALLS.append(len(completions))\n"
        "    return [float(any(ch.isdigit() for ch in c)) for c in completions]\n")
    name = "mlm_rewards_cwd:has_digit"
    out = tmp_path / "run"
    rc = main(["train", *MLM, "train.num_iterations=2", "eval.every=0", "train.save_every=0",
               f"log.output_dir={out}", f'reward.weights={{task: 1.0, "{name}": 0.5}}'])
    assert rc == 0, capsys.readouterr().err
    assert sys.modules["mlm_rewards_cwd"].CALLS.count(8) >= 2  # 2 prompts × group 4, every iteration
    rows = [r for r in _rows(out) if f"rewards/{name}/mean" in r]
    assert len(rows) == 2 and all(0.0 <= r[f"rewards/{name}/mean"] <= 1.0 for r in rows)


def test_masked_lm_logs_the_verifier_as_rewards_task_and_the_weighted_total_as_reward():
    """With a plug-in text reward beside the task: training rows log the verifier (unweighted) as rewards/task/mean
    and the weighted total as reward; evaluation rows the same under eval/ (no eval/rewards/reward/mean)."""
    name = "tests.helpers.rewards:brevity"
    tr = _mlm_trainer(f'reward.weights={{task: 1.0, "{name}": 0.1}}')
    seen, rollout = [], tr.family.rollout
    tr.family.rollout = lambda *a, **k: seen.append(rollout(*a, **k)) or seen[-1]
    row = tr.step()
    ro = seen[0]
    verifier = tr.family.task.rewards(ro.traj.completions, ro.traj.examples)["reward"]
    brevity = torch.tensor([1.0 / (1 + len(c)) for c in ro.traj.completions])
    assert torch.equal(ro.reward_components["task"], verifier)
    assert row["rewards/task/mean"] == pytest.approx(float(verifier.mean()), abs=1e-6)
    assert row["reward"] == pytest.approx(float((verifier + 0.1 * brevity).mean()), abs=1e-6)
    assert row["reward"] != pytest.approx(row["rewards/task/mean"], abs=1e-6)  # brevity > 0 for every sample
    ev, _ = tr.evaluate()
    assert "eval/rewards/reward/mean" not in ev and "eval/rewards/task/mean" in ev
    assert ev["eval/reward"] == pytest.approx(ev["eval/rewards/task/mean"] + 0.1 * ev[f"eval/rewards/{name}/mean"],
                                              abs=1e-6)
    assert ev["eval/rewards/task/mean"] < ev["eval/reward"]


def test_a_trl_reward_returning_none_leaves_those_samples_not_scored(tmp_path, capsys):
    """TRL's convention: None for a sample the reward does not judge is NaN here (not scored), in a list or a
    (B, 1) list; a run with such a reward trains. A bare None for the whole batch is still refused."""
    from diffgrpo.rewards.scoring import compute_rewards

    name = "tests.helpers.rewards:digits_only"
    total, comps = compute_rewards({name: 2.0}, ["12", "ab", " 7 ", "x1"], ["p"] * 4, [{}] * 4,
                                   rewards=make_rewards({name: 2.0}))
    assert torch.equal(torch.isnan(comps[name]), torch.tensor([False, True, False, False]))
    assert comps[name][[0, 2, 3]].tolist() == [1.0, 1.0, 0.0] and torch.isnan(total[1]) and total[0] == 2.0
    nested = {"col": lambda images, prompts, metadata: [[None], [0.5]]}
    assert torch.isnan(compute_rewards({"col": 1.0}, ["a", "b"], ["p", "p"], [{}, {}], rewards=nested)[0][0])
    with pytest.raises(RewardError, match="returned None"):
        compute_rewards({"none": 1.0}, ["a"], ["p"], [{}], rewards={"none": lambda images, prompts, metadata: None})
    out = tmp_path / "run"
    rc = main(["train", *MLM, "train.num_iterations=2", "eval.every=0", "train.save_every=0",
               f"log.output_dir={out}", f'reward.weights={{task: 1.0, "{name}": 0.5}}'])
    assert rc == 0, capsys.readouterr().err
    assert len([r for r in _rows(out) if "iteration" in r and "reward" in r]) == 2


# ----------------------------------------------------------------------------------------------- the http reward
class _Scorer(BaseHTTPRequestHandler):
    """POST {"images": [base64 PNG], "prompts", "metadata"} → {"scores": [mean brightness]}; the test's server."""
    requests: list = []
    mode = "ok"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if self.mode == "500":
            self.send_response(500)
            self.end_headers()
            return
        if self.mode == "400":
            self.send_response(400)
            self.end_headers()
            return
        if self.mode == "slow":
            time.sleep(1.0)
        arrays = [np.asarray(Image.open(io.BytesIO(base64.b64decode(b)))) for b in body["images"]]
        reply = json.dumps({"scores": [float(a.mean()) / 255.0 for a in arrays]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (the timeout case)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Scorer.requests, _Scorer.mode = [], "ok"
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/score"
    srv.shutdown()
    srv.server_close()


def test_http_reward_trains_two_iterations_from_the_cli(tmp_path, server, capsys):
    out = tmp_path / "run"
    rc = main(["train", *FAST, f"log.output_dir={out}", "reward.weights={http: 1.0}",
               f"reward.options={{http: {{url: '{server}', batch_size: 3}}}}"])
    assert rc == 0, capsys.readouterr().err
    train = [r for r in _Scorer.requests if len(r["prompts"]) in (3, 1)]
    assert train and all(len(r["images"]) == len(r["prompts"]) == len(r["metadata"]) for r in _Scorer.requests)
    assert max(len(r["prompts"]) for r in _Scorer.requests) == 3  # batches of reward.options.http.batch_size
    img = np.asarray(Image.open(io.BytesIO(base64.b64decode(_Scorer.requests[0]["images"][0]))))
    assert img.shape == (8, 8, 3) and img.dtype == np.uint8  # the 8×8 one-channel samples as RGB PNGs
    assert {"digit"} <= set(_Scorer.requests[0]["metadata"][0])
    rows = [r for r in _rows(out) if "rewards/http/mean" in r]
    assert len(rows) == 2 and all(0.0 <= r["rewards/http/mean"] <= 1.0 for r in rows)


def test_http_reward_scores_match_the_server_and_fail_in_one_line(server, monkeypatch):
    monkeypatch.setattr("diffgrpo.rewards.http.BACKOFF", 0.0)
    x = torch.rand(5, 3, 4, 4)
    fn = http(url=server, batch_size=2, attempts=3, timeout=5.0)
    expect = torch.tensor([float((im.clamp(0, 1) * 255).round().mean()) / 255.0 for im in x])
    assert torch.allclose(fn(x, ["p"] * 5, [{}] * 5), expect, atol=1e-6)
    assert [len(r["prompts"]) for r in _Scorer.requests] == [2, 2, 1]
    for mode, attempts, match in (("500", 3, "HTTP 500 .* after 3 attempts"), ("400", 1, "HTTP 400 .*not retried"),
                                  ("slow", 2, "after 2 attempts \\(timeout 0.2 s each\\)")):
        _Scorer.requests, _Scorer.mode = [], mode
        with pytest.raises(RewardError, match=match) as e:
            http(url=server, attempts=2 if mode == "slow" else 3, timeout=0.2)(x[:1], ["p"], [{}])
        assert "\n" not in str(e.value) and len(_Scorer.requests) == attempts
    with pytest.raises(RewardError, match="after 1 attempt "):
        http(url="http://127.0.0.1:9/score", attempts=1, timeout=1.0)(x[:1], ["p"], [{}])


def test_http_reward_options_are_checked_at_validation():
    with pytest.raises(ConfigError, match="reward.options.http.url: required"):
        RunConfig.from_overrides(["reward.weights={http: 1.0}"])
    with pytest.raises(ConfigError, match="must be an http:// or https:// URL"):
        RunConfig.from_overrides(["reward.weights={http: 1.0}", "reward.options={http: {url: 'ftp://x'}}"])
    with pytest.raises(ConfigError, match="timeout: value -1.0 is out of range"):
        RunConfig.from_overrides(["reward.weights={http: 1.0}", "reward.options={http: {url: 'http://h/s', timeout: -1.0}}"])


# ----------------------------------------------------------------------------------------- issue 25 H-2: a hung reward
def test_hung_reward_stops_at_reward_timeout(make_trainer):
    tr = make_trainer("sampler.batch_size=2", "reward.background=true", "reward.timeout=0.5",
                      "reward.weights={tests.helpers.rewards:hang: 1.0}")
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"returned nothing within reward\.timeout=0\.5 s") as err:
        tr.rollout()
    assert time.perf_counter() - t0 < 30 and "\n" not in str(err.value)
    tr = make_trainer("reward.timeout=0.5", "reward.weights={tests.helpers.rewards:hang: 1.0}")
    with pytest.raises(RewardError, match=r"reward\.timeout"):  # without background too, and never retried
        tr.rollout()


def test_timeout_keeps_scores_and_grad_mode(make_trainer):
    slow = make_trainer("reward.timeout=60", "reward.weights={tests.helpers.rewards:brightness: 1.0}").rollout()
    plain = make_trainer("reward.timeout=0", "reward.weights={tests.helpers.rewards:brightness: 1.0}").rollout()
    assert torch.equal(slow.rewards, plain.rewards)


def test_two_sigterms_end_a_run_whose_background_reward_hangs(tmp_path):
    out, mark = tmp_path / "run", tmp_path / "mark"
    env = dict(os.environ, OMP_NUM_THREADS="1", **{HANG_MARK: str(mark)})
    p = subprocess.Popen([sys.executable, "-m", "diffgrpo.cli", "train", *FAST_CLI, "sampler.batch_size=2",
                          "reward.background=true", "reward.timeout=0", "eval.seeds_per_prompt=1",
                          "reward.weights={tests.helpers.rewards:hang: 1.0}", f"log.output_dir={out}"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not mark.exists() and p.poll() is None:
        time.sleep(0.05)
    assert mark.exists(), p.communicate()[0] if p.poll() is not None else "the reward was never called"
    p.send_signal(signal.SIGTERM)
    time.sleep(2.0)  # later than 1 s (job.Job._on_signal): a second request, which stops at once
    p.send_signal(signal.SIGTERM)
    try:
        text = p.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("two SIGTERMs did not end a run whose reward hangs")
    assert p.returncode == 130, text


# --------------------------------------------------------------------------- issue 25 M-3: a reward editing its inputs
def test_a_reward_editing_its_input_cannot_change_other_rewards_or_the_samples():  # M-3
    from diffgrpo.rewards import compute_rewards

    images = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    before, meta = images.clone(), [{"digit": d} for d in (1, 2, 3)]
    _, comps = compute_rewards({"tests.helpers.rewards:zap": 1.0, "tests.helpers.rewards:brightness": 1.0},
                               images, ["a", "b", "c"], meta, log=lambda *a: None)
    assert torch.equal(images, before) and [m["digit"] for m in meta] == [1, 2, 3]
    assert torch.equal(comps["tests.helpers.rewards:brightness"], before.flatten(1).mean(1))


# ------------------------------------------------- issue 25, low ones: KeyboardInterrupt and float32 range in a reward
@pytest.mark.parametrize("timeout", [0, 60])
def test_a_reward_raising_keyboard_interrupt_is_a_reward_error(make_trainer, timeout, monkeypatch):
    import signal as sig

    monkeypatch.setattr(sig, "getsignal", lambda s: (lambda *a: None))  # as inside a run: its own handler
    tr = make_trainer(f"reward.timeout={timeout}", "reward.weights={tests.helpers.rewards:interrupting: 1.0}")
    with pytest.raises(RewardError, match="raised KeyboardInterrupt"):
        tr.rollout()


def test_a_finite_reward_beyond_float32_is_named_so():
    from diffgrpo.rewards import compute_rewards

    with pytest.raises(RewardError, match=r"returned 1e\+39, a finite number beyond float32's range"):
        compute_rewards({"tests.helpers.rewards:huge": 1.0}, torch.zeros(2, 1, 8, 8), ["a", "b"], [{}, {}],
                        log=lambda *a: None)


# ---------------------------------------------------------- issue 25, a low one: text guard rewards and reward.timeout
def test_text_guard_rewards_honour_reward_timeout():
    from diffgrpo import RunConfig, Trainer

    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "pretrain.steps=20", "dllm.eval_size=4", "log.progress=false",
                                    "reward.timeout=0.5", "eval.guard_rewards=[tests.helpers.rewards:hang]"])
    tr = Trainer(cfg, log=lambda *a: None)
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"returned nothing within reward\.timeout=0\.5 s"):
        tr.evaluate()
    assert time.perf_counter() - t0 < 60
