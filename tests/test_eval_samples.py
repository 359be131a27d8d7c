"""What an evaluation leaves behind: the per-sample table (prompt, metadata, each reward, total, the sample's PNG /
MP4 or a completion), the same metrics and table when evaluation is sharded over two gloo ranks, videos written as
MP4 from a tiny Wan transformer, and the table sent to TensorBoard and W&B (offline)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.media import SampleTable, can_write_mp4, save_video, to_uint8
from diffgrpo.models.tiny import build_tiny_policy
from diffgrpo.rewards import compute_rewards
from tests.helpers.distributed import free_port, leave_gloo
from tests.helpers.tiny import TINY

PROMPTS = [{"prompt": f"a picture of the digit {d}", "tag": f"t{d}", "digit": d} for d in (3, 1, 4, 1, 5)]


def meta_reward(images, prompts, metadata):
    """A reward that reads the metadata: the mean pixel brightness minus a tenth of the record's digit."""
    return images.flatten(1).mean(1) - torch.tensor([m["digit"] / 10 for m in metadata])


def brightness(images, prompts, metadata):
    """Mean brightness of images (B, C, H, W) or videos (B, C, F, H, W)."""
    return images.flatten(1).mean(1)


def _prompt_file(d: Path) -> Path:
    f = Path(d) / "eval.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return f


def _trainer(prompt_file: Path, *extra: str) -> Trainer:
    cfg = RunConfig.from_overrides([*TINY, "seed=0", f"eval.prompts_file={prompt_file}", "eval.seeds_per_prompt=2",
                                    "reward.weights={jpeg_incompressibility: 0.5, tests.test_eval_samples:meta_reward: 1.0}",
                                    *extra])
    torch.manual_seed(0)
    policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
    return Trainer(cfg, policy=policy, log=lambda *a: None)


