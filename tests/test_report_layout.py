"""What the run report puts first and what it leaves out: the held-out reward and the guards lead the page, a panel
whose series duplicates another's or never changes becomes a one-line note, the sample grids carry legible captions
and start / end labels; a deeply nested file or a linked ``metrics.jsonl`` is one line, never a traceback."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

from diffgrpo import RunConfig
from diffgrpo.cli.app import main
from diffgrpo.cli.report import headline, plan_panels, write_report
from diffgrpo.media import (
    CAPTION_LINES,
    CAPTION_PX,
    TITLE_PX,
    caption_lines,
    caption_of,
    captioned_grid,
    grid_font,
    grid_title,
    side_by_side,
)


def _run_dir(tmp: Path, *, completions: bool = False) -> Path:
    """A run directory: a start and an end evaluation around six updates (their reward the same series as its one
    component, clip_ratio and loss constant), a changed config, the start / end grid, the completions' tables."""
    run = tmp / "run"
    (run / "samples").mkdir(parents=True)
    rows = [{"eval/reward": 0.70, "eval/rewards/digit_alignment/mean": 0.70, "eval/fid": 90.0, "iteration": 0}]
    rows += [{"iteration": i, "reward": 0.7 + 0.03 * i, "rewards/digit_alignment/mean": 0.7 + 0.03 * i, "kl": 1e-4 * i,
              "clip_ratio": 0.01, "grad_norm": 40.0 + i, "loss": -0.01, "time/iteration": 1.5} for i in range(1, 7)]
    rows.append({"eval/reward": 0.88, "eval/rewards/digit_alignment/mean": 0.88, "eval/fid": 95.0, "iteration": 6})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run / "config.yaml").write_text(yaml.safe_dump(RunConfig.from_overrides(["seed=3"]).to_dict(), sort_keys=False))
    Image.fromarray(np.zeros((40, 80, 3), np.uint8)).save(run / "samples_start_end.png")
    for it in (0, 6) if completions else ():
        rec = {"iteration": it, "index": 0, "prompt": "3+4=", "metadata": {"answer": "7"}, "reward": 1.0,
               "completion": "7"}
        (run / "samples" / f"eval_{it:06d}.jsonl").write_text(json.dumps(rec) + "\n")
    return run


SHAPES_START = {"eval/reward": 0.41, "eval/rewards/shapes_score/mean": 0.41, "eval/rewards/shapes_correct/mean": 0.25,
                "eval/fid": 80.0, "eval/guard/diversity": 10.0, "eval/guard/ok": 1.0, "iteration": 0}
SHAPES_END = {"eval/reward": 0.62, "eval/rewards/shapes_score/mean": 0.62, "eval/rewards/shapes_correct/mean": 0.5,
              "eval/fid": 100.0, "eval/guard/diversity": 7.0, "eval/guard/ok": 0.0, "iteration": 4}


