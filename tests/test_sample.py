"""``Family.sample`` draws what the family's evaluation draws: the same seed, the same samples, in process and
through ``diffgrpo sample`` (the built-in image model and the built-in masked LM)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffgrpo import RunConfig, Trainer
from diffgrpo.cli.app import main
from diffgrpo.errors import ConfigError
from diffgrpo.run.runlog import save_grid

# the built-in image model at its smallest (a 20-step pretraining, cached), 4 sampling steps
TINY_CLI = ["train.task=digits", "model.image_size=8", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8",
            "model.text_dim=16", "pretrain.steps=20", "pretrain.batch_size=16", "sampler.num_steps=4",
            "log.progress=false", "reward.weights={jpeg_incompressibility: 1.0}"]
FLOW = [*TINY_CLI, "eval.seed=5", "eval.seeds_per_prompt=2"]
DLLM = ["model.name=tiny_mlm", "dllm.task=arithmetic", "pretrain.steps=5", "pretrain.batch_size=8",
        "log.progress=false", "dllm.eval_samples=2", "dllm.eval_size=3", "eval.seed=7"]


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def test_flow_sample_is_the_evaluation_draw(tmp_path, capsys):
    trainer = Trainer(RunConfig.from_overrides(FLOW))
    _, grid = trainer.family.evaluate()  # 10 digit prompts × 2 seeds, prompt-major
    got = trainer.family.sample(None, seed=5, num=2)
    assert got.per_prompt == 2 and len(got.prompts) == 20 and got.texts is None
    assert torch.equal(got.images.cpu(), grid.cpu())
    assert not torch.equal(trainer.family.sample(None, seed=6, num=2).images.cpu(), grid.cpu())
    save_grid(grid, tmp_path / "eval.png", nrow=2)
    assert main(["sample", *FLOW, "--seed", "5", "--num", "2", "--out", str(tmp_path / "s.png")]) == 0
    assert "wrote 20 samples to" in capsys.readouterr().out
    assert np.array_equal(_pixels(tmp_path / "s.png"), _pixels(tmp_path / "eval.png"))
    assert main(["sample", *FLOW, "--seed", "6", "--num", "2", "--out", str(tmp_path / "s6.png")]) == 0
    assert not np.array_equal(_pixels(tmp_path / "s6.png"), _pixels(tmp_path / "eval.png"))


def test_flow_sample_refuses_a_source_image_for_a_text_to_image_model():
    trainer = Trainer(RunConfig.from_overrides(TINY_CLI))
    with pytest.raises(ConfigError, match="--image: model family .* generates from text"):
        trainer.family.sample(["a handwritten digit 3"], seed=0, source_images=("x.png",))


def test_dllm_sample_is_the_evaluation_draw(tmp_path, capsys):
    trainer = Trainer(RunConfig.from_overrides(DLLM))
    fam = trainer.family
    examples = fam.eval_pool[:3]
    got = fam.sample([e.prompt for e in examples], seed=7, num=2, sde_type="")  # "" = dllm.eval_temperature
    table = []

    class Table:  # the evaluation's completions, as its sample table receives them
        def add_completion(self, i, prompt, meta, comps, reward, text):
            table.append((prompt, text))

    fam.evaluate(table=Table())
    assert got.images is None and list(zip(got.prompts, got.texts)) == table
    assert [p for p, _ in table] == [e.prompt for e in examples for _ in range(2)]
    out = tmp_path / "c.txt"
    argv = ["sample", *DLLM, "--seed", "7", "--num", "2", "--out", str(out), "--sde-type", "flow_sde"]
    assert main([*argv, *sum((["--prompt", e.prompt] for e in examples), [])]) == 0
    assert "wrote 6 completions to" in capsys.readouterr().out
    drawn = fam.sample([e.prompt for e in examples], seed=7, num=2, sde_type="flow_sde")  # at dllm.temperature
    assert out.read_text().splitlines() == [f"{p}\t{t}" for p, t in zip(drawn.prompts, drawn.texts)]
    with pytest.raises(ConfigError, match="--image: model.name=tiny_mlm generates text"):
        fam.sample(None, seed=0, source_images=("x.png",))


def test_dllm_sample_greedy_writes_one_completion_per_prompt_to_the_file(tmp_path, capsys):
    """Greedy decoding (the default) gives each prompt one completion: --num 2 says so and writes one, not two
    copies; the completions go to the file, stdout shows where and at most the first three, cut short."""
    prompts = [f"{a}+{a}=" for a in range(1, 6)]
    out = tmp_path / "g.txt"
    args = ["sample", *DLLM, "--num", "2", "--out", str(out), *sum((["--prompt", p] for p in prompts), [])]
    assert main(args) == 0
    captured = capsys.readouterr()
    lines = out.read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == prompts  # one each
    assert "note: greedy decoding (--sde-type ode) gives each prompt one completion" in captured.err
    shown = captured.out.splitlines()
    assert shown[:3] == [line if len(line) <= 100 else line[:99] + "…" for line in lines[:3]]
    assert shown[3:] == [f"wrote 5 completions to {out} (2 more in the file)"]
    assert main(["sample", *DLLM, "--out", str(out), "--prompt", "1+1="]) == 0  # no --num: one, and no note
    captured = capsys.readouterr()
    assert len(out.read_text().splitlines()) == 1 and "note:" not in captured.err


def test_preview_cuts_long_completions():
    from pathlib import Path

    from diffgrpo.cli.sample import preview

    long = "p\t" + "x" * 300
    assert preview([long], Path("o.txt")) == ["p\t" + "x" * 97 + "…", "wrote 1 completion to o.txt"]
