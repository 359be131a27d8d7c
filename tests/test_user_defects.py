"""The defects found by walking the user paths as a careless or hostile user (issue 25), one test each: symlinked
run subfolders (H-1), a hung reward (H-2), moved or edited prompt files on resume (H-3), YAML 1.1 scalars in
string keys (H-4), a run into a folder that is not a run directory (H-5), and the medium and low ones."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from diffgrpo.cli.app import main
from diffgrpo.errors import RewardError, TrainingError
from tests.test_reliability import TINY_CLI

FAST = [*TINY_CLI, "train.ema_decay=0.0"]
HANG_MARK = "DIFFGRPO_TEST_HANG_MARK"


def hang(images, prompts, metadata):
    """A reward that never returns (after touching the file named by $DIFFGRPO_TEST_HANG_MARK, if set); with
    $DIFFGRPO_TEST_HANG_MARK set it scores the evaluations (main thread) and hangs in the background scorer only."""
    mark = os.environ.get(HANG_MARK)
    if mark and not threading.current_thread().name.startswith("diffgrpo-reward"):
        return images.flatten(1).mean(1)
    if mark:
        Path(mark).write_text("scoring")
    threading.Event().wait()


def brightness(images, prompts, metadata):
    return images.flatten(1).mean(1)


# ------------------------------------------------------------------------------------------ H-1 symlinks
def _planted(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A run directory whose ``name`` subfolder is a link to a folder holding a user's file and iter_* folders."""
    run, target = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    (run / ".diffgrpo-run").write_text('{"tool": "diffgrpo"}')  # a run directory of this tool
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    for i in (1, 2, 3):
        (target / f"iter_{i:06d}").mkdir()
    (run / name).symlink_to(target, target_is_directory=True)
    return run, target


@pytest.mark.parametrize("name", ["samples", "checkpoints"])
def test_symlinked_run_subfolder_is_never_written_or_pruned(make_trainer, tmp_path, name):
    run, target = _planted(tmp_path, name)
    tr = make_trainer(f"log.output_dir={run}", "train.num_iterations=3", "train.save_every=1",
                      "train.keep_checkpoints=1", "log.save_images=true", "eval.seeds_per_prompt=1")
    with pytest.raises(TrainingError, match=rf"{name} is a symbolic link inside the run directory"):
        tr.train()
    assert sorted(p.name for p in target.iterdir()) == ["iter_000001", "iter_000002", "iter_000003", "keep.txt"]
    assert all(not any(p.iterdir()) for p in target.iterdir() if p.is_dir())


# ------------------------------------------------------------------------------------------ H-2 a hung reward
def test_hung_reward_stops_at_reward_timeout(make_trainer):
    tr = make_trainer("sampler.batch_size=2", "reward.background=true", "reward.timeout=0.5",
                      "reward.weights={tests.test_user_defects:hang: 1.0}")
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"returned nothing within reward\.timeout=0\.5 s") as err:
        tr.rollout()
    assert time.perf_counter() - t0 < 30 and "\n" not in str(err.value)
    tr = make_trainer("reward.timeout=0.5", "reward.weights={tests.test_user_defects:hang: 1.0}")
    with pytest.raises(RewardError, match=r"reward\.timeout"):  # without background too, and never retried
        tr.rollout()


def test_timeout_keeps_scores_and_grad_mode(make_trainer):
    slow = make_trainer("reward.timeout=60", "reward.weights={tests.test_user_defects:brightness: 1.0}").rollout()
    plain = make_trainer("reward.timeout=0", "reward.weights={tests.test_user_defects:brightness: 1.0}").rollout()
    assert torch.equal(slow.rewards, plain.rewards)


