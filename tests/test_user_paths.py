"""The user-path matrix: launch {one process, torchrun 2 ranks DDP, torchrun 2 ranks FSDP2} × model {built-in, the
built-in on train.task=shapes, a tiny StableDiffusion3Pipeline directory, a tiny Wan pipeline directory, the built-in
masked LM, a tiny remote-code LLaDA-style model, the built-in block-diffusion LM, a tiny remote-code block-diffusion
LM in the layout of the released SDAR / TraDo checkpoints, a tiny Qwen-Image 2.1 pipeline directory, the shipped
Qwen-Image 2.1 Turbo config on a tiny Turbo-style pipeline directory} × {full fine-tune, LoRA}, each cell through
the command line to the very end:

    train with a checkpoint every iteration → SIGTERM once the first checkpoint exists (the run finishes its
    iteration, checkpoints, exits 143) → ``train --resume`` → finish (exit 0, every promised file) → ``export``
    (and ``--merge`` for diffusers pipelines) → reload with diffusers / peft / transformers and compare with the
    run's own weights, and sample → ``report``.

A cell that cannot apply is refused at validation with one line (asserted). Every model is built here with seeded
random weights and saved locally; nothing is downloaded. Two ranks run on CPU with gloo. The fast cells run by
default; the rest are ``slow`` (``python -m pytest -q -m slow tests/test_user_paths.py``); docs/user_paths.md holds
the measured table.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffgrpo.cli.app import main
from diffgrpo.run.checkpoint import latest_complete
from tests.helpers.distributed import free_port
from tests.helpers.pipelines import (
    PROMPTS,
    qwen3vl_image_only_processor,
    qwenimage21_pipeline,
    t5_tokenizer,
    tiny_transformer,
)
from tests.helpers.remote_models import build_remote_model

LAUNCHES = ("one", "ddp", "fsdp2")
MODELS = ("builtin", "shapes", "sd3", "wan", "mlm", "llada", "block", "remote_block", "qwenimage21", "qwenimage21turbo")
REMOTE_CODE = ("llada", "remote_block")  # hf_masked_lm with dllm.trust_remote_code=true
# a reward that differs inside a group of a random model (its task accuracy is 0): the updates are not zero
SPREAD_REWARD = "reward.weights={task: 1.0, tests.helpers.rewards:brevity: 1.0}"
DIFFUSERS = ("sd3", "wan", "qwenimage21", "qwenimage21turbo")  # pipeline directories: export --merge, reload
QWEN21 = ("qwenimage21", "qwenimage21turbo")  # loaded with the Qwen3-VL processor without torchvision
TURBO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwenimage21_turbo_pickscore.yaml"
TURBO_SIGMAS = [1.0, 2 / 3, 1 / 3]  # a distilled uniform 3-step grid (the pipeline config's sample_sigmas)
# Qwen-Image 2.1: three prompts of one length and one of another, two a rank: the ranks' batches hold different
# numbers of prompt lengths (one transformer call per length)
Q21_PROMPTS = ["a red cat", "a red dog", "a big cat", "the sun"]
LLADA_MASK = 2
COMMON = ["log.progress=false", "log.save_images=false", "train.prompts_per_batch=2", "train.group_size=4",
          "seed=0", "train.save_every=1", "train.ema_decay=0.0"]
# one line, at validation, for the cells that cannot apply: (launch, model, kind) → the error's start
REFUSED: dict[tuple[str, str, str], str] = {
    ("fsdp2", "mlm", kind): "error: dist.mode=fsdp2 for masked diffusion LMs shards the blocks of "
                            "model.name=hf_masked_lm; the built-in tiny_mlm trains data parallel with dist.mode=ddp"
    for kind in ("full", "lora")} | {
    ("fsdp2", "block", kind): "error: dist.mode=fsdp2 for masked diffusion LMs shards the blocks of "
                              "model.name=hf_masked_lm; the built-in tiny_block trains data parallel with dist.mode=ddp"
    for kind in ("full", "lora")}
# (the shapes cell's model and guard encoder are cached once per test session; the shapes tests train the same ones)
FAST = {("one", "builtin", "full"), ("one", "shapes", "full")}


# ------------------------------------------------------------------------------------------ tiny models on disk
@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    """A WanPipeline of tiny random components (UMT5 text encoder, Wan VAE, Wan transformer), save_pretrained."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                           temperal_downsample=[True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    enc = UMT5EncoderModel(UMT5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    pipe = WanPipeline(tokenizer=t5_tokenizer(), text_encoder=enc, transformer=tiny_transformer("wan"), vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    d = tmp_path_factory.mktemp("tiny-wan")
    pipe.save_pretrained(str(d))
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return d