def test_headline_leads_with_the_checker_then_the_reward_then_the_guards(tmp_path):
    run = _run_dir(tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows[0], rows[-1] = SHAPES_START, SHAPES_END
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    page = write_report(run).read_text()
    first = page[page.index("<table"):page.index("</table>")]  # the page's first table
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", first)
    assert cells[0::4] == ["eval/rewards/shapes_correct/mean", "eval/reward", "eval/guard/ok",
                           "FID ratio (eval/fid)", "diversity ratio (eval/guard/diversity)"]
    assert cells[1:4] == ["0.2500", "0.5000", "+0.2500"] and cells[5:8] == ["0.4100", "0.6200", "+0.2100"]
    assert cells[8:12] == ["eval/guard/ok", "1", "0", "outside a guard"]
    assert cells[13:16] == ["80", "100 (× 1.250)", "limit ≤ 1.5"]  # train.guard_max_fid_ratio
    assert cells[17:20] == ["10", "7 (× 0.700)", "limit ≥ 0.8"]
    assert page.index("class=headline") < page.index("code commit")  # before the header table


def test_headline_of_a_plain_reward_run_has_no_checker_row():
    rows = headline([{"eval/reward": 0.5, "iteration": 0}, {"eval/reward": 0.75, "iteration": 2}], {})
    assert rows == [("eval/reward", "0.5000", "0.7500", "+0.2500")]
    assert headline([], {}) == []


def test_duplicate_and_constant_series_become_notes():
    rows = [{"iteration": 0, "eval/reward": 0.5, "eval/rewards/a/mean": 0.5}]
    rows += [{"iteration": i, "reward": 0.1 * i, "rewards/a/mean": 0.1 * i, "kl": 0.0, "clip_ratio": 0.0,
              "grad_norm": 1.0 + i, "loss": -0.25} for i in (1, 2, 3)]
    rows += [{"iteration": 3, "eval/reward": 0.7, "eval/rewards/a/mean": 0.7 + 1e-13}]  # equal to rounding
    panels = {title: (keys, notes) for title, _, keys, notes in plan_panels(rows)}
    assert panels["Reward"] == (["reward", "eval/reward"], ["rewards/a/mean: the same series as reward",
                                                              "eval/rewards/a/mean: the same series as eval/reward"])
    assert panels["Optimisation"] == (["grad_norm"], ["kl: constant at 0", "clip_ratio: constant at 0",
                                                      "loss: constant at -0.25"])


def test_report_notes_instead_of_plotting_flat_and_repeated_series(tmp_path):
    run = _run_dir(tmp_path)
    page = write_report(run).read_text()
    assert "<li>rewards/digit_alignment/mean: the same series as reward</li>" in page
    assert "<li>clip_ratio: constant at 0.01</li>" in page and "<li>loss: constant at -0.01</li>" in page


def test_captions_wrap_to_the_tile_in_a_real_font():
    font = grid_font(CAPTION_PX)
    assert font.getbbox("Hg")[3] - font.getbbox("Hg")[1] >= 12  # a TrueType font at a readable size
    lines = caption_lines("✓ correct\na red circle left of a blue square above a green triangle", font, 128)
    assert len(lines) == CAPTION_LINES and lines[0] == "✓ correct" and lines[-1].endswith("…")
    assert all(font.getlength(line) <= 128 for line in lines)
    assert caption_lines("short", font, 128) == ["short"]
    assert caption_lines("x" * 80, font, 128)[0].endswith("…")  # one word too wide is cut


def test_caption_shows_the_checker_verdict_else_the_reward():
    row = {"prompt": "a red circle", "reward": 0.4, "rewards": {"shapes_score": 0.4, "shapes_correct": 0.0}}
    assert caption_of(row) == "✗ wrong\na red circle"
    assert caption_of({**row, "rewards": {"shapes_correct": 1.0}}) == "✓ correct\na red circle"
    assert caption_of({**row, "rewards": {"digit_alignment": 0.4}}) == "0.400\na red circle"


def _ink(region: np.ndarray) -> int:
    return int((region.min(axis=-1) < 128).sum())


def test_grids_carry_a_start_or_end_label_above_the_tiles(tmp_path):
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    caps = [f"0.{i}00\nprompt {i}" for i in range(4)]
    bare = captioned_grid(images, caps, nrow=2)
    start = captioned_grid(images, caps, nrow=2, title=grid_title("start", 0))
    band = start.shape[0] - bare.shape[0]
    assert band >= TITLE_PX and start.shape[1] == bare.shape[1]
    assert np.array_equal(start[band:], bare)  # the tiles and captions, moved down by the band
    assert _ink(start[:band]) > 50  # the label is drawn in the band
    assert grid_title("start", 0) == "start (base model)" and grid_title("end", 12) == "end (iteration 12)"
    assert grid_title("6", 6) == "iteration 6"
    Image.fromarray(start).save(tmp_path / "a.png")
    Image.fromarray(captioned_grid(images, caps, nrow=2, title=grid_title("end", 4))).save(tmp_path / "b.png")
    assert side_by_side(tmp_path / "a.png", tmp_path / "b.png", tmp_path / "ab.png", gap=8, vertical=True)
    pair = np.asarray(Image.open(tmp_path / "ab.png"))
    assert pair.shape == (2 * start.shape[0] + 8, start.shape[1], 3)
    assert np.array_equal(pair[:start.shape[0]], start)  # the start half on top, labelled


def test_deeply_nested_files_are_skipped_or_one_line(tmp_path, capsys, monkeypatch):
    run = _run_dir(tmp_path, completions=True)
    deep = "[" * 100_000 + "]" * 100_000
    (run / "summary.json").write_text('{"best": ' + deep + "}")
    (run / "samples" / "eval_000000.jsonl").write_text('{"completion": "a", "prompt": ' + deep + "}\n")
    (run / "samples" / "eval_000006.jsonl").write_text(
        '{"completion": "b", "prompt": ' + "[" * 900 + "]" * 900 + "}\n")  # parses, too deep to encode again
    (run / "config.yaml").write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["report", str(run)]) == 0
    assert "Run report" in (run / "report.html").read_text()

    import diffgrpo.cli.report as report

    def too_deep(*_):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(report, "_figures_section", too_deep)
    assert main(["report", str(run)]) != 0
    err = capsys.readouterr().err.strip()
    assert "nested too deep" in err and "\n" not in err and "Traceback" not in err


def test_a_linked_metrics_file_is_refused_in_one_line(tmp_path, capsys):
    run = _run_dir(tmp_path)
    outside = tmp_path / "elsewhere.jsonl"
    Path(run / "metrics.jsonl").rename(outside)
    (run / "metrics.jsonl").symlink_to(outside)
    assert main(["report", str(run)]) != 0
    err = capsys.readouterr().err.strip()
    assert "symbolic link" in err and "\n" not in err
    assert not (run / "report.html").exists()