def test_two_sigterms_end_a_run_whose_background_reward_hangs(tmp_path):
    out, mark = tmp_path / "run", tmp_path / "mark"
    env = dict(os.environ, OMP_NUM_THREADS="1", **{HANG_MARK: str(mark)})
    p = subprocess.Popen([sys.executable, "-m", "diffgrpo.cli", "train", *FAST, "sampler.batch_size=2",
                          "reward.background=true", "reward.timeout=0", "eval.seeds_per_prompt=1",
                          "reward.weights={tests.test_user_defects:hang: 1.0}", f"log.output_dir={out}"],
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


# ------------------------------------------------------------------------------------------ H-3 prompts files
def test_prompts_file_is_pinned_by_absolute_path_and_content(tmp_path, monkeypatch, capsys):
    first, second = tmp_path / "a", tmp_path / "b"
    for d in (first, second):
        d.mkdir()
        (d / "prompts.txt").write_text("a handwritten digit 3\na handwritten digit 4\n" if d is first
                                       else "a handwritten digit 8\n")
    out = tmp_path / "run"
    monkeypatch.chdir(first)
    assert main(["train", *FAST, "train.num_iterations=1", "train.save_every=1", "train.prompts_file=prompts.txt",
                 f"log.output_dir={out}"]) == 0
    saved = (out / "config.yaml").read_text()
    assert f"prompts_file: {first / 'prompts.txt'}" in saved
    monkeypatch.chdir(second)  # a resume from elsewhere reads the run's own file, not ./prompts.txt
    assert main(["train", "--resume", str(out), "train.num_iterations=2"]) == 0
    assert f"prompts_file: {first / 'prompts.txt'}" in (out / "config.yaml").read_text()
    (first / "prompts.txt").write_text("a handwritten digit 9\n")
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "train.num_iterations=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.prompts_file: ") and "changed since the run started" in err[0]


# ------------------------------------------------------------------------------------------ H-4 YAML scalars
@pytest.mark.parametrize("typed", ["001", "010", "12:30", "on", "0x1F", "1e3", "2024-01-01"])
def test_string_keys_get_the_text_as_typed(typed):
    from diffgrpo import RunConfig

    assert RunConfig.from_overrides([f"log.output_dir={typed}"]).log.output_dir == typed
    assert RunConfig.from_overrides([f"model.negative_prompt={typed}"]).model.negative_prompt == typed


def test_words_and_numbers_parse_as_yaml_1_2():
    from diffgrpo import RunConfig

    cfg = RunConfig.from_overrides(["model.negative_prompt=no", "reward.weights={digit_alignment: 1e-3}",
                                    "train.lr=1e-3", "train.num_iterations=010", "log.progress=on"])
    assert cfg.model.negative_prompt == "no" and cfg.reward.weights == {"digit_alignment": 0.001}
    assert cfg.train.lr == 0.001 and cfg.train.num_iterations == 10 and cfg.log.progress is True
    assert type(cfg.train.lr) is float and type(cfg.reward.weights["digit_alignment"]) is float
    assert RunConfig.from_yaml  # the file loader is the same strict one
    again = RunConfig.from_overrides([], base=None)
    assert again.to_yaml()  # plain values dump


def test_yaml_files_refuse_duplicate_keys_and_alias_bombs(tmp_path):
    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  lr: 0.1\ntrain:\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'train' at line 3 \(first at line 1\)"):
        RunConfig.from_yaml(dup)
    with pytest.raises(ConfigError, match=r"^reward\.weights: duplicate key 'a'"):
        RunConfig.from_overrides(["reward.weights={a: 1, a: 2}"])
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    assert bomb.stat().st_size < 400
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        RunConfig.from_yaml(bomb)
    assert "aliases expand to" in str(err.value) and len(str(err.value)) < 300
    assert time.perf_counter() - t0 < 5


def test_echoed_values_are_bounded():
    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        RunConfig.from_overrides(["train.lr=[" + ", ".join(["123456789"] * 5000) + "]"])
    assert len(str(err.value)) < 400 and "characters)" in str(err.value)


