"""Memory at real sizes, tested at tiny sizes: text encoders offloaded between encodings, FSDP2 mixed precision and
CPU offload (two gloo ranks), fp16 loss scaling through every engine, activation checkpointing under every engine."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from diffgrpo import RunConfig, Trainer
from diffgrpo.config import ConfigError
from diffgrpo.engines import ENGINES
from diffgrpo.metering import MemoryMeter
from diffgrpo.models.diffusers_adapter import DiffusersFlowPolicy, PolicyOptions
from diffgrpo.models.tiny import build_tiny_policy
from diffgrpo.run.checkpoint import latest_complete, load_checkpoint
from tests.helpers.distributed import free_port, leave_gloo
from tests.helpers.pipelines import (
    LATENTS,
    PROMPTS,
    clip_tokenizer,
    stub_decoder,
    stub_encoder,
    t5_tokenizer,
    tiny_transformer,
)
from tests.helpers.tensors import flat_grad, rel_err
from tests.helpers.tiny import TINY

QUIET = ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
         "sampler.num_steps=5", "train.prompts_per_batch=2", "train.group_size=2", "model.device=cpu"]


# ------------------------------------------------------------------------------------------- text encoders
def _sd3_pipeline():
    """A StableDiffusion3Pipeline of tiny random components (two CLIPs, a T5), in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    torch.manual_seed(0)
    clip = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=16, projection_dim=8, vocab_size=100, bos_token_id=0, eos_token_id=1,
                pad_token_id=1)
    return StableDiffusion3Pipeline(
        transformer=tiny_transformer("sd3"), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=None,
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer=clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer_2=clip_tokenizer(),
        text_encoder_3=T5EncoderModel(T5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_heads=2)),
        tokenizer_3=t5_tokenizer()).to(torch.float32)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_text_encoders_are_offloaded_between_encodings_and_embeddings_are_unchanged(device):
    """Each distinct prompt is encoded once; with offloading the encoders are on the compute device only during
    an encoding (recorded moves, and on a GPU the parameters' real device), and the embeddings equal the ones
    encoded with the encoders resident."""
    conds, pols = [], []
    for offload in (False, True):
        pipe = _sd3_pipeline()
        pol = DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(
            device=device, guidance_scale=2.0, max_sequence_length=8, offload_text_encoders=offload),
            latent_shape=(4, 8, 8), pipeline=pipe)
        seen = []
        inner = pol._encoder

        def encode(prompts, inner=inner, pol=pol, seen=seen):  # where the encoders are while they encode
            seen.append((list(prompts), pol.text_encoders.location,
                         {p.device.type for m in pol.text_encoders.modules for p in m.parameters()}))
            return inner(prompts)

        pol._encoder = encode
        c1 = pol.encode(PROMPTS[:2])
        c2 = pol.encode([PROMPTS[1], PROMPTS[0], PROMPTS[1]])  # cached: no encoding
        c3 = pol.encode(PROMPTS)  # one new prompt: one encoding of it alone
        conds.append((c1, c2, c3))
        pols.append(pol)
        assert len(pol.text_encoders.modules) == 3
        assert [s[0] for s in seen] == [PROMPTS[:2], [""], [PROMPTS[2]]]  # "" = the negative prompt (CFG)
        assert all(s[1] == "device" and s[2] == {torch.device(device).type} for s in seen)
        params = {p.device.type for m in pol.text_encoders.modules for p in m.parameters()}
        if offload:
            assert pol.text_encoders.location == "home" and params == {"cpu"}
            nbytes = pol.text_encoders.nbytes()
            assert nbytes > 0 and pol.text_encoders.moves == [("device", nbytes), ("home", nbytes)] * 3
        else:
            assert pol.text_encoders.location == "device" and params == {torch.device(device).type}
            assert pol.text_encoders.moves == []
    for a, b in zip(*conds):
        assert a.keys() == b.keys() and {"prompt_embeds", "pooled", "neg_prompt_embeds"} <= set(a)
        for k in a:
            assert a[k].device.type == torch.device(device).type
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    torch.testing.assert_close(conds[1][1]["prompt_embeds"][0], conds[1][0]["prompt_embeds"][1], rtol=0, atol=0)


