"""A remote-code block-diffusion LM in the layout of the released SDAR / TraDo checkpoints
(``diffgrpo.models.remote_block``), saved by the test into a temporary directory with ``auto_map`` / ``model_type`` /
``block_size`` in its config.json and loaded as the released checkpoints are (``AutoModelForCausalLM``,
``trust_remote_code``): the masked-LM adapter reads its block from the config, gives it the 4-D block-causal mask it
needs, decodes it block by block with the exact cache, and ``diffgrpo train`` trains it. Nothing is downloaded."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffgrpo.models.block_cache import BlockKVCache
from diffgrpo.models.hf_masked_lm import load_hf_masked_lm
from diffgrpo.models.remote_block import write_block_model
from diffgrpo.samplers.block import sample_blocks
from tests.helpers.remote_models import char_tokenizer

B_SIZE, P, L = 4, 8, 8
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = char_tokenizer(mask_token=True)
    return write_block_model(tmp_path_factory.mktemp("blockdlm") / "model", tokenizer=tok, seed=0,
                             vocab_size=len(tok), block_size=B_SIZE, initializer_range=0.3,
                             mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)


def _policy(model_dir):
    return load_hf_masked_lm(str(model_dir), trust_remote_code=True)


def _prompts(pol):
    return pol.vocab.encode_prompts(["1+2=?", "33+4=?", "7-5=?", "9+9+9=?"], P)  # (4, P) left-padded


def test_loads_as_the_released_checkpoints_and_reads_its_block_from_the_config(model_dir):
    from transformers import AutoModelForCausalLM

    data = json.loads((model_dir / "config.json").read_text())
    assert data["model_type"] == "blockdlm" and data["block_size"] == B_SIZE
    assert data["auto_map"]["AutoModelForCausalLM"] == "modeling_blockdlm.BlockDLMForCausalLM"
    raw = AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=True).eval()
    pol = _policy(model_dir)
    assert pol.block_size == B_SIZE and pol.store_kv and type(pol.model).__name__ == "BlockDLMForCausalLM"
    g = torch.Generator().manual_seed(0)
    x = torch.randint(7, len(pol.vocab), (2, P + L), generator=g)
    with torch.no_grad():
        base = pol.logits(x)
        torch.testing.assert_close(base, raw(input_ids=x).logits, rtol=0, atol=0)  # the model's own block mask
        y = x.clone()
        y[:, P + 5] = (y[:, P + 5] + 1) % len(pol.vocab)  # a token of completion block 1 (positions P+4 .. P+7)
        moved = (pol.logits(y) - base).abs().amax(-1)  # (2, N)
    assert float(moved[:, :P + 4].max()) == 0.0 and float(moved[:, P + 4:].min()) > 0
    # left padding of one block is excluded: rotary scores depend on relative positions only, so a row padded by
    # one block scores its tokens as the unpadded row does
    padded = torch.cat([torch.full((2, B_SIZE), pol.pad_id), x[:, B_SIZE:]], 1)
    with torch.no_grad():
        alone = raw(input_ids=x[:, B_SIZE:]).logits
        torch.testing.assert_close(pol.logits(padded)[:, B_SIZE:], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decode,temperature,lora", [("schedule", 0.0, 0), ("threshold", 1.0, 0), ("schedule", 1.0, 4)])
def test_cached_and_uncached_block_rollouts_are_equal(model_dir, decode, temperature, lora):
    """The exact cache (the model stores keys only when asked, ``store_kv``, as the released code) reproduces the
    uncached block rollout token for token, with dynamic length on, and computes fewer positions; also through a
    peft LoRA wrapper (its adapter moved off zero so that it changes the logits)."""
    pol = load_hf_masked_lm(str(model_dir), trust_remote_code=True, lora_rank=lora)
    if lora:
        assert pol.lora and pol.store_kv
        with torch.no_grad():
            for n, p in pol.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
            x = _prompts(pol)
            with pol.model.disable_adapter():
                base = pol.logits(x)
            assert float((pol.logits(x) - base).abs().max()) > 1e-3
    out = []
    for cache in (None, BlockKVCache(pol)):
        g = torch.Generator().manual_seed(3)
        out.append(sample_blocks(pol, _prompts(pol), mask_id=pol.mask_id, gen_length=L, block_length=B_SIZE,
                                 steps=L if decode == "schedule" else 0, temperature=temperature, generator=g,
                                 decode=decode, threshold=0.3, cache=cache, eos_id=pol.eos_id))
    plain, cached = out
    assert torch.equal(plain.sequences, cached.sequences) and torch.equal(plain.commit_step, cached.commit_step)
    torch.testing.assert_close(plain.step_log_prob, cached.step_log_prob, atol=1e-5, rtol=0)
    assert cached.query_tokens < plain.query_tokens


def _rollouts(pol, x, decode, temperature):
    """The uncached and the cached block rollout of prompts ``x`` on the same draws."""
    out = []
    for cache in (None, BlockKVCache(pol)):
        g = torch.Generator().manual_seed(3)
        out.append(sample_blocks(pol, x, mask_id=pol.mask_id, gen_length=L, block_length=B_SIZE,
                                 steps=L if decode == "schedule" else 0, temperature=temperature, generator=g,
                                 decode=decode, threshold=0.3, cache=cache, eos_id=pol.eos_id))
    return out


@pytest.mark.parametrize("decode,temperature", [("schedule", 0.0), ("threshold", 1.0)])
def test_bf16_weights_and_the_exact_cache_in_bf16(model_dir, decode, temperature):
    """``dllm.dtype=bfloat16`` loads bf16 weights (logits scored in float32). With an attention kernel whose output
    at a position does not depend on keys masked out after it (torch's math kernel) the cached bf16 rollout equals
    the uncached one exactly: the cache holds the keys and values the uncached forward computes. The default CPU
    kernel (flash attention) rounds a bf16 position differently by the number of masked keys beside it (one bf16
    ulp), so the prompt's keys from the second layer on differ between a forward of the prompt alone (the cache's
    prefill) and of the prompt and its blocks (the uncached step): the rollouts are then equal token for token
    with step log-probs apart by bf16 round-off, within twice the largest logit error of the bf16 forward against
    the float32 forward of the same weights."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pol = load_hf_masked_lm(str(model_dir), trust_remote_code=True, dtype="bfloat16")
    assert {p.dtype for p in pol.model.parameters()} == {torch.bfloat16}
    x = _prompts(pol)
    with torch.no_grad():
        assert pol.logits(torch.cat([x, torch.full((4, L), pol.mask_id)], 1)).dtype == torch.float32
    with sdpa_kernel([SDPBackend.MATH]):
        plain, cached = _rollouts(pol, x, decode, temperature)
    assert torch.equal(plain.sequences, cached.sequences) and torch.equal(plain.commit_step, cached.commit_step)
    assert torch.equal(plain.step_log_prob, cached.step_log_prob) and cached.query_tokens < plain.query_tokens
    plain, cached = _rollouts(pol, x, decode, temperature)
    assert torch.equal(plain.sequences, cached.sequences) and torch.equal(plain.commit_step, cached.commit_step)
    with torch.no_grad():
        err = float((pol.logits(cached.sequences) - _policy(model_dir).logits(cached.sequences)).abs().max())
    assert 0 < err < 0.5  # bf16 round-off, not a different model
    assert float((plain.step_log_prob - cached.step_log_prob).abs().max()) <= 2 * err