def _q21_dir(tmp_path_factory, name: str, sample_sigmas=None) -> Path:
    d = tmp_path_factory.mktemp(name)
    with qwen3vl_image_only_processor():
        qwenimage21_pipeline(sample_sigmas=sample_sigmas).save_pretrained(str(d))
    (d / "prompts.txt").write_text("\n".join(Q21_PROMPTS) + "\n")
    return d


@pytest.fixture(scope="module")
def qwenimage21_dir(tmp_path_factory):
    """A tiny QwenImage21Pipeline (Qwen3-VL text encoder, 2.1 VAE, block-causal transformer), save_pretrained."""
    return _q21_dir(tmp_path_factory, "tiny-qwenimage21")


@pytest.fixture(scope="module")
def qwenimage21turbo_dir(tmp_path_factory):
    """The same with a Turbo's distilled ``sample_sigmas`` grid in its pipeline config."""
    return _q21_dir(tmp_path_factory, "tiny-qwenimage21turbo", TURBO_SIGMAS)


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-llada")
    model = build_remote_model(root / "llada", "llada")
    data = root / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a + 1}=?", "answer": f"#### {2 * a + 1}"}) + "\n"
                            for a in range(1, 9)))
    return model, data


def _gsm8k_file(path: Path) -> Path:
    path.write_text("".join(json.dumps({"question": f"{a}+{a + 1}=?", "answer": f"#### {2 * a + 1}"}) + "\n"
                            for a in range(1, 9)))
    return path


@pytest.fixture(scope="module")
def remote_block_dir(tmp_path_factory):
    """A tiny block-diffusion LM (block 4) as the released SDAR / TraDo checkpoints ship it: its own code behind
    ``auto_map``, loaded through ``AutoModelForCausalLM`` with ``trust_remote_code``; and a gsm8k-style data file."""
    from diffgrpo.models.remote_block import write_block_model
    from tests.helpers.remote_models import char_tokenizer

    root = tmp_path_factory.mktemp("tiny-remote-block")
    tok = char_tokenizer(mask_token=True)
    model = write_block_model(root / "model", tokenizer=tok, seed=0, vocab_size=len(tok), block_size=4,
                              initializer_range=0.3, mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id)
    return model, _gsm8k_file(root / "gsm8k.jsonl")