# ------------------------------------------------------------------------------------------ H-5 output_dir
def test_output_dir_must_be_empty_or_a_run_directory(tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("mine: true\n")
    (project / "summary.json").write_text("{}")
    assert main(["train", *FAST, "train.num_iterations=1", f"log.output_dir={project}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty and is not a diffgrpo run directory" in err[0]
    assert (project / "config.yaml").read_text() == "mine: true\n" and (project / "summary.json").read_text() == "{}"
    assert sorted(p.name for p in project.iterdir()) == ["config.yaml", "summary.json"]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert main(["train", *FAST, "train.num_iterations=1", "train.save_every=1", f"log.output_dir={fresh}"]) == 0
    assert (fresh / ".diffgrpo-run").is_file()
    assert main(["train", "--resume", str(fresh), "train.num_iterations=2"]) == 0  # a run directory: resumable


# ------------------------------------------------------------------------------------------ medium defects
@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A finished one-iteration run of the built-in model with a checkpoint."""
    out = tmp_path_factory.mktemp("small") / "run"
    assert main(["train", *FAST, "train.num_iterations=1", "train.save_every=1", f"log.output_dir={out}"]) == 0
    return out


def test_jsonl_prompt_may_hold_a_raw_line_separator(tmp_path):  # M-1 (and the text-file split, low)
    from diffgrpo.data_sources import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a handwritten\\u2028 digit 3"}\n'.replace("\\u2028", "\u2028"), encoding="utf-8")
    assert load_prompts(str(f)) == [{"prompt": "a handwritten\u2028 digit 3"}]
    t = tmp_path / "p.txt"
    t.write_text("one\u2028two\nthree\n", encoding="utf-8")
    assert [r["prompt"] for r in load_prompts(str(t))] == ["one\u2028two", "three"]


@pytest.mark.parametrize("line, why", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                       ('{"prompt": "x", "n": ' + "7" * 5000 + "}", "Exceeds the limit")])
def test_unparseable_prompt_lines_are_one_line_errors(tmp_path, line, why):  # M-2
    from diffgrpo.data_sources import load_prompts
    from diffgrpo.errors import ConfigError

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError) as err:
        load_prompts(str(f))
    assert str(err.value).startswith(f"train.prompts_file: file {str(f)!r} line 2 cannot be read") and why in str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_deep_nesting_through_hf_json_is_one_line_not_a_crash(tmp_path):  # M-2, through datasets
    """pyarrow's JSON reader segfaulted on 100k-deep nesting; the file is refused in one line first, in a child
    process (a crash would kill it, not the test run). Brackets inside strings do not count."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"prompt": "a", "x": ' + "[" * 100000 + "]" * 100000 + "}\n")
    fine = tmp_path / "fine.jsonl"
    fine.write_text(json.dumps({"prompt": "a " + "[" * 5000 + ' \\" ['}) + "\n")
    code = ("import sys\nfrom diffgrpo.data_sources import load_prompts\nfrom diffgrpo.errors import ConfigError\n"
            "try:\n    print(len(load_prompts('hf:json:' + sys.argv[1])))\n"
            "except ConfigError as e:\n    print('ConfigError', e)\n")
    for f, want in ((deep, "ConfigError train.prompts_file: file"), (fine, "1")):
        out = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 0, (out.returncode, out.stderr[-500:])
        assert out.stdout.strip().startswith(want), out.stdout
        assert f is fine or "nested more than 1000 deep" in out.stdout


def zap(images, prompts, metadata):
    """A careless reward: edits its inputs in place."""
    images.mul_(0)
    for m in metadata:
        m["digit"] = -1
    return torch.zeros(len(prompts))


def test_a_reward_editing_its_input_cannot_change_other_rewards_or_the_samples():  # M-3
    from diffgrpo.rewards import compute_rewards

    images = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    before, meta = images.clone(), [{"digit": d} for d in (1, 2, 3)]
    _, comps = compute_rewards({"tests.test_user_defects:zap": 1.0, "tests.test_user_defects:brightness": 1.0},
                               images, ["a", "b", "c"], meta, log=lambda *a: None)
    assert torch.equal(images, before) and [m["digit"] for m in meta] == [1, 2, 3]
    assert torch.equal(comps["tests.test_user_defects:brightness"], before.flatten(1).mean(1))


def test_model_card_with_a_null_evaluation_reward():  # M-5
    from diffgrpo.cli.export import last_held_out, model_card

    rows = [{"iteration": 0, "eval/reward": 0.5}, {"iteration": 1, "eval/reward": None, "eval/rewards/x": None}]
    held = last_held_out(rows, 1)
    assert held == rows[0]
    assert "0.5000 at iteration 0" in model_card({"model": {"name": "tiny"}}, 1, held, "adapter")
    assert "n/a" in model_card({"model": {"name": "tiny"}}, 1, last_held_out(rows[1:], 1), "adapter")


def test_export_into_the_current_empty_folder_keeps_it(small_run, tmp_path, monkeypatch):  # M-7
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["export", str(small_run), "--out", "."]) == 0
    assert here.is_dir() and (here / "README.md").is_file() and (here / "diffusion_pytorch_model.safetensors").is_file()
    assert not [p for p in here.iterdir() if p.name.startswith(".")]


def test_a_checkpoint_of_another_model_size_is_a_one_line_error(make_trainer, tmp_path):  # M-8
    from diffgrpo.run.checkpoint import latest_complete, load_checkpoint

    run = tmp_path / "r"
    make_trainer(f"log.output_dir={run}", "train.num_iterations=1", "train.save_every=1",
                 "eval.seeds_per_prompt=1").train()
    other = make_trainer("model.num_layers=2")
    with pytest.raises(TrainingError) as err:
        other.load_state(load_checkpoint(latest_complete(run)))
    assert "cannot load checkpoint" in str(err.value) and "\n" not in str(err.value) and len(str(err.value)) < 600


def test_report_survives_odd_rows_and_never_follows_links(small_run, tmp_path):  # M-16, M-17
    import shutil

    from diffgrpo.cli.report import write_report

    run = tmp_path / "run"
    shutil.copytree(small_run, run, symlinks=True)
    good = (run / "metrics.jsonl").read_text()
    odd = ['[1, 2]', '"text"', '{"iteration": "x", "reward": 1.0}', '{"iteration": 2, "reward": NaN}',
           '{"iteration": 3, "reward": Infinity, "time/rollout": Infinity}', '{"iteration": 4, "eval/reward": NaN}']
    (run / "metrics.jsonl").write_text(good + "\n".join(odd) + "\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT")
    (run / "config.yaml").unlink()
    (run / "config.yaml").symlink_to(secret)
    (run / "samples_start.png").unlink(missing_ok=True)
    (run / "samples_start.png").symlink_to(secret)
    page = write_report(run).read_text()
    assert "TOP-SECRET-CONTENT" not in page and base64_of(secret) not in page
    (run / "config.yaml").unlink()
    (run / "config.yaml").write_bytes(b"model:\n  name: \xff\xfe tiny\n")
    assert "tiny" in write_report(run).read_text()


def base64_of(path: Path) -> str:
    import base64

    return base64.b64encode(path.read_bytes()).decode()


# ------------------------------------------------------------------------------------------ fidelity notes
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


# ------------------------------------------------------------------------------------------ low ones
def test_sample_tables_are_strict_json(tmp_path):
    import json

    from diffgrpo.media import SampleTable

    table = SampleTable(tmp_path, 0, save_media=False)
    table.add_sample(0, "p", {"score": float("nan"), "deep": [float("inf")]}, {"r": float("nan")}, float("inf"), None)
    rows = table.close()
    strict = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in a sample table"))
              for line in table.path.read_text().splitlines()]
    assert strict[0]["metadata"] == {"score": None, "deep": [None]} and strict[0]["reward"] is None and rows


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


