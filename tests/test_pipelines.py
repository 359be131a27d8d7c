"""The pipeline table: an architecture is one module and one row. A toy architecture defined here (its transformer,
text encoding, decoding and latent shape) is added as one row of ``PIPELINES`` and samples and trains through the
adapter and the trainer; the renamed key ``model.family`` is refused with its new name."""
from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from diffgrpo import RunConfig, Trainer
from diffgrpo.config import ConfigError, ModelConfig
from diffgrpo.models.diffusers_adapter import DiffusersFlowPolicy, PolicyOptions, detect_pipeline
from diffgrpo.models.pipelines import PIPELINES, ForwardArgs, PipelineSpec
from diffgrpo.samplers.rollout import sample_trajectories

QUIET = ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
         "sampler.num_steps=3", "train.prompts_per_batch=2", "train.group_size=2"]
LATENT = (4, 8, 8)
PROMPTS = ["a red cat", "a blue dog on the grass", "the sun"]


class ToyTransformer(nn.Module):
    """x (N, C, H, W), t (N,), text (N, L, D) → (N, C, H, W)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(in_channels=LATENT[0])
        self.inp, self.txt, self.out = nn.Conv2d(4, 8, 1), nn.Linear(6, 8), nn.Conv2d(8, 4, 1)

    def forward(self, x, t, text):
        h = self.inp(x) + self.txt(text.mean(1))[:, :, None, None] * (1 + t[:, None, None, None])
        return self.out(torch.tanh(h))


def _encode(pipe, prompts, max_sequence_length):
    pipe.calls["encode"] += 1
    embs = [torch.randn(1, max_sequence_length, 6, generator=torch.Generator().manual_seed(zlib.crc32(p.encode())))
            for p in prompts]
    return {"prompt_embeds": torch.cat(embs)}  # (B, L, 6)


def _forward(tr, h, sigma, cond, args: ForwardArgs):
    return tr(h, sigma, cond["prompt_embeds"])  # (N, C, H, W)


def _decode(vae, z):
    vae.calls["decode"] += 1
    img = torch.sigmoid(z[:, :3].float())  # (B, 3, H, W)
    return img.repeat_interleave(2, -1).repeat_interleave(2, -2)


def _latent_shape(pipe, resolution, num_frames):
    return (pipe.transformer.config.in_channels, resolution // 8, resolution // 8)


# the architecture: one module-like object, and one row of the table
TOY = SimpleNamespace(encode=_encode, forward=_forward, decode=_decode, latent_shape=_latent_shape)
ROW = PipelineSpec("toy", "ToyTransformer", "ToyPipeline", 1.0, packed=False, video=False, true_cfg=True,
                   cfg_renorm=False, cond_keys=("prompt_embeds",), lora_targets=("inp",), max_sequence_length=5,
                   encode=TOY.encode, forward=TOY.forward, decode=TOY.decode, latent_shape=TOY.latent_shape)


@pytest.fixture
def toy_pipeline(monkeypatch):
    monkeypatch.setitem(PIPELINES, "toy", ROW)
    calls = {"encode": 0, "decode": 0}
    transformer = ToyTransformer()
    return SimpleNamespace(transformer=transformer, vae=SimpleNamespace(calls=calls), calls=calls, config={})


def test_a_new_architecture_is_one_module_and_one_row(toy_pipeline, tmp_path):
    pipe = toy_pipeline
    assert detect_pipeline(pipe.transformer) == "toy"
    shape = ROW.latent_shape(pipe, 64, 1)
    pol = DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(guidance_scale=2.5, keep_reference=True),
                              latent_shape=shape, pipeline=pipe)
    assert pol.row is ROW and pol.latent_shape == LATENT and pol.uses_cfg and pol.max_sequence_length == 5
    # the velocity is the row's forward under true CFG: v_u + g·(v_c − v_u), the negative prompt's branch batched
    x, sig = torch.randn(2, *LATENT, generator=torch.Generator().manual_seed(1)), torch.tensor([0.8, 0.3])
    cond = pol.encode(PROMPTS[:2])
    assert pipe.calls["encode"] == 2 and cond["prompt_embeds"].shape == (2, 5, 6)  # prompts, then the negative
    with torch.no_grad():
        v = pol.velocity(x, sig, cond)
        v_c = pipe.transformer(x, sig, cond["prompt_embeds"])
        v_u = pipe.transformer(x, sig, cond["neg_prompt_embeds"])
    torch.testing.assert_close(v, v_u + 2.5 * (v_c - v_u), rtol=1e-6, atol=1e-6)
    assert pol.counters["forwards_nograd"] == 4
    with torch.no_grad():
        out = sample_trajectories(pol, cond, x, torch.linspace(1, 0, 4), kernel={"sde_type": "ode"})
    assert pol.decode(out["xs"][:, -1]).shape == (2, 3, 16, 16) and pipe.calls["decode"] == 1

    # one training iteration through the trainer: rollout, update, the policy moves and the reference does not
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = RunConfig.from_overrides([*QUIET, "loss.beta=0.04", "train.lr=0.05",
                                    f"train.prompts_file={tmp_path / 'prompts.txt'}"])
    tr = Trainer(cfg, policy=pol, log=lambda *a: None)
    ro = tr.rollout()
    assert ro.traj.xs.shape == (4, 4, *LATENT) and pipe.calls["decode"] > 1
    before = [p.detach().clone() for p in tr.params]
    stats, info = tr.update(ro)
    n_pairs = int(ro.selected.sum())
    assert stats.metrics["ratio_max_dev"] < 1e-5 and stats.forwards_grad == 2 * n_pairs
    assert info["grad_norm"] > 0 and info["skipped_updates"] == 0
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, tr.params))
    with torch.no_grad(), pol.reference():
        v_ref = pol.velocity(ro.traj.xs[:, 1], ro.traj.sigmas[1].expand(4), ro.traj.cond)
    torch.testing.assert_close(v_ref, ro.traj.velocities[:, 1], rtol=1e-4, atol=1e-5)


def test_the_table_and_the_config_key_agree():
    choices = next(f for f in ModelConfig.__dataclass_fields__.values() if f.name == "pipeline").metadata["choices"]
    assert set(choices) == set(PIPELINES) | {"auto"}
    assert all(key == row.name for key, row in PIPELINES.items())


@pytest.mark.parametrize("where", ["overrides", "yaml"])
def test_the_renamed_family_key_is_refused_with_its_new_name(where, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^model\.family was renamed model\.pipeline") as e:
        if where == "overrides":
            RunConfig.from_overrides(["model.family=flux"])
        else:
            (tmp_path / "c.yaml").write_text("model:\n  family: flux\n")
            RunConfig.from_yaml(tmp_path / "c.yaml")
    assert "\n" not in str(e.value)
    assert RunConfig.from_overrides(["model.pipeline=flux"]).model.pipeline == "flux"
    from diffgrpo.cli.app import main

    assert main(["train", "model.family=flux"]) != 0  # the command line: one line naming the new key
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "model.family was renamed model.pipeline" in err and "\n" not in err