def _model_args(model: str, lora: bool, request) -> list[str]:
    if model == "builtin":
        args = ["train.task=digits", "model.image_size=8", "model.num_layers=2", "model.num_heads=2",
                "model.head_dim=8", "model.text_dim=16", "pretrain.steps=20", "pretrain.batch_size=16", "sampler.num_steps=4",
                "eval.seeds_per_prompt=1", "reward.weights={jpeg_incompressibility: 1.0}", "train.lr=1e-3"]
    elif model == "shapes":  # the built-in model on train.task=shapes (the tiny sizes of the shapes tests: one cache)
        args = ["train.task=shapes", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8", "model.text_dim=16",
                "pretrain.steps=10", "pretrain.batch_size=8", "sampler.num_steps=3", "eval.seeds_per_prompt=1",
                "reward.weights={jpeg_incompressibility: 1.0}", "train.lr=1e-3",
                *([] if lora else ["model.lora_rank=0"])]  # the task's default is a LoRA
    elif model in ("sd3", "wan"):
        d = request.getfixturevalue(f"{model}_dir")
        args = ["model.name=diffusers", f"model.pretrained={d}", "model.resolution=16", "model.max_sequence_length=8",
                "model.guidance_scale=3.0", "sampler.num_steps=3", "reward.weights={jpeg_incompressibility: 1.0}",
                f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
                "eval.seeds_per_prompt=1", "train.lr=0.05", *(["model.num_frames=5"] if model == "wan" else [])]
    elif model == "qwenimage21":
        d = request.getfixturevalue("qwenimage21_dir")
        args = ["model.name=diffusers", f"model.pretrained={d}", "model.resolution=64", "model.guidance_scale=3.0",
                "model.negative_prompt= ", "sampler.num_steps=3", "reward.weights={jpeg_incompressibility: 1.0}",
                f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
                "eval.seeds_per_prompt=1", "train.lr=0.05"]
    elif model == "qwenimage21turbo":  # the shipped config, sized down to CPU float32 (its training kept)
        from diffusers import FlowMatchEulerDiscreteScheduler

        from diffgrpo.models.pipelines.qwenimage21 import grid_shift

        d = request.getfixturevalue("qwenimage21turbo_dir")
        shift = grid_shift(FlowMatchEulerDiscreteScheduler.load_config(str(d), subfolder="scheduler"), 64)
        args = ["--config", str(TURBO_CONFIG), f"model.pretrained={d}", "model.dtype=float32",
                "model.mixed_precision=no", "model.resolution=64", "model.lora_alpha=8", "sampler.num_steps=3",
                f"sampler.shift={shift!r}", "reward.weights={jpeg_incompressibility: 1.0}",
                f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
                "eval.seeds_per_prompt=1", "train.lr=0.05", *([] if lora else ["model.lora_rank=0", "train.lr=0.002"])]
    elif model == "mlm":
        args = ["model.name=tiny_mlm", "dllm.eval_size=4", "pretrain.steps=20"]
    elif model == "block":
        args = ["model.name=tiny_block", "dllm.eval_size=4", "pretrain.steps=20"]
    else:
        d, data = request.getfixturevalue(f"{model}_dir")
        mask = [f"dllm.mask_token_id={LLADA_MASK}"] if model == "llada" else []  # the block model's tokenizer names it
        args = ["model.name=hf_masked_lm", f"dllm.model_path={d}", "dllm.trust_remote_code=true", *mask,
                "dllm.task=gsm8k", f"dllm.data_file={data}", "dllm.prompt_field=question", "dllm.prompt_length=16",
                "dllm.gen_length=8", "dllm.diffusion_steps=8", "dllm.eval_size=4",
                *([SPREAD_REWARD] if model == "remote_block" else [])]
    lora_key = "dllm.lora_rank" if model in ("mlm", "llada", "block", "remote_block") else "model.lora_rank"
    batch = ["train.prompts_per_batch=4", "train.group_size=2"] if model in QWEN21 else []
    return [*args, *COMMON, *batch, *([f"{lora_key}=4"] if lora else [])]


# ------------------------------------------------------------------------------------------ launching
def _launcher(launch: str, cli: str = "diffgrpo.cli") -> tuple[list[str], list[str]]:
    """(command prefix, extra overrides) of a launch mode running the command-line module ``cli``."""
    if launch == "one":
        return [sys.executable, "-m", cli], []
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
             "--master_port", str(free_port()), "-m", cli],
            [f"dist.mode={launch}", "dist.backend=gloo"])


def _env() -> dict:
    root = str(Path(__file__).resolve().parents[1])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root + "/src", root]))


def _run(cmd: list[str], timeout: float = 540) -> tuple[int, str]:
    p = subprocess.run(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                       check=False)
    return p.returncode, p.stdout


def _train_interrupted(cmd: list[str], run: Path) -> tuple[int, str]:
    """Start training, SIGTERM it (torchrun forwards the signal to its ranks) once the first checkpoint exists."""
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    deadline = time.time() + 480
    while time.time() < deadline and p.poll() is None and not (run / "checkpoints" / "latest.json").is_file():
        time.sleep(0.05)
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        text = p.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        text = p.communicate()[0]
        pytest.fail(f"the run did not end after SIGTERM:\n{text[-3000:]}")
    return p.returncode, text


# ------------------------------------------------------------------------------------------ reload and sample
def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
    for k, v in a.items():
        torch.testing.assert_close(v.float(), b[k].float(), rtol=0, atol=0, msg=k)


