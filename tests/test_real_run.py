"""A whole run from the command line on a tiny StableDiffusion3Pipeline saved locally, as a user runs a real model:
a JSONL prompt set with metadata, the registry rewards ``ocr`` (RapidOCR against each record's target text) and
``clip_score`` (a tiny CLIP saved locally, loaded through the reward's real ``from_pretrained``) beside a
``module:function`` plug-in that records the metadata it receives; training with evaluations (per-sample tables,
grids), checkpoints, a resume with more iterations, the LoRA export and ``diffgrpo report``."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffgrpo.cli.app import main
from tests.helpers.rewards import save_tiny_clip

RECORDS = [{"prompt": "a sign that says open", "text": "open"}, {"prompt": "a red cat", "text": "cat"},
           {"prompt": "the sun over the sea", "text": "sun"}]
EVAL = [{"prompt": "a mug that says hi", "text": "hi"}, {"prompt": "a blue dog", "text": "dog"}]
SEEN: list[dict] = []


def text_reward(images, prompts, metadata):
    """Records the metadata a reward receives; scores the target text's length."""
    SEEN.extend(metadata)
    return torch.tensor([len(m["text"]) / 10 for m in metadata])


SPY = "tests.test_real_run:text_reward"
REWARDS = f"reward.weights={{ocr: 1.0, clip_score: 0.5, {SPY}: 0.25}}"
WEIGHTS = {"ocr": 1.0, "clip_score": 0.5, SPY: 0.25}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _table(run: Path, iteration: int) -> list[dict]:
    return [json.loads(x) for x in (run / "samples" / f"eval_{iteration:06d}.jsonl").read_text().splitlines()]


def test_cli_run_train_eval_checkpoint_resume_export_report(sd3_dir, tmp_path, capsys):  # noqa: F811
    from diffusers import StableDiffusion3Pipeline

    run = tmp_path / "run"
    clip = save_tiny_clip(tmp_path / "clip")
    options = f"reward.options={{clip_score: {{model: '{clip}'}}, ocr: {{det_limit_side_len: 32}}}}"
    train_file, eval_file = _jsonl(tmp_path / "train.jsonl", RECORDS), _jsonl(tmp_path / "eval.jsonl", EVAL)
    args = ["model.name=diffusers", f"model.pretrained={sd3_dir}", "model.device=cpu", "model.resolution=16",
            "model.max_sequence_length=8", "model.guidance_scale=2.0", "model.lora_rank=4", "model.lora_alpha=8",
            "sampler.num_steps=3", "sampler.batch_size=2", "reward.background=true", REWARDS, options,
            "train.prompts_per_batch=2", "train.group_size=2", "train.lr=0.05", "train.num_iterations=2",
            "train.save_every=1", f"train.prompts_file={train_file}", f"eval.prompts_file={eval_file}",
            "eval.seeds_per_prompt=2", "eval.batch_size=3", "eval.every=1", "log.progress=false",
            f"log.output_dir={run}"]
    SEEN.clear()
    assert main(["train", *args]) == 0, capsys.readouterr().err
    assert {m["text"] for m in SEEN} == {r["text"] for r in RECORDS + EVAL}  # the metadata reached the rewards
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "reward" in r] == [1, 2]
    assert [r["iteration"] for r in rows if "eval/reward" in r] == [0, 1, 2]
    for it in (0, 1, 2):  # a per-sample table at every evaluation, each sample's PNG beside it
        table = _table(run, it)
        assert [r["prompt"] for r in table] == [e["prompt"] for e in EVAL for _ in range(2)]
        assert [r["metadata"]["text"] for r in table] == [e["text"] for e in EVAL for _ in range(2)]
        for r in table:
            assert set(r["rewards"]) == set(WEIGHTS)
            assert abs(r["reward"] - sum(w * r["rewards"][k] for k, w in WEIGHTS.items())) < 1e-5
            assert 0 <= r["rewards"]["ocr"] <= 1 and -1 <= r["rewards"]["clip_score"] <= 1
            assert (run / r["image"]).is_file()
        mean = sum(r["reward"] for r in table) / len(table)
        assert abs(mean - next(r for r in rows if "eval/reward" in r and r["iteration"] == it)["eval/reward"]) < 1e-5
    for f in ("samples_start.png", "samples_end.png", "samples_start_end.png", "summary.json", "weights.safetensors"):
        assert (run / f).is_file(), f
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == \
        ["iter_000001", "iter_000002"]

    # resume with more iterations (a module:function reward must be repeated on the command line)
    assert main(["train", "--resume", str(run), "train.num_iterations=3", REWARDS]) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "reward" in r] == [1, 2, 3]
    assert [r["iteration"] for r in rows if "eval/reward" in r] == [0, 1, 2, 3]
    assert len(_table(run, 3)) == 4
    last = run / "checkpoints" / "iter_000003"
    assert (last / "lora" / "pytorch_lora_weights.safetensors").is_file()

    # the LoRA export: the checkpoint's lora/ and the run's lora/ hold the final adapter, which diffusers loads
    final = load_file(str(run / "weights.safetensors"))
    assert any(float(v.abs().max()) > 0 for k, v in final.items() if "lora_B" in k)  # trained off its zero init
    exported = load_file(str(run / "lora" / "pytorch_lora_weights.safetensors"))
    in_ckpt = load_file(str(last / "lora" / "pytorch_lora_weights.safetensors"))
    assert exported.keys() == in_ckpt.keys() and all(torch.equal(exported[k], in_ckpt[k]) for k in exported)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(sd3_dir))
    pipe.load_lora_weights(str(last / "lora"))
    loaded = {k: v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k}
    assert loaded and any(float(v.abs().max()) > 0 for v in loaded.values())

    assert main(["report", str(run)]) == 0
    html = (run / "report.html").read_text()
    assert "Held-out evaluation, start" in html and html.count("data:image/png;base64,") >= 4
