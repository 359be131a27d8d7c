"""A LoRA run's checkpoints carry the adapter in diffusers format (``iter_N/lora/``), checksummed with the rest of
the checkpoint, and loading it with diffusers' ``load_lora_adapter`` gives the trained model's velocities."""
import json

import torch
import yaml

from diffgrpo import RunConfig
from diffgrpo.models.tiny import build_tiny_policy
from diffgrpo.run.checkpoint import is_complete, latest_complete, list_checkpoints
from tests.helpers.tiny import TINY

LORA = ["model.lora_rank=4", "model.lora_alpha=8"]
WEIGHTS = "pytorch_lora_weights.safetensors"


def _velocity(pol, n=3):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, *pol.latent_shape, generator=g)
    with torch.no_grad():
        return pol.velocity(x, torch.full((n,), 0.6), pol.encode([f"a handwritten digit {d}" for d in range(n)]))


def test_lora_checkpoints_carry_the_diffusers_adapter(make_trainer, tmp_path):
    out = tmp_path / "run"
    tr = make_trainer(*LORA, "train.lr=1e-2", "train.num_iterations=2", "train.save_every=1",
                      "train.keep_checkpoints=2", "eval.seeds_per_prompt=1", f"log.output_dir={out}")
    tr.train()
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["device"] == "cpu"  # auto, resolved
    ckpts = list_checkpoints(out)
    assert [c.name for c in ckpts] == ["iter_000001", "iter_000002"]
    for c in ckpts:
        files = json.loads((c / "state.json").read_text())["files"]
        assert (c / "lora" / WEIGHTS).is_file() and f"lora/{WEIGHTS}" in files  # relative path, checksummed
        assert {"trainable.safetensors", "optimizer.pt", "rng.pt"} <= set(files)
        assert all(len(rec["sha256"]) == 64 for rec in files.values()) and is_complete(c)

    # diffusers loads the last checkpoint's adapter onto the same base model: the trained velocities
    base_cfg = RunConfig.from_overrides([*TINY, "seed=0"])
    torch.manual_seed(0)  # make_trainer's seed: the same random base weights
    base = build_tiny_policy(base_cfg, progress=False, log=lambda *a: None, pretrained=False)
    v_trained, v_base = _velocity(tr.policy), _velocity(base)
    assert (v_trained - v_base).abs().max() > 1e-4  # the adapter moved: the match below is not the base model's
    base.transformer.load_lora_adapter(str(ckpts[-1] / "lora"), weight_name=WEIGHTS)
    torch.testing.assert_close(_velocity(base), v_trained, rtol=1e-5, atol=1e-6)

    # damaging the adapter (same size) makes the checkpoint incomplete: the previous one is used
    f = ckpts[-1] / "lora" / WEIGHTS
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    assert not is_complete(ckpts[-1])
    assert latest_complete(out, log=lambda *a: None) == ckpts[0]
    f.unlink()  # and so does a missing one
    assert not is_complete(ckpts[-1])


def test_manifests_with_flat_names_still_validate_and_paths_stay_inside(make_trainer, tmp_path):
    tr = make_trainer(f"log.output_dir={tmp_path / 'run'}")
    ckpt = tr.save_checkpoint()
    state = json.loads((ckpt / "state.json").read_text())
    assert all("/" not in name for name in state["files"]) and not (ckpt / "lora").exists()  # full fine-tune
    assert is_complete(ckpt)
    old = dict(state, files={n: rec["size"] for n, rec in state["files"].items()})  # earlier versions: sizes only
    (ckpt / "state.json").write_text(json.dumps(old))
    assert is_complete(ckpt)
    for bad in ("../run/checkpoints/latest.json", str(ckpt / "rng.pt")):  # outside the checkpoint: refused
        (ckpt / "state.json").write_text(json.dumps(dict(state, files={bad: 1})))
        assert not is_complete(ckpt)