def _reload_and_sample(model: str, lora: bool, run: Path, exp: Path, merged: Path | None, request, tmp: Path):
    weights = load_file(str(run / "weights.safetensors"))
    if model in ("builtin", "shapes", "mlm", "block"):  # the library's own sampling from the run directory
        out = tmp / ("s.png" if model in ("builtin", "shapes") else "s.jsonl")
        prompt = {"builtin": ["--prompt", "a handwritten digit 3"], "shapes": ["--prompt", "a red circle"]}
        prompt = prompt.get(model, [])
        assert main(["sample", "--weights", str(run), "--num", "1", "--out", str(out), *prompt]) == 0
        assert out.is_file() and out.stat().st_size > 0
        if model == "mlm" and lora:  # a peft adapter on the cached pretrained built-in base (no base on the hub)
            from peft import PeftModel

            from diffgrpo import RunConfig
            from diffgrpo.models.hf_masked_lm import load_or_pretrain_mlm
            from diffgrpo.tasks import get_task

            cfg = RunConfig.from_overrides(_model_args("mlm", False, None))
            base = load_or_pretrain_mlm(get_task(cfg.dllm.task), cfg.pretrain, progress=False, log=lambda *a: None)
            net = PeftModel.from_pretrained(base, str(exp))
            _assert_same(load_file(str(exp / "adapter_model.safetensors")), weights)
            logits = net(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
            assert torch.isfinite(logits).all()
        elif model == "block" and lora:  # the adapter on the cached pretrained built-in block base
            from peft import PeftModel

            from diffgrpo import RunConfig
            from diffgrpo.models.tiny_block import load_or_pretrain_block
            from diffgrpo.tasks import get_task

            cfg = RunConfig.from_overrides(_model_args("block", False, None))
            base = load_or_pretrain_block(get_task(cfg.dllm.task), cfg.pretrain, progress=False, log=lambda *a: None)
            net = PeftModel.from_pretrained(base, str(exp))
            _assert_same(load_file(str(exp / "adapter_model.safetensors")), weights)
            assert torch.isfinite(net(input_ids=torch.tensor([[1, 2, 3, 4]])).logits).all()
        elif model == "block":
            from transformers import AutoModelForCausalLM

            from diffgrpo.models.tiny_block import block_lm_classes

            block_lm_classes()  # registers the built-in block model with the Auto classes
            net = AutoModelForCausalLM.from_pretrained(str(exp))
            _assert_same(net.state_dict(), weights)
            assert torch.isfinite(net(input_ids=torch.tensor([[1, 2, 3, 4]])).logits).all()
        elif model == "mlm":
            from transformers import AutoModelForMaskedLM

            net = AutoModelForMaskedLM.from_pretrained(str(exp))
            _assert_same({k: v for k, v in net.state_dict().items() if k in weights}, weights)
            logits = net(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
            assert torch.isfinite(logits).all()
        else:
            exported = load_file(str(exp / ("pytorch_lora_weights.safetensors" if lora
                                            else "diffusion_pytorch_model.safetensors")))
            _assert_same({k.removeprefix("transformer."): v for k, v in exported.items()}, weights)
        return
    if model in DIFFUSERS:
        import diffusers

        d = request.getfixturevalue(f"{model}_dir")
        cls = {"sd3": diffusers.StableDiffusion3Pipeline, "wan": diffusers.WanPipeline,
               "qwenimage21": diffusers.QwenImage21Pipeline, "qwenimage21turbo": diffusers.QwenImage21Pipeline}[model]
        kw = {"height": 16, "width": 16, "num_inference_steps": 2, "output_type": "pt", "max_sequence_length": 8}
        if model == "wan":
            kw["num_frames"] = 5
        if model in QWEN21:  # (64: a whole number of 2×2 latent slots; no max length; the Turbo: its own grid)
            kw = {"height": 64, "width": 64, "num_inference_steps": 3 if model == "qwenimage21turbo" else 2,
                  "output_type": "pt"}
        if lora:
            pipe = cls.from_pretrained(str(d))
            pipe.load_lora_weights(str(exp))
        else:
            tr_cls = type(cls.from_pretrained(str(d)).transformer)
            pipe = cls.from_pretrained(str(d), transformer=tr_cls.from_pretrained(str(exp)))
            _assert_same(pipe.transformer.state_dict(), weights)
        out = pipe(PROMPTS[:1], generator=torch.Generator().manual_seed(0), **kw)
        images = out.frames if model == "wan" else out.images
        assert torch.isfinite(torch.as_tensor(images)).all()
        full = cls.from_pretrained(str(merged))
        assert not any("lora" in n for n, _ in full.transformer.named_parameters())
        if not lora:
            _assert_same(full.transformer.state_dict(), weights)
        again = full(PROMPTS[:1], generator=torch.Generator().manual_seed(0), **kw)
        assert torch.isfinite(torch.as_tensor(again.frames if model == "wan" else again.images)).all()
        return
    if model == "remote_block":
        _reload_remote_block(lora, run, exp, weights, request, tmp)
        return
    from transformers import AutoModel

    d, _ = request.getfixturevalue("llada_dir")
    if lora:
        from peft import PeftModel

        net = PeftModel.from_pretrained(AutoModel.from_pretrained(str(d), trust_remote_code=True), str(exp))
        exported = load_file(str(exp / "adapter_model.safetensors"))
        _assert_same(exported, weights)
    else:
        net = AutoModel.from_pretrained(str(exp), trust_remote_code=True)
        _assert_same({k: v for k, v in net.state_dict().items() if k in weights}, weights)
    out = net(input_ids=torch.tensor([[5, 6, 7, LLADA_MASK]]))
    assert torch.isfinite(out.logits if hasattr(out, "logits") else out[0]).all()


def _reload_remote_block(lora: bool, run: Path, exp: Path, weights: dict, request, tmp: Path) -> None:
    """The export reloads as the released block models load (``AutoModelForCausalLM``, its own code; a LoRA as a
    peft adapter on the base directory) and equals the run's weights; a forward under the model's own block mask
    is finite; ``diffgrpo sample`` decodes from the run directory block by block with the exact cache."""
    from transformers import AutoModelForCausalLM

    d, _ = request.getfixturevalue("remote_block_dir")
    if lora:
        from peft import PeftModel

        net = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(d), trust_remote_code=True), str(exp))
        _assert_same(load_file(str(exp / "adapter_model.safetensors")), weights)
        assert any(float(v.abs().max()) > 0 for k, v in weights.items() if "lora_B" in k)  # trained: B moved off 0
    else:
        assert {"modeling_blockdlm.py", "configuration_blockdlm.py"} <= {p.name for p in exp.iterdir()}
        net = AutoModelForCausalLM.from_pretrained(str(exp), trust_remote_code=True)
        assert type(net).__name__ == "BlockDLMForCausalLM" and net.config.block_size == 4
        _assert_same(net.state_dict(), weights)
        start = AutoModelForCausalLM.from_pretrained(str(d), trust_remote_code=True).state_dict()
        assert any(not torch.equal(start[k], v) for k, v in weights.items())  # trained: not the initial weights
    assert torch.isfinite(net(input_ids=torch.tensor([[8, 9, 10, 11, 2, 2, 2, 2]])).logits).all()
    out = tmp / "s.jsonl"
    assert main(["sample", "--weights", str(run), "--num", "1", "--out", str(out), "--prompt", "1+2=?",
                 "dllm.trust_remote_code=true"]) == 0
    assert out.is_file() and out.stat().st_size > 0


