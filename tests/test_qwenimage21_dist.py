"""Qwen-Image 2.1 under two gloo ranks: DDP and FSDP2 (sharding its transformer blocks) on a tiny random-weight
``QwenImage21Pipeline`` saved locally, in two setups: a full fine-tune with the pipeline's true CFG, and the
shipped Turbo config (configs/qwenimage21_turbo_pickscore.yaml: LoRA, no CFG, DGPO with its KL term, activation
checkpointing) on a Turbo-style pipeline (a uniform ``sample_sigmas`` grid, set through ``sampler.num_steps`` and
``grid_shift``), sized down. The row runs one transformer call per distinct prompt length of a batch, so two
ranks' batches may need different numbers of calls; each rank's synced gradient equals one process's on the union
of both ranks' units, and the ranks' batches are checked to differ in their number of calls."""
from __future__ import annotations

import pytest
import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.models.pipelines.qwenimage21 import grid_shift
from tests.helpers.distributed import ROOT, join_gloo, leave_gloo
from tests.helpers.pipelines import qwen3vl_image_only_processor, qwenimage21_pipeline
from tests.helpers.two_ranks import assert_ranks_match, load_ranks, save_step, spawn_two, union_rollout

MODES = ("ddp", "fsdp2")
SETUPS = ("full-cfg", "turbo")
TURBO_CONFIG = ROOT / "configs" / "qwenimage21_turbo_pickscore.yaml"
TURBO_SIGMAS = [1.0, 2 / 3, 1 / 3]  # a distilled uniform 3-step grid
# three prompts of one length and one of another, two a rank: one rank's batch holds one prompt length, the
# other's two (and each the negative prompt's)
DIST_PROMPTS = ["a red cat", "a red dog", "a big cat", "the sun"]
TINY = ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
        "sampler.num_steps=3", "train.prompts_per_batch=4", "train.group_size=2", "model.resolution=64",
        "eval.seeds_per_prompt=1", "train.max_grad_norm=0", "engine.forward_timesteps=2",
        "engine.dgpo_time_fraction=1.0"]
FULL_CFG = [*TINY, "model.name=diffusers", "engine.name=dgpo", "sampler.sde_type=ode", "model.lora_rank=0",
            "model.guidance_scale=3.0", "model.negative_prompt= ", "train.lr=0.002"]
# the Turbo config on CPU in float32 with a rank-2 adapter (its engine, sampler, KL, no CFG, checkpointing kept)
TURBO = [*TINY, "model.dtype=float32", "model.mixed_precision=no", "model.lora_rank=2", "model.lora_alpha=4",
         "train.lr=0.05"]


@pytest.fixture(scope="module", autouse=True)
def _processor():
    with qwen3vl_image_only_processor():
        yield


@pytest.fixture(scope="module")
def q21_dirs(tmp_path_factory):
    """{setup: a saved tiny pipeline}: the 2.1 layout, and the Turbo's (its config's ``sample_sigmas``)."""
    dirs = {}
    for setup, sigmas in (("full-cfg", None), ("turbo", TURBO_SIGMAS)):
        d = tmp_path_factory.mktemp(f"tiny-qwenimage21-{setup}")
        qwenimage21_pipeline(sample_sigmas=sigmas).save_pretrained(str(d))
        (d / "prompts.txt").write_text("\n".join(DIST_PROMPTS) + "\n")
        dirs[setup] = d
    return dirs


def _config(setup: str, pipe_dir, out: str, *extra: str) -> RunConfig:
    common = [f"model.pretrained={pipe_dir}", "seed=0", f"train.prompts_file={pipe_dir}/prompts.txt",
              f"log.output_dir={out}", *extra]
    if setup == "full-cfg":
        return RunConfig.from_overrides([*FULL_CFG, *common])
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler.load_config(str(pipe_dir), subfolder="scheduler")
    shift = grid_shift(sched, 64)  # the grid of the pipeline's sample_sigmas at 64 px (tests/test_qwenimage21.py)
    return RunConfig.from_yaml(str(TURBO_CONFIG), [*TURBO, f"sampler.shift={shift!r}", *common])


def _dist_worker(rank: int, world: int, port: int, out_dir: str, pipe_dirs: dict) -> None:
    join_gloo(rank, world, port)
    with qwen3vl_image_only_processor():
        for setup, mode in ((s, m) for s in SETUPS for m in MODES):
            tr = Trainer(_config(setup, pipe_dirs[setup], f"{out_dir}/run-{setup}-{mode}", f"dist.mode={mode}",
                                 "dist.backend=gloo"), log=lambda *a: None)
            save_step(tr, f"{out_dir}/{setup}-{mode}-rank{rank}.pt", cfg=tr.policy.uses_cfg,
                      lora=sorted({"lora_" in n for n in tr.policy.named_trainable_parameters()}))
    leave_gloo()


@pytest.fixture(scope="module")
def two_ranks(q21_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwenimage21-dist")
    spawn_two(_dist_worker, str(d), {k: str(v) for k, v in q21_dirs.items()})
    return {(s, m): load_ranks(d, f"{s}-{m}-") for s in SETUPS for m in MODES}


def _lengths(part) -> set[int]:
    return set(part["cond"]["prompt_mask"].sum(dim=1).tolist())


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", SETUPS)
def test_two_ranks_train_as_one_process(two_ranks, q21_dirs, tmp_path, setup, mode):
    """Two gloo ranks (DDP; FSDP2 sharding every transformer block), ranks whose batches hold different numbers of
    prompt lengths: each rank's synced gradient equals one process's on the union of both ranks' units."""
    from diffgrpo.models.pipelines.spec import pad_seq

    parts = two_ranks[setup, mode]
    assert len(_lengths(parts[0])) != len(_lengths(parts[1]))  # different numbers of transformer calls
    assert parts[0]["cfg"] == (setup == "full-cfg") and parts[0]["lora"] == [setup == "turbo"]
    if mode == "fsdp2":
        assert parts[0]["sharded"] == parts[0]["n_params"] > 0  # every trained weight is sharded

    def cond(k):  # each rank's text right-padded to the longer of the two (masked: not read)
        L = max(p["cond"][k].shape[1] for p in parts)
        return torch.cat([pad_seq(p["cond"][k], L) for p in parts])

    cfg = _config(setup, q21_dirs[setup], str(tmp_path / "run"))
    if setup == "turbo":  # the shipped config's training, not the overrides'
        assert cfg.engine.name == "dgpo" and cfg.sampler.sde_type == "ode" and cfg.loss.beta > 0
        assert cfg.model.gradient_checkpointing and cfg.model.guidance_scale == 1.0
    assert_ranks_match(Trainer(cfg, log=lambda *a: None), union_rollout(parts, cond), parts,
                       f"qwen-image 2.1 {setup} {mode}")