def test_a_signal_delivered_twice_still_checkpoints(tmp_path):  # M-10
    from diffgrpo.run.checkpoint import latest_complete

    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "diffgrpo.cli", "train", *FAST, "train.num_iterations=200",
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


def test_short_masked_lm_pretraining_runs():  # found by the user-path matrix: pretrain.steps=20 divided by zero
    from diffgrpo import RunConfig
    from diffgrpo.models.hf_masked_lm import pretrain_tiny_mlm
    from diffgrpo.tasks import get_task

    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "pretrain.steps=20", "pretrain.batch_size=8"])
    net = pretrain_tiny_mlm(get_task(cfg.dllm.task), cfg.pretrain, progress=False)
    assert all(torch.isfinite(p).all() for p in net.parameters())


# ------------------------------------------------------------------------------------------ remaining medium ones
@pytest.mark.parametrize("argv, overrides", [
    (["export", "model.pretrained=/base", "RUN", "--out", "D"], ["model.pretrained=/base"]),
    (["export", "RUN", "--out", "D", "model.pretrained=/base", "--merge"], ["model.pretrained=/base"]),
    (["export", "--out", "D", "--model.pretrained", "/base", "RUN"], ["model.pretrained=/base"]),
    (["train", "seed=1", "--resume", "R", "train.lr=1"], ["seed=1", "train.lr=1"]),
    (["sample", "seed=1", "--prompt", "a=b", "--weights", "R", "sampler.num_steps=3"], ["seed=1", "sampler.num_steps=3"]),
    (["print-config", "seed=1", "--changed", "train.lr=1"], ["seed=1", "train.lr=1"]),
    (["bench", "engines", "seed=1", "--repeats", "1", "train.lr=1"], ["seed=1", "train.lr=1"]),
    (["download", "seed=1", "--dry-run", "train.lr=1"], ["seed=1", "train.lr=1"]),
    (["pretrain", "seed=1", "--task", "sudoku", "train.lr=1"], ["seed=1", "train.lr=1"])])