def _check_table(rows, run_dir: Path, images: torch.Tensor | None = None):
    """Rows in prompt order, each with the record's metadata, its components, their weighted total and a PNG."""
    assert [r["index"] for r in rows] == list(range(2 * len(PROMPTS)))
    for r in rows:
        rec = PROMPTS[r["index"] // 2]
        assert r["prompt"] == rec["prompt"] and r["metadata"]["tag"] == rec["tag"]
        comp = r["rewards"]
        assert set(comp) == {"jpeg_incompressibility", "tests.test_eval_samples:meta_reward"}
        assert math.isclose(r["reward"], 0.5 * comp["jpeg_incompressibility"]
                            + comp["tests.test_eval_samples:meta_reward"], rel_tol=1e-5, abs_tol=1e-6)
        png = run_dir / r["image"]
        assert png.is_file() and png.suffix == ".png"
    if images is not None:  # the PNG holds the sample, and its rewards are those of the sample (recomputed here)
        from PIL import Image

        for r, im in zip(rows, images):
            assert np.array_equal(np.asarray(Image.open(run_dir / r["image"])), to_uint8(im))
        _, comps = compute_rewards({"tests.test_eval_samples:meta_reward": 1.0}, images,
                                   [r["prompt"] for r in rows], [r["metadata"] for r in rows])
        got = torch.tensor([r["rewards"]["tests.test_eval_samples:meta_reward"] for r in rows])
        assert torch.allclose(got, comps["tests.test_eval_samples:meta_reward"], atol=1e-6)


def test_evaluation_writes_the_per_sample_table(tmp_path):
    tr = _trainer(_prompt_file(tmp_path), "log.save_images=true", "eval.batch_size=3")
    table = SampleTable(tmp_path / "run", iteration=7)
    row, grid = tr.evaluate(table)
    rows = table.close()
    assert table.path == tmp_path / "run" / "samples" / "eval_000007.jsonl"
    assert [json.loads(x) for x in table.path.read_text().splitlines()] == rows
    assert grid.shape[0] == 10  # every sample fits the grid (at most 64)
    _check_table(rows, tmp_path / "run", grid)
    assert math.isclose(row["eval/reward"], sum(r["reward"] for r in rows) / len(rows), rel_tol=1e-5)


# ------------------------------------------------------------------------------------------- two gloo ranks
def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    for bs in (2,):
        tr = _trainer(Path(out_dir) / "eval.jsonl", "log.save_images=true", f"eval.batch_size={bs}",
                      "dist.backend=gloo")
        table = SampleTable(Path(out_dir) / f"run{bs}", iteration=0) if rank == 0 else None
        row, grid = tr.evaluate(table)
        if rank == 0:
            table.close()
        torch.save({"row": row, "grid": grid}, os.path.join(out_dir, f"bs{bs}-rank{rank}.pt"))
    leave_gloo()


@pytest.mark.slow  # two spawned processes: about 30-50 s on two busy cores, mostly imports
def test_sharded_evaluation_equals_one_process(tmp_path):
    """10 samples over 2 ranks (5 each; with eval.batch_size=2 in chunks of 2, 2, 1 + a padding row): the metrics,
    the grid and the table (written by rank 0 alone) equal one process's."""
    import torch.multiprocessing as mp

    _prompt_file(tmp_path)
    one = _trainer(tmp_path / "eval.jsonl", "log.save_images=true")
    table = SampleTable(tmp_path / "single", iteration=0)
    row1, grid1 = one.evaluate(table)
    rows1 = table.close()
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for bs in (2,):
        got = [torch.load(tmp_path / f"bs{bs}-rank{r}.pt", weights_only=False) for r in range(2)]
        for g in got:  # every rank returns the gathered metrics and grid
            assert g["row"].keys() == row1.keys()
            assert all(math.isclose(g["row"][k], row1[k], rel_tol=1e-5, abs_tol=1e-6) for k in row1)
            assert torch.allclose(g["grid"], grid1, atol=1e-5)
        rows = [json.loads(x) for x in (tmp_path / f"run{bs}" / "samples" / "eval_000000.jsonl").read_text().splitlines()]
        _check_table(rows, tmp_path / f"run{bs}")
        for a, b in zip(rows, rows1):
            assert a["prompt"] == b["prompt"] and a["image"] == b["image"]
            assert math.isclose(a["reward"], b["reward"], rel_tol=1e-5, abs_tol=1e-6)
            assert np.abs(np.asarray(_png(tmp_path / f"run{bs}" / a["image"]), dtype=int)
                          - np.asarray(_png(tmp_path / "single" / b["image"]), dtype=int)).max() <= 1


def _png(path: Path):
    from PIL import Image

    return Image.open(path)


# ------------------------------------------------------------------------------------------- video
@pytest.mark.skipif(not can_write_mp4(), reason="needs imageio and imageio-ffmpeg")
def test_wan_evaluation_writes_mp4_videos(tmp_path):
    """A tiny Wan transformer with a decoder that keeps the frames: each evaluation sample becomes an MP4 with
    its frames; the grid shows first frames."""
    import imageio.v3 as iio

    from diffgrpo.distributed import WorldInfo
    from diffgrpo.flow.family import FlowFamily
    from diffgrpo.models.diffusers_adapter import DiffusersFlowPolicy
    from tests.helpers.pipelines import LATENTS, stub_encoder, tiny_transformer

    def video_decoder(z):  # (B, 4, F, h, w) latents → (B, 3, F, 2h, 2w) videos in [0, 1]
        return torch.sigmoid(z[:, :3].float()).repeat_interleave(2, -1).repeat_interleave(2, -2)

    policy = DiffusersFlowPolicy(tiny_transformer("wan"), "wan", latent_shape=LATENTS["wan"],
                                 encoder=stub_encoder("wan"), decoder=video_decoder)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cat\nthe sun\n")
    cfg = RunConfig.from_overrides(["model.name=diffusers", f"model.pretrained={tmp_path}", "model.device=cpu",
                                    "sampler.num_steps=3",
                                    "reward.weights={tests.test_eval_samples:brightness: 1.0}",
                                    f"eval.prompts_file={prompts}", "eval.seeds_per_prompt=1", "log.progress=false"])
    fam = FlowFamily(cfg, policy, WorldInfo(0, 1, 0), log=lambda *a: None)
    table = SampleTable(tmp_path / "run", iteration=0)
    _, grid = fam.evaluate(table)
    rows = table.close()
    assert grid.shape == (2, 3, 16, 16)
    F = LATENTS["wan"][1]
    for r in rows:
        assert "image" not in r and r["video"].endswith(".mp4")
        frames = iio.imread(tmp_path / "run" / r["video"])
        assert frames.shape == (F, 16, 16, 3)


def test_video_falls_back_to_gif(tmp_path, monkeypatch):
    """Without imageio-ffmpeg a video is an animated GIF with every frame."""
    from PIL import Image, ImageSequence

    from diffgrpo import media

    monkeypatch.setattr(media, "can_write_mp4", lambda: False)
    t = torch.linspace(0, 1, 4)[None, :, None, None].expand(3, 4, 8, 8)  # 4 frames of growing brightness
    path = save_video(to_uint8(t), tmp_path / "v")
    assert path.suffix == ".gif"
    frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(path))]
    assert len(frames) == 4 and [int(f.mean()) for f in frames] == [0, 85, 170, 255]