def _chat_ids(tok, prompt, system=""):
    """``tok.apply_chat_template`` of one user turn (with the system turn if given) and the generation prompt."""
    msgs = [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": prompt}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_template_wraps_the_prompt_and_the_first_block_starts_at_a_block_boundary(model_dir, tmp_path):
    """With ``dllm.chat_template=auto`` (the tokenizer has one) the policy encodes each prompt as the tokenizer's
    ``apply_chat_template(..., add_generation_prompt=True)``. The prompt length (10, not a multiple of the block) is
    rounded up to 12 and prompts are left-padded to it, so the completion starts at a block boundary (position
    12, block 3) with the template's last token just before it; the released SDAR code instead starts the prompt
    at position 0 and denoises its tail in the first block. The family's rollout equals the uncached block
    rollout of the hand-built, left-padded template ids."""
    from diffgrpo import RunConfig, Trainer
    from diffgrpo.dllm import decoding

    qs = ["1+2=?", "33+4=?", "12+34=?"]  # 8, 9, 10 tokens with the template
    data = tmp_path / "g.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 3"}) + "\n" for q in qs))
    cfg = RunConfig.from_overrides(_overrides(model_dir, data, tmp_path / "run", "dllm.prompt_length=10"))
    pol = _policy(model_dir)
    tok = pol.vocab.tok
    assert pol.vocab.chat_template and tok.chat_template
    fam = Trainer(cfg, policy=pol, log=lambda *a: None).family
    P = fam.prompt_length
    assert P == 12 and P % B_SIZE == 0
    want = torch.full((len(qs), P), tok.pad_token_id)
    for b, q in enumerate(qs):
        ids = _chat_ids(tok, q)
        assert pol.vocab.prompt_ids(q) == ids and ids != tok.encode(q, add_special_tokens=False)
        assert tok.convert_ids_to_tokens(ids)[-1] == "<|assistant|>" and len(ids) == 8 + b
        want[b, P - len(ids):] = torch.tensor(ids)
    smp = fam.generate(fam.train_pool, temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert smp.sequences.shape == (len(qs), P + L) and torch.equal(smp.sequences[:, :P], want)
    opts = {k: v for k, v in decoding.sampler_options(cfg.dllm).items() if k != "cache_refresh"}
    ref = sample_blocks(pol, want, mask_id=pol.mask_id, gen_length=L, block_length=B_SIZE, steps=fam.steps,
                        temperature=1.0, generator=torch.Generator().manual_seed(5), eos_id=pol.eos_id, **opts)
    assert torch.equal(ref.sequences, smp.sequences) and bool((smp.sequences[:, P:] != pol.mask_id).all())


def digit_share(completions, prompts, metadata):
    """Share of digits in each completion: varies inside a group of a random model (its accuracy does not)."""
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]