def test_offload_key_defaults_on_and_memory_options_are_checked():
    cfg = RunConfig.from_overrides([])
    assert cfg.model.offload_text_encoders is True
    assert cfg.dist.fsdp_param_dtype == "float32" and cfg.dist.fsdp_cpu_offload is False
    with pytest.raises(ConfigError, match=r"^dist.fsdp_param_dtype: value 'float16' is not allowed; choose one of"):
        RunConfig.from_overrides(["dist.fsdp_param_dtype=float16"])
    with pytest.raises(ConfigError, match=r"^dist.fsdp_cpu_offload: applies only to dist.mode=fsdp2"):
        RunConfig.from_overrides(["dist.fsdp_cpu_offload=true", "dist.mode=ddp"])
    with pytest.raises(ConfigError, match=r"^model.mixed_precision: value 'fp16' needs float32 weights"):
        RunConfig.from_overrides(["model.mixed_precision=fp16", "model.dtype=float16"])
    with pytest.raises(ConfigError, match=r"^model.mixed_precision: value 'fp16' is not supported with dist.mode"):
        RunConfig.from_overrides(["model.mixed_precision=fp16", "dist.mode=fsdp2"])


# ------------------------------------------------------------------------------------------- fp16 loss scaling
def _tiny(*overrides, seed=0):
    cfg = RunConfig.from_overrides([*TINY, f"seed={seed}", "model.device=cpu", *overrides])
    torch.manual_seed(seed)
    policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
    return Trainer(cfg, policy=policy, log=lambda *a: None)


def _first_grad(tr) -> tuple[torch.Tensor, int]:
    """The first update's gradient of one fresh batch (what the engine accumulates while sampling, or after) and
    the peak memory of collecting and back-propagating it (as ``diffgrpo bench engines`` measures it)."""
    tr.optimizer.zero_grad(set_to_none=True)
    with MemoryMeter(tr.device) as mem:
        ro, first = tr.family.collect()
        stats = first if first is not None else tr.family.backward(ro, 0)
    return flat_grad(tr.params), max(mem.peak, stats.peak_memory_bytes)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_fp16_loss_scale_multiplies_every_engines_gradient(engine):
    """Under fp16 autocast the scaler multiplies the gradient each engine accumulates by the loss scale, and only
    that: unscaled, it equals the gradient without a scaler (same fp16 forward)."""
    ov = [f"engine.name={engine}", "model.mixed_precision=fp16", "loss.beta=0.05"]
    scaled = _tiny(*ov)
    assert isinstance(scaled.grad_scaler, torch.amp.GradScaler) and scaled.policy.grad_scaler is scaled.grad_scaler
    S = scaled.grad_scaler.get_scale()
    assert S == 2.0 ** 16
    plain = _tiny(*ov)
    plain.policy.grad_scaler = None
    g_s, _ = _first_grad(scaled)
    g_p, _ = _first_grad(plain)
    assert g_p.abs().sum() > 0
    assert rel_err(g_s / S, g_p) < 1e-3  # fp16 backward: the scaled one underflows less, nothing else differs
    assert rel_err(g_s, g_p) > 0.5  # it was scaled


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_fp16_update_unscales_before_clipping_and_skips_overflow():
    ov = ["engine.name=recompute", "model.mixed_precision=fp16", "train.max_grad_norm=0.01", "train.lr=1e-2"]
    tr, ref = _tiny(*ov), _tiny(*ov)
    ref.policy.grad_scaler = ref.grad_scaler = None
    # overflow: the scale is far too large for fp16; the update is skipped without counting as bad, scale halves
    tr.grad_scaler = tr.policy.grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    w0 = [p.detach().clone() for p in tr.params]
    ro = tr.rollout()
    _, info = tr.update(ro)
    assert info["skipped_updates"] == 1 and info["loss_scale"] == 2.0 ** 39 and tr.bad_updates == 0
    assert all(torch.equal(a, p) for a, p in zip(w0, tr.params))
    # a scale that fits: the optimizer steps on the unscaled, clipped gradient (the one without a scaler)
    tr.grad_scaler = tr.policy.grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    stepped = {}
    for name, t in (("scaled", tr), ("plain", ref)):
        step = t.optimizer.step

        def recording_step(*a, _step=step, _name=name, _t=t, **kw):
            stepped[_name] = flat_grad(_t.params)
            return _step(*a, **kw)
        t.optimizer.step = recording_step
    _, info = tr.update(ro)
    _, info_ref = ref.update(ro)
    assert info["skipped_updates"] == 0 and info["loss_scale"] == 2.0 ** 8 and tr.bad_updates == 0
    assert info["grad_norm"] == pytest.approx(info_ref["grad_norm"], rel=1e-3) and info["grad_norm"] > 0.01
    assert float(stepped["scaled"].norm()) == pytest.approx(0.01, rel=1e-4)  # clipped after unscaling
    assert rel_err(stepped["scaled"], stepped["plain"]) < 1e-3
    assert any(not torch.equal(a, p) for a, p in zip(w0, tr.params))


