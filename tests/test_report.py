"""The HTML report a person reads: a header, one axis per metric in each family (reward, fidelity, diversity,
optimisation), the labelled start/end samples, masked-LM completions, the changed config keys; rendered in
headless Chromium (the test fails, not skips, under CI=true without a browser)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from diffgrpo import RunConfig, __version__
from diffgrpo.cli.app import main
from diffgrpo.cli.report import changed_keys, family_keys
from tests.helpers.cli import browser


def _run_dir(tmp: Path, *, completions: bool = False) -> Path:
    run = tmp / "run"
    (run / "samples").mkdir(parents=True)
    rows = [{"eval/reward": 0.70, "eval/rewards/digit_alignment/mean": 0.70, "eval/fid": 90.0, "eval/diversity": 14.0,
             "iteration": 0}]
    for i in range(1, 7):
        rows.append({"iteration": i, "reward": 0.7 + 0.03 * i, "rewards/digit_alignment/mean": 0.7 + 0.03 * i,
                     "rewards/digit_alignment/std": 0.1, "kl": 1e-4 * i, "clip_ratio": 0.01, "grad_norm": 40.0 + i,
                     "loss": -0.01, "time/iteration": 1.5, "time/rollout": 1.0})
    rows.append({"eval/reward": 0.88, "eval/rewards/digit_alignment/mean": 0.88, "eval/fid": 95.0,
                 "eval/diversity": 13.0, "iteration": 6})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = RunConfig.from_overrides(["train.lr=3e-4", "seed=3", "train.num_iterations=6"]).to_dict()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    grid = (np.random.default_rng(0).random((40, 80, 3)) * 255).astype(np.uint8)
    Image.fromarray(grid).save(run / "samples_start_end.png")
    if completions:
        for it, text in ((0, "3+4=8"), (6, "3+4=7")):
            rec = {"iteration": it, "index": 0, "prompt": "3+4=", "metadata": {"answer": "7"}, "reward": float(it > 0),
                   "completion": text}
            (run / "samples" / f"eval_{it:06d}.jsonl").write_text(json.dumps(rec) + "\n")
    return run


def test_metric_families_get_their_own_axes():
    rows = [{"iteration": 1, "reward": 0.5, "rewards/a/mean": 0.5, "rewards/a/std": 0.1, "kl": 0.0, "grad_norm": 40.0,
             "eval/fid": 90.0, "eval/diversity": 14.0, "eval/reward": 0.4, "eval/rewards/a/mean": 0.4,
             "time/iteration": 1.0, "flag": True}]
    fams = {title: keys for title, _, keys in family_keys(rows)}
    assert fams == {"Reward": ["reward", "rewards/a/mean", "eval/reward", "eval/rewards/a/mean"],
                    "Fidelity": ["eval/fid"], "Diversity": ["eval/diversity"], "Optimisation": ["kl", "grad_norm"]}


def test_changed_keys_replace_the_dump():
    cfg = RunConfig.from_overrides(["train.lr=3e-4", "reward.weights={jpeg_compressibility: 1.0}"]).to_dict()
    assert changed_keys(yaml.safe_dump(cfg)) == [
        ("reward.weights", {"digit_alignment": 1.0}, {"jpeg_compressibility": 1.0}), ("train.lr", 1e-4, 3e-4)]
    assert changed_keys(yaml.safe_dump(RunConfig.from_overrides([]).to_dict())) == []  # the default run's config
    shapes = RunConfig.from_overrides(["train.task=shapes"]).to_dict()  # the task's own keys are not changes
    assert changed_keys(yaml.safe_dump(shapes)) == [("train.task", "digits", "shapes")]
    digits = RunConfig.from_overrides([]).to_dict()
    del digits["train"]["task"]  # saved before train.task existed: the digits task
    assert changed_keys(yaml.safe_dump(digits)) == []
    assert changed_keys("[1, 2") is None


def test_report_header_figures_samples_and_config(tmp_path):
    run = _run_dir(tmp_path)
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    for text in (f"<th>diffgrpo</th><td>{__version__}</td>", "code commit", "training wall time",
                 "0.1 min (9 s over 6 iterations", "<h2>Reward</h2>", "<h2>Fidelity</h2>", "<h2>Diversity</h2>",
                 "<h2>Optimisation</h2>", "<figcaption>", "Samples, start and end",
                 "<td>train.lr</td><td>0.0001</td><td>0.0003</td>", "<td>seed</td><td>0</td><td>3</td>"):
        assert text in page, text
    assert "<td>train.group_size</td>" not in page  # unchanged keys are not listed
    assert page.count("data:image/png;base64,") == 5  # four families + the side-by-side samples
    assert "<details><summary>Resolved config</summary>" in page


def _render(run: Path, tmp: Path, *, dump: bool) -> str | Path:
    chromium = browser()
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}"]
    page = (run / "report.html").as_uri()
    if dump:
        return subprocess.run([*args, "--dump-dom", page], check=True, timeout=120, capture_output=True,
                              text=True).stdout
    shot = tmp / "shot.png"
    subprocess.run([*args, "--window-size=1000,2400", f"--screenshot={shot}", page], check=True, timeout=120,
                   capture_output=True)
    return shot


def test_masked_lm_report_renders_completions_in_chromium(tmp_path):
    run = _run_dir(tmp_path, completions=True)
    assert main(["report", str(run)]) == 0
    dom = _render(run, tmp_path, dump=True)
    assert "Completions, start and end" in dom and "3+4=8" in dom and "3+4=7" in dom
    assert "Config: the keys this run changed" in dom and "<h2>Fidelity</h2>" in dom
    shot = Image.open(_render(run, tmp_path, dump=False)).convert("L")
    colours = shot.getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 50  # plots rendered, not a blank page


# --------------------------------------------------- issue 25 M-16, M-17: odd metric rows and links in a run directory
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