def _env():
    return dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")


def _overrides(model_dir, data, run, *extra):
    return ["model.name=hf_masked_lm", f"dllm.model_path={model_dir}", "dllm.trust_remote_code=true",
            "dllm.task=gsm8k", f"dllm.data_file={data}", "dllm.prompt_field=question", "dllm.prompt_length=6",
            "dllm.gen_length=8", "dllm.temperature=1.5", "dllm.eval_size=4", "train.num_iterations=2",
            "train.prompts_per_batch=2", "train.group_size=3", "train.lr=0.05", "log.progress=false",
            "log.save_images=false", "model.device=cpu", f"log.output_dir={run}", "seed=1",
            "reward.weights={task: 1.0, tests.test_block_remote:digit_share: 1.0}", *extra]


def _train_file(tmp_path):
    data = tmp_path / "g.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a + 1}=?", "answer": f"#### {2 * a + 1}"}) + "\n"
                            for a in range(1, 9)))
    return data


def test_diffgrpo_train_trains_the_remote_block_model(model_dir, tmp_path):
    """Two iterations through the command line; the run's model directory reloads with the model's own code."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    ov = _overrides(model_dir, _train_file(tmp_path), run)
    res = subprocess.run([sys.executable, "-m", "diffgrpo.cli", "train", *ov], capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward" in r]
    assert [r["iteration"] for r in trained] == [1, 2] and any(r["grad_norm"] > 0 for r in trained)
    net = AutoModelForCausalLM.from_pretrained(str(run / "model"), trust_remote_code=True)
    assert net.config.block_size == B_SIZE
    weights = load_file(str(run / "weights.safetensors"))
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
    start = AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=True).state_dict()
    assert any(not torch.equal(start[k], v) for k, v in weights.items())  # trained: not the initial weights


def test_diffgrpo_train_in_bf16_with_the_chat_template_and_a_system_prompt(model_dir, tmp_path):
    """``dllm.dtype=bfloat16`` with the tokenizer's chat template and a system prompt through the command line:
    both iterations run with finite metrics and a nonzero gradient, the prompts fit (no truncation warning), and
    the exported model is bf16."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    ov = _overrides(model_dir, _train_file(tmp_path), run, "dllm.dtype=bfloat16", "dllm.chat_template=auto",
                    "dllm.system_prompt=be brief", "dllm.prompt_length=18")  # the longest prompt: 18 tokens
    res = subprocess.run([sys.executable, "-m", "diffgrpo.cli", "train", *ov], capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "longer than dllm.prompt_length" not in res.stdout + res.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward" in r]
    assert [r["iteration"] for r in trained] == [1, 2] and any(r["grad_norm"] > 0 for r in trained)
    assert all(math.isfinite(v) for r in trained for v in r.values() if isinstance(v, float))
    net = AutoModelForCausalLM.from_pretrained(str(run / "model"), trust_remote_code=True, dtype="auto")
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("extra,error", [
    ("dllm.block_length=2", "error: dllm.block_length: value 2 differs from the block-causal model's block size 4"),
    ("dllm.gen_length=6", "error: dllm.gen_length: value 6 is not a multiple of the model's block size 4"),
    ("dllm.kv_cache=prefix", "error: dllm.kv_cache: value 'prefix' does not apply to a block-causal model")])
def test_the_models_block_is_checked_from_its_config_before_it_loads(model_dir, tmp_path, capsys, extra, error):
    """A local model directory's ``block_size`` (config.json) governs the decoding sizes: a conflicting key is one
    line at validation, before the model loads (the run directory is never made)."""
    from diffgrpo.cli.app import main

    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"question": "1+2=?", "answer": "#### 3"}) + "\n")
    run = tmp_path / "run"
    assert main(["train", "model.name=hf_masked_lm", f"dllm.model_path={model_dir}", "dllm.trust_remote_code=true",
                 "dllm.task=gsm8k", f"dllm.data_file={data}", "dllm.prompt_field=question", "dllm.gen_length=8",
                 extra, f"log.output_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(error), err
    assert not run.exists()