# ------------------------------------------------------------------------------------------- diffusion LMs
def test_dllm_evaluation_writes_completions(tmp_path):
    from tests.helpers.tiny import make_dllm_trainer

    tr = make_dllm_trainer("dllm.eval_size=4")
    table = SampleTable(tmp_path, iteration=3)
    row, _ = tr.evaluate(table)
    rows = table.close()
    tests = tr.family.task.instances("test")[:4]
    assert [r["prompt"] for r in rows] == [e.prompt for e in tests]
    assert [r["metadata"]["answer"] for r in rows] == [e.answer for e in tests]
    for r, e in zip(rows, tests):  # each row's rewards are the verifier's on its own completion, its total as "task"
        verdict = tr.family.task.reward(r["completion"], e)
        assert r["rewards"] == pytest.approx({**{k: v for k, v in verdict.items() if k != "reward"},
                                              "task": verdict["reward"]})
    assert math.isclose(row["eval/reward"], sum(r["reward"] for r in rows) / 4, rel_tol=1e-6)


# ------------------------------------------------------------------------------------------- trackers
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None or importlib.util.find_spec("wandb") is None,
                    reason="needs tensorboard and wandb")
def test_table_reaches_tensorboard_and_wandb(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                 "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(k, v)
    tr = _trainer(_prompt_file(tmp_path), "log.save_images=true", "log.tensorboard=true", "log.wandb=true",
                  "train.num_iterations=1", "eval.every=0", "train.save_every=0", f"log.output_dir={tmp_path / 'run'}")
    tr.train()
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "samples").glob("*.jsonl")) == ["eval_000000.jsonl", "eval_000001.jsonl"]
    assert (run / "samples_start_end.png").is_file()
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = [e for e in acc.Tensors("eval/samples_table/text_summary")]
    assert [e.step for e in texts] == [0, 1]
    body = texts[-1].tensor_proto.string_val[0].decode()
    assert "rewards/jpeg_incompressibility" in body and PROMPTS[0]["prompt"] in body
    offline = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1
    from tests.helpers.trackers import wandb_records

    tables = {}  # step → the table's fields, logged as nested keys eval/samples_table/<field>
    for r in wandb_records(offline[0]):
        if r.WhichOneof("record_type") == "history":
            for i in r.history.item:
                if list(i.nested_key)[:1] == ["eval/samples_table"]:
                    tables.setdefault(r.history.step.num, {})[i.nested_key[1]] = json.loads(i.value_json)
    assert sorted(tables) == [0, 1] and all(t["_type"] == "table-file" for t in tables.values())
    assert tables[1]["nrows"] == 2 * len(PROMPTS)
    table_json = json.loads((offline[0].parent / "files" / tables[1]["path"]).read_text())
    assert table_json["columns"][-1] == "image" and len(table_json["data"]) == 2 * len(PROMPTS)


def test_captioned_grid_holds_each_sample_above_its_caption():
    from diffgrpo.media import captioned_grid

    images = torch.rand(5, 3, 8, 16)  # 5 samples, 3 per row, 128 × 64 tiles
    grid = captioned_grid(images, [f"{i}.000 | prompt {i}" for i in range(5)], nrow=3)
    tile_w, tile_h, cap, pad = 128, 64, 55, 4  # three 17-px caption lines
    assert grid.shape == (2 * (tile_h + cap + pad) + pad, 3 * (tile_w + pad) + pad, 3)
    for i in range(5):
        r, q = divmod(i, 3)
        x, y = pad + q * (tile_w + pad), pad + r * (tile_h + cap + pad)
        up = to_uint8(images[i]).repeat(8, axis=0).repeat(8, axis=1)  # nearest-neighbour ×8
        assert np.array_equal(grid[y:y + tile_h, x:x + tile_w], up)
        below = grid[y + tile_h:y + tile_h + cap, x:x + tile_w]
        assert (below < 128).any() and (below == 255).mean() > 0.5  # dark caption text on white
    x, y = pad + 2 * (tile_w + pad), pad + (tile_h + cap + pad)
    assert (grid[y:y + tile_h + cap, x:x + tile_w] == 255).all()  # no sixth tile


# ------------------------------------------------------------------ issue 25, a low one: sample tables are strict JSON
def test_sample_tables_are_strict_json(tmp_path):
    import json

    from diffgrpo.media import SampleTable

    table = SampleTable(tmp_path, 0, save_media=False)
    table.add_sample(0, "p", {"score": float("nan"), "deep": [float("inf")]}, {"r": float("nan")}, float("inf"), None)
    rows = table.close()
    strict = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in a sample table"))
              for line in table.path.read_text().splitlines()]
    assert strict[0]["metadata"] == {"score": None, "deep": [None]} and strict[0]["reward"] is None and rows