def test_fp16_loss_scale_is_checkpointed_and_resumed(tmp_path):
    ov = ["model.mixed_precision=fp16", "train.num_iterations=2", "train.save_every=1", "eval.every=0",
          f"log.output_dir={tmp_path / 'run'}"]
    tr = _tiny(*ov)
    tr.grad_scaler.load_state_dict({**tr.grad_scaler.state_dict(), "scale": 2.0 ** 9, "_growth_tracker": 3})
    tr.save_checkpoint()
    again = _tiny(*ov)
    assert again.grad_scaler.get_scale() == 2.0 ** 16
    again.load_state(load_checkpoint(latest_complete(tmp_path / "run")))
    assert again.grad_scaler.get_scale() == 2.0 ** 9 and again.grad_scaler.state_dict()["_growth_tracker"] == 3


# ------------------------------------------------------------------------------------------- checkpointing
def _adapter_trainer(engine: str, ckpt: bool, lora: int = 0) -> Trainer:
    cfg = RunConfig.from_overrides([*QUIET, f"engine.name={engine}", "loss.beta=0.05", "seed=3"])
    options = PolicyOptions(gradient_checkpointing=ckpt, keep_reference=lora == 0, lora_rank=lora)
    pol = DiffusersFlowPolicy(_deep_sd3(), "sd3", options, latent_shape=LATENTS["sd3"], encoder=stub_encoder("sd3"),
                              decoder=stub_decoder)
    return Trainer(cfg, policy=pol, log=lambda *a: None)