def test_overrides_anywhere_on_every_subcommand(argv, overrides):  # M-6
    from diffgrpo.cli.app import parse_args

    args = parse_args(argv)
    assert args.overrides == overrides
    if args.command == "export":
        assert (args.source, args.out) == ("RUN", "D")
    if args.command == "sample":
        assert args.prompt == ["a=b"] and args.weights == "R"


def _tracker_run(tmp_path: Path, plant) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / ".diffgrpo-run").write_text('{"tool": "diffgrpo"}')
    plant(run)
    return run


@pytest.mark.parametrize("plant, key, why", [
    (lambda r: (r / "tensorboard").write_text("x"), "log.tensorboard", "exists and is not a directory"),
    (lambda r: (r / "tensorboard").symlink_to(r.parent, target_is_directory=True), "log.tensorboard",
     "is a symbolic link"),
    (lambda r: (r / "wandb_id").write_text("bad/id:#"), "log.wandb", "not a W&B run id"),
    (lambda r: (r / "wandb_id").symlink_to(r / ".diffgrpo-run"), "log.wandb", "is not a regular file")])
def test_tracker_setup_problems_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, plant, key,
                                                                    why):  # M-11, and the low TensorBoard/wandb ones
    import diffgrpo.trainer

    run = _tracker_run(tmp_path, plant)
    monkeypatch.setattr(diffgrpo.trainer, "Trainer", lambda *a, **k: pytest.fail("the model was loaded"))
    tracker = "log.tensorboard=true" if key == "log.tensorboard" else "log.wandb=true"
    assert main(["train", *FAST, "train.num_iterations=1", tracker, f"log.output_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key}: ") and why in err[0], err
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in run.iterdir() if p.name in
                                                            (".diffgrpo-run", "tensorboard", "wandb_id"))


def test_a_tracker_that_fails_to_start_is_one_line(tmp_path):  # M-11: whatever else a tracker raises
    from diffgrpo.run.runlog import MetricsWriter, WandBTracker

    class Broken(WandBTracker):
        def __init__(self, *a):
            raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login()")

    from diffgrpo.run import runlog

    orig = runlog.WandBTracker
    runlog.WandBTracker = Broken
    try:
        with pytest.raises(TrainingError) as err:
            MetricsWriter(tmp_path, wandb=True)
    finally:
        runlog.WandBTracker = orig
    assert str(err.value).startswith("log.wandb: the tracker could not start (RuntimeError: api_key not configured")
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def remote_llada(tmp_path_factory):
    from tests.dllm_remote_models import build_remote_model

    return build_remote_model(tmp_path_factory.mktemp("remote") / "llada", "llada")


def _llada_args(path: Path) -> list[str]:
    return ["model.name=hf_masked_lm", f"dllm.model_path={path}", "dllm.mask_token_id=2", "dllm.task=arithmetic",
            "dllm.prompt_length=16", "dllm.gen_length=8", "dllm.diffusion_steps=8"]


def test_remote_code_without_trust_remote_code_is_one_line_before_loading(remote_llada, monkeypatch):  # M-12
    import transformers

    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model's config was loaded"))
    with pytest.raises(ConfigError) as err:
        RunConfig.from_overrides(_llada_args(remote_llada))
    msg = str(err.value)
    assert msg.startswith("dllm.trust_remote_code: the model in ") and "config.json auto_map" in msg
    assert "set dllm.trust_remote_code=true" in msg and "\n" not in msg
    RunConfig.from_overrides([*_llada_args(remote_llada), "dllm.trust_remote_code=true"])  # accepted with the key