# ------------------------------------------------------------------------------------------ the cells
def _cell(launch: str, model: str, kind: str, request, tmp_path: Path) -> None:
    lora = kind == "lora"
    prefix, dist_args = _launcher(launch, "tests.helpers.qwen3vl_cli" if model in QWEN21 else "diffgrpo.cli")
    run = tmp_path / "run"
    args = [*_model_args(model, lora, request), *dist_args]
    refused = REFUSED.get((launch, model, kind))
    if refused is not None:
        rc, text = _run([*prefix, "train", *args, "train.num_iterations=3", f"log.output_dir={run}"])
        errors = sorted({line for line in text.splitlines() if line.startswith("error: ")})
        assert rc != 0 and len(errors) == 1 and errors[0].startswith(refused), text[-3000:]
        assert not (run / "config.yaml").exists()
        return
    rc, text = _train_interrupted([*prefix, "train", *args, "train.num_iterations=3", f"log.output_dir={run}"], run)
    assert rc != 0 and "interrupted by signal 15; resume with" in text, text[-4000:]
    assert latest_complete(run) is not None, text[-4000:]
    if launch == "one":  # (torchrun itself prints its own SignalException traceback; the ranks exit cleanly)
        assert rc == 143 and "Traceback" not in text, text[-3000:]
    else:
        assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text[-4000:]
    code = ["dllm.trust_remote_code=true"] if model in REMOTE_CODE else []  # code keys are never taken from a run dir
    code += [SPREAD_REWARD] if model == "remote_block" else []
    rc, text = _run([*prefix, "train", "--resume", str(run), *dist_args, *code])
    assert rc == 0, text[-4000:]
    assert "resumed from" in text
    exported_name = "lora" if lora else "model" if model in ("mlm", "llada", "block", "remote_block") else "transformer"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "weights.safetensors", ".diffgrpo-run",
                 exported_name):
        assert (run / name).exists(), (name, sorted(p.name for p in run.iterdir()))
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) == {"start", "end"}
    its = [r["iteration"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward" in r]
    assert its == [1, 2, 3], its  # every iteration once: the interrupted run's rows after its checkpoint dropped
    if model == "shapes":  # the task's distance guards in the shapes encoder's features, at the start and the end
        evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/reward" in r]
        assert [r["iteration"] for r in evals] == [0, 3], evals
        assert all(isinstance(r.get(k), float) for r in evals for k in ("eval/fid", "eval/guard/kid")), evals
        assert evals[-1]["eval/guard/drift"] > 0, evals  # trained: the end samples moved off the base model's
    exp = tmp_path / "export"
    assert main(["export", str(run), *code, "--out", str(exp)]) == 0 and (exp / "README.md").is_file()
    merged = None
    if model in DIFFUSERS:
        merged = tmp_path / "merged"
        assert main(["export", str(run), "--out", str(merged), "--merge"]) == 0
    _reload_and_sample(model, lora, run, exp, merged, request, tmp_path)
    assert main(["report", str(run)]) == 0 and (run / "report.html").stat().st_size > 0


CELLS = [(launch, model, kind) for launch in LAUNCHES for model in MODELS for kind in ("full", "lora")]


@pytest.mark.parametrize("launch, model, kind", [
    pytest.param(*c, marks=() if c in FAST else pytest.mark.slow, id="-".join(c)) for c in CELLS])
def test_user_path(launch, model, kind, request, tmp_path):
    with qwen3vl_image_only_processor() if model in QWEN21 else contextlib.nullcontext():
        _cell(launch, model, kind, request, tmp_path)


def test_a_key_that_does_not_apply_is_refused_in_one_line_before_anything_loads(tmp_path):
    """The image models' LoRA key given to the masked LM (whose key is dllm.lora_rank): one line, exit 2, no run."""
    run = tmp_path / "run"
    rc, text = _run([sys.executable, "-m", "diffgrpo.cli", "train", *_model_args("mlm", False, None),
                     "model.lora_rank=4", f"log.output_dir={run}"])
    assert rc == 2 and text.strip().splitlines() == [text.strip()], text
    assert text.startswith("error: model.lora_rank: does not apply to model.name=tiny_mlm")
    assert not run.exists()


@pytest.mark.parametrize("lora", [0, 4])
def test_fsdp2_shards_each_decoder_layer_of_the_remote_block_model(remote_block_dir, lora):
    """What the FSDP2 cells shard one by one below the root: the block model's decoder layers (``model.layers``),
    under a peft wrapper too; a run that sharded only the root would still pass the cells."""
    from diffgrpo.models.hf_masked_lm import load_hf_masked_lm, transformer_blocks

    pol = load_hf_masked_lm(str(remote_block_dir[0]), trust_remote_code=True, lora_rank=lora)
    base = pol.model.get_base_model() if lora else pol.model
    layers = list(base.model.layers)
    assert len(layers) == 2 and all(type(m).__name__ == "BlockDLMDecoderLayer" for m in layers)
    assert [id(m) for m in transformer_blocks(pol.model)] == [id(m) for m in layers]