def _deep_sd3():
    """A tiny SD3 transformer with 3 blocks (so checkpointing has activations to drop)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=3,
                                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                 caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=8)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_gradient_checkpointing_is_exact_and_saves_memory_under_every_engine(engine):
    g, peak = {}, {}
    for ckpt in (False, True):
        tr = _adapter_trainer(engine, ckpt)
        assert tr.policy.transformer.gradient_checkpointing is ckpt
        g[ckpt], peak[ckpt] = _first_grad(tr)
    assert g[False].abs().sum() > 0
    assert rel_err(g[True], g[False]) < 1e-5
    assert 0 < peak[True] < 0.8 * peak[False], peak
    print(f"{engine}: peak saved activations {peak[False]} B without, {peak[True]} B with checkpointing")


# ------------------------------------------------------------------------------------------- FSDP2 (2 gloo ranks)
FSDP = [*TINY, "seed=0", "engine.name=recompute", "train.group_size=4", "train.prompts_per_batch=2",
        "loss.beta=0.1", "loss.clip_range=10", "train.max_grad_norm=0", "steps.mode=first_fraction",
        "steps.fraction=0.5", "dist.mode=fsdp2", "dist.backend=gloo", "model.device=cpu"]
FSDP_VARIANTS = {"fp32": [], "bf16": ["dist.fsdp_param_dtype=bfloat16"], "offload": ["dist.fsdp_cpu_offload=true"],
                 "bf16-offload": ["dist.fsdp_param_dtype=bfloat16", "dist.fsdp_cpu_offload=true"]}


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from datetime import timedelta

    from diffgrpo import distributed

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    out, ro = {}, None
    for name, extra in FSDP_VARIANTS.items():
        tr = _tiny(*FSDP[1:], *extra)  # the same initial weights in every variant
        dtypes = set()
        lin = distributed.transformer_blocks(tr.policy.transformer)[0].attn.to_q
        h = lin.register_forward_hook(lambda m, i, o, dtypes=dtypes: dtypes.add(m.weight.dtype))
        tr.evaluate()  # as Trainer.train does before the first iteration
        if ro is None:
            ro = tr.rollout()  # every variant back-propagates the fp32 run's rollout
        tr.backward(ro)
        h.remove()
        out[name] = {"grads": [distributed.to_full(p.grad).detach().clone() for p in tr.params],
                     "compute_dtypes": sorted(str(d) for d in dtypes),
                     "shard_dtypes": sorted({str(p.dtype) for p in tr.params}),
                     "grad_dtypes": sorted({str(p.grad.dtype) for p in tr.params}),
                     "shard_devices": sorted({p.to_local().device.type for p in tr.params})}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo()


@pytest.mark.slow  # two torchrun launches; FSDP2 equality itself runs by default in test_distributed
def test_fsdp2_bf16_mixed_precision_and_cpu_offload_match_fp32_gradients():
    """FSDP2 with MixedPrecisionPolicy(bf16 parameters, fp32 reduction) computes in bf16, keeps fp32 shards and
    gradients, and its gradient agrees with fp32 FSDP2's on the same rollout within bf16 precision: relative error
    < 0.1 and cosine > 0.995 (the step log-prob's gradient (x_{k+1} − μ)/s² amplifies the bf16 error of the velocity
    by Δσ/s, as in one process under bf16 autocast, see test_diffusers_models); CPUOffloadPolicy changes nothing
    numerically."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_fsdp_worker, args=(2, free_port(), d), nprocs=2, join=True)
        res = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=True) for r in range(2)]
    flat = {r: {k: torch.cat([g.flatten().double() for g in v["grads"]]) for k, v in res[r].items()} for r in (0, 1)}
    for r in (0, 1):
        v = res[r]
        assert v["fp32"]["compute_dtypes"] == ["torch.float32"]
        assert v["bf16"]["compute_dtypes"] == ["torch.bfloat16"] == v["bf16-offload"]["compute_dtypes"]
        for name in FSDP_VARIANTS:
            assert v[name]["shard_dtypes"] == ["torch.float32"] == v[name]["grad_dtypes"]
            assert v[name]["shard_devices"] == ["cpu"]
        g = flat[r]
        assert g["fp32"].abs().sum() > 0
        torch.testing.assert_close(g["offload"], g["fp32"], rtol=0, atol=0)
        torch.testing.assert_close(g["bf16-offload"], g["bf16"], rtol=0, atol=0)
        err = rel_err(g["bf16"], g["fp32"])
        cos = float(torch.nn.functional.cosine_similarity(g["bf16"], g["fp32"], dim=0))
        print(f"rank {r}: FSDP2 bf16 vs fp32 gradient: relative error {err:.3g}, cosine {cos:.5f}")
        assert 0 < err < 1e-1 and cos > 0.995, (err, cos)
        torch.testing.assert_close(flat[r]["bf16"], flat[0]["bf16"], rtol=0, atol=0)  # ranks agree