def test_system_prompt_without_a_chat_template_is_refused(remote_llada, tmp_path):  # M-13: refused, not ignored
    import json
    import shutil

    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    plain = tmp_path / "plain"
    shutil.copytree(remote_llada, plain)
    tok = json.loads((plain / "tokenizer_config.json").read_text())
    tok.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tok))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    args = [*_llada_args(plain), "dllm.trust_remote_code=true", "dllm.system_prompt=answer briefly."]
    with pytest.raises(ConfigError, match=r"^dllm\.system_prompt: set, but the tokenizer in .* has no chat template"):
        RunConfig.from_overrides(args)
    with pytest.raises(ConfigError, match=r"^dllm\.system_prompt: set, but dllm\.chat_template=false"):
        RunConfig.from_overrides([*_llada_args(remote_llada), "dllm.trust_remote_code=true",
                                  "dllm.system_prompt=answer briefly.", "dllm.chat_template=false"])
    cfg = RunConfig.from_overrides([*_llada_args(remote_llada), "dllm.trust_remote_code=true",
                                    "dllm.system_prompt=answer briefly."])  # with a template: used
    from diffgrpo.models.hf_masked_lm import load_hf_masked_lm

    policy = load_hf_masked_lm(str(remote_llada), trust_remote_code=True, mask_token_id=2,
                               system_prompt=cfg.dllm.system_prompt)
    assert "answer briefly." in policy.vocab.tok.decode(policy.vocab.prompt_ids("1+2=?"))
    with pytest.raises(ConfigError, match=r"^dllm\.system_prompt: set, but the tokenizer of .* no chat template"):
        load_hf_masked_lm(str(plain), trust_remote_code=True, mask_token_id=2, system_prompt="answer briefly.")


# ------------------------------------------------------------------------------------------ low ones (item 4)
@pytest.mark.parametrize("text, why", [("prompt,a,a\nx,1,2\n", "names the column(s) ['a'] more than once"),
                                       ("prompt,a,b\nx,1\n", "line 2 has fewer values than the header has columns")])
def test_csv_duplicate_columns_and_short_rows_are_refused(tmp_path, text, why):
    from diffgrpo.data_sources import load_prompts
    from diffgrpo.errors import ConfigError

    f = tmp_path / "p.csv"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_prompts(str(f))
    assert why in str(err.value) and str(err.value).startswith("train.prompts_file: ")


def test_one_liners_say_what_is_wrong(tmp_path):
    from diffgrpo.data_sources import load_prompts
    from diffgrpo.errors import ConfigError

    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    for spec, why in ((str(fifo), "is not a regular file"), (str(tmp_path), "is not a regular file"),
                      ("builtin:", "names no prompt set; write builtin:<set>/<split>"),
                      (str(tmp_path / "none.txt"), "does not exist")):
        with pytest.raises(ConfigError, match=why):
            load_prompts(spec)


def test_a_huge_prompt_file_fails_in_one_line_without_reading_it(tmp_path, monkeypatch):
    from diffgrpo import data_sources
    from diffgrpo.errors import ConfigError

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 6 GB on paper, nothing on disk
        f.truncate(6 * 10 ** 9)
    monkeypatch.setattr(data_sources, "read_utf8", lambda *a: pytest.fail("the file was read"))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        data_sources.load_prompts(str(big))
    assert time.perf_counter() - t0 < 1 and "5.6 GiB; a prompt file may hold at most 1024 MiB" in str(err.value)


def _children_with_rank(parent: int, rank: int) -> list[int]:
    """The pids of the processes below ``parent`` whose environment has RANK=<rank> (torchrun's workers)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            found.append(int(d.name))
    return found


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_iteration(tmp_path):
    """SIGTERM to rank 1 only (not torchrun, not rank 0): both ranks stop after the same iteration and write one
    sharded (DCP) checkpoint together; before, rank 1 alone entered the checkpoint's collectives and the job hung."""
    import json
    import socket

    from diffgrpo.run.checkpoint import latest_complete

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root + "/src", root]))
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(port), "-m", "diffgrpo.cli", "train", *FAST,
                          "dist.mode=ddp", "dist.backend=gloo", "train.num_iterations=200", "train.save_every=0",
                          "train.checkpoint_format=dcp", "eval.every=0", f"log.output_dir={out}"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 400
        metrics = out / "metrics.jsonl"
        while time.time() < deadline and p.poll() is None and not (
                metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.1)  # the start evaluation and two iterations: inside the training loop
        rank1 = _children_with_rank(p.pid, 1)
        assert p.poll() is None and len(rank1) == 1, (rank1, p.poll())
        os.kill(rank1[0], signal.SIGTERM)
        text = p.communicate(timeout=240)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    ckpt = latest_complete(out, log=lambda *a: None)
    assert ckpt is not None, text[-3000:]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["format"] == "dcp" and 2 <= state["iteration"] < 200, text[-3000:]
    assert "interrupted by signal 15; resume with" in text, text[-3000:]  # rank 0 stopped on rank 1's signal
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text[-3000:]


def interrupting(images, prompts, metadata):
    raise KeyboardInterrupt


def huge(images, prompts, metadata):
    return torch.full((len(prompts),), 1e39, dtype=torch.float64)


@pytest.mark.parametrize("timeout", [0, 60])
def test_a_reward_raising_keyboard_interrupt_is_a_reward_error(make_trainer, timeout, monkeypatch):
    import signal as sig

    monkeypatch.setattr(sig, "getsignal", lambda s: (lambda *a: None))  # as inside a run: its own handler
    tr = make_trainer(f"reward.timeout={timeout}", "reward.weights={tests.test_user_defects:interrupting: 1.0}")
    with pytest.raises(RewardError, match="raised KeyboardInterrupt"):
        tr.rollout()


def test_a_finite_reward_beyond_float32_is_named_so():
    from diffgrpo.rewards import compute_rewards

    with pytest.raises(RewardError, match=r"returned 1e\+39, a finite number beyond float32's range"):
        compute_rewards({"tests.test_user_defects:huge": 1.0}, torch.zeros(2, 1, 8, 8), ["a", "b"], [{}, {}],
                        log=lambda *a: None)


def _copy_run(small_run: Path, tmp_path: Path) -> Path:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(small_run, run, symlinks=True)
    return run


def _edit_state(ckpt: Path, edit) -> None:
    import json

    state = json.loads((ckpt / "state.json").read_text())
    edit(state)
    (ckpt / "state.json").write_text(json.dumps(state))


def test_stale_temporary_files_are_removed_at_the_next_start(tmp_path):
    from diffgrpo.run.rundir import sweep

    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp_iter_000002.ab_cd123").mkdir(parents=True)
    (run / "checkpoints" / ".tmp_iter_000002.ab_cd123" / "trainable.safetensors").write_bytes(b"x" * 10)
    (run / ".metrics.jsonl.k2j4h5g6.tmp").write_text("{}")
    (run / ".lora.q1w2e3r4").mkdir()
    (run / ".keep").write_text("mine")  # hidden files of other names stay
    (run / "samples").mkdir()
    (run / "samples" / ".eval_000001.jsonl.zz99yy88.tmp").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".x.abcdefgh.tmp").write_text("not the run's")
    (run / "best").symlink_to(elsewhere, target_is_directory=True)  # never followed
    removed = sweep(run, log=lambda *a: None)
    assert sorted(removed) == sorted([".metrics.jsonl.k2j4h5g6.tmp", ".lora.q1w2e3r4",
                                      "checkpoints/.tmp_iter_000002.ab_cd123", "samples/.eval_000001.jsonl.zz99yy88.tmp"])
    assert sorted(p.name for p in run.iterdir()) == [".keep", "best", "checkpoints", "samples"]
    assert (elsewhere / ".x.abcdefgh.tmp").is_file()


@pytest.mark.parametrize("edit, why", [
    (lambda s: s.update(iteration=7), "says iteration 7 in its state.json, not its folder's"),
    (lambda s: s.update(iteration="1"), "says iteration '1' in its state.json"),
    (lambda s: s.update(format="dcp"), "says format 'dcp' in its state.json, which its files are not"),
    (lambda s: s["config"]["engine"].update(name="jagg"), ("was written with engine.name='jagg', this run has "
                                                           "'recompute'"))])
def test_a_hand_edited_or_foreign_checkpoint_is_refused_in_one_line(small_run, tmp_path, capsys, edit, why):
    run = _copy_run(small_run, tmp_path)
    (run / "checkpoints" / ".tmp_iter_000002.ab_cd123").mkdir()  # a killed run's leftover: removed at the start
    _edit_state(run / "checkpoints" / "iter_000001", edit)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.num_iterations=2"]) in (1, 2)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and why in err[0] and err[0].startswith("error: "), err
    assert not (run / "checkpoints" / ".tmp_iter_000002.ab_cd123").exists()


def test_a_checkpoint_in_a_folder_of_another_iteration_is_refused(small_run, tmp_path, capsys):
    run = _copy_run(small_run, tmp_path)
    (run / "checkpoints" / "iter_000001").rename(run / "checkpoints" / "iter_000005")
    (run / "checkpoints" / "latest.json").unlink(missing_ok=True)
    assert main(["train", "--resume", str(run), "train.num_iterations=6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "says iteration 1 in its state.json, not its folder's" in err[0], err


def test_export_says_when_it_skips_a_damaged_newer_checkpoint(small_run, tmp_path, capsys):
    import shutil

    run = _copy_run(small_run, tmp_path)
    newer = run / "checkpoints" / "iter_000002"
    shutil.copytree(run / "checkpoints" / "iter_000001", newer)
    with open(newer / "trainable.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "exp")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("warning: export: the newer checkpoint(s) ['iter_000002'] are incomplete or damaged (their "
                    "files do not match state.json); exporting iter_000001")]


def test_sample_and_export_of_a_moved_run_need_no_prompts_file(small_run, tmp_path):
    import yaml

    run = _copy_run(small_run, tmp_path)
    gone = str(tmp_path / "moved-away" / "prompts.txt")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["train"]["prompts_file"] = cfg["eval"]["prompts_file"] = gone
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    _edit_state(run / "checkpoints" / "iter_000001",
                lambda s: (s["config"]["train"].update(prompts_file=gone), s["config"]["eval"].update(prompts_file=gone)))
    out = tmp_path / "s.png"
    assert main(["sample", "--weights", str(run), "--num", "1", "--out", str(out), "--prompt", "a handwritten digit 3"]) == 0
    assert out.is_file()
    assert main(["export", str(run), "--out", str(tmp_path / "exp")]) == 0


def test_sample_of_a_file_task_without_prompts_is_refused(remote_llada, tmp_path, capsys):
    import json

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}=?", "answer": f"#### {2 * a}"}) + "\n" for a in range(4)))
    args = [*_llada_args(remote_llada), "dllm.trust_remote_code=true", "dllm.task=gsm8k", f"dllm.data_file={data}",
            "dllm.prompt_field=question"]
    assert main(["sample", "--out", str(tmp_path / "s.txt"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --prompt: dllm.task=gsm8k has no built-in test prompts"), err
    assert not (tmp_path / "s.txt").exists()


def nan_reward(images, prompts, metadata):
    return torch.full((len(prompts),), float("nan"))


def test_a_run_shorter_than_max_bad_updates_that_trains_nothing_fails(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *FAST, "train.num_iterations=2", "train.max_bad_updates=3", "eval.every=0",
                 "reward.weights={tests.test_user_defects:nan_reward: 1.0}", f"log.output_dir={out}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("error: no update was applied in iterations 1..2 (each was skipped: see the warnings above); "
                    "the run trained nothing")]
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("override, why", [
    ("train.warmup_iterations=5", "train.warmup_iterations: value 5 is more than train.num_iterations=3"),
    ("train.digits=[3]", "train.digits: value [3] is not read with train.prompts_file set"),
    ("reward.options={pickscore: {model: /nonexistent/pickscore}}",
     "reward.options.pickscore.model: '/nonexistent/pickscore' names a local path that does not exist"),
    ("reward.options={pickscore: {device: 'cuda:7'}}", ("reward.options.pickscore.device: value 'cuda:7' is not a "
                                                        "device of this machine"))])
def test_settings_that_would_be_ignored_or_fail_late_are_refused(tmp_path, override, why):
    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    if "cuda:7" in override and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a handwritten digit 3\n")
    base = ["train.num_iterations=3", "reward.weights={pickscore: 1.0}" if "pickscore" in override else "seed=0",
            *([f"train.prompts_file={prompts}"] if "digits" in override else [])]
    with pytest.raises(ConfigError) as err:
        RunConfig.from_overrides([*base, override])
    assert str(err.value).startswith(why) and "\n" not in str(err.value)


def test_export_to_a_file_says_it_is_a_file(small_run, tmp_path, capsys):
    f = tmp_path / "out.bin"
    f.write_text("x")
    assert main(["export", str(small_run), "--out", str(f)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


def test_text_guard_rewards_honour_reward_timeout():
    from diffgrpo import RunConfig, Trainer

    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "pretrain.steps=20", "dllm.eval_size=4", "log.progress=false",
                                    "reward.timeout=0.5", "eval.guard_rewards=[tests.test_user_defects:hang]"])
    tr = Trainer(cfg, log=lambda *a: None)
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"returned nothing within reward\.timeout=0\.5 s"):
        tr.evaluate()
    assert time.perf_counter() - t0 < 60
