"""Masked diffusion LMs at scale: remote-code LLaDA / Dream models through the one loading path, bf16, LoRA (reference
= adapter disabled), gradient checkpointing, chat templates, prompt/answer files, the numeric verifier and the other
verifiers as registry rewards, d1's format rewards; a CLI run in bf16 with LoRA whose adapter, reloaded with peft,
reproduces its completions; DDP and FSDP2 (2 gloo ranks) equal one process on the union of the samples.

bf16 on the CPU: torch runs bfloat16 matmuls on every x86 CPU (natively with AVX512-BF16 / AMX, emulated
otherwise), so the CLI test runs in bfloat16 everywhere; the development machine has avx512_bf16 and amx_bf16."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from diffgrpo import ConfigError, RunConfig, Trainer
from diffgrpo.rewards import REWARDS, compute_rewards
from diffgrpo.rewards.verifiers import (
    MAX_CHARS,
    d1_format_components,
    extract_boxed,
    last_number,
    numeric_correct,
    parse_number,
    predicted_number,
    reference_number,
)
from diffgrpo.samplers import masked
from tests.helpers.distributed import free_port, leave_gloo
from tests.helpers.remote_models import build_remote_model

ROOT = Path(__file__).resolve().parents[1]
LLADA_MASK = 2  # the tiny LLaDA tokenizer names no mask token: the id is configured, as LLaDA's 126336


# ---------------------------------------------------------------------------------------------- verifiers
def test_numeric_verifier_reads_boxed_then_answer_tag_then_last_number():
    assert extract_boxed(r"so \boxed{12} then \boxed{\frac{3}{4}}") == r"\frac{3}{4}"
    assert extract_boxed(r"\boxed{7") is None and extract_boxed("no box") is None
    assert predicted_number(r"first 3, then \boxed{42} and 5 more") == 42  # the box wins over the last number
    assert predicted_number("<answer>\nit is 18\n</answer> (checked 3 times)") == 18  # d1's answer tag next
    assert predicted_number("after 3 steps the total is 1,234.") == 1234  # thousands separator, final period
    assert predicted_number("the change is -17 degrees") == -17 and predicted_number("x = -0.50") == Fraction(-1, 2)
    assert predicted_number(r"\boxed{\$1,000.00}") == 1000
    assert predicted_number(r"\boxed{\dfrac{1}{3}}") == Fraction(1, 3)
    assert predicted_number("3/4 of them") == Fraction(3, 4) and predicted_number("none") is None
    assert reference_number("She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18") == 18  # GSM8K's tail first
    assert numeric_correct(r"\boxed{72.0}", "#### 72") and numeric_correct("the answer is $72", "72")
    assert not numeric_correct(r"\boxed{71}", "#### 72") and not numeric_correct("72 or 73", "#### 72")
    assert not numeric_correct("1,23", "123") and numeric_correct("1,230", "1230")  # a comma is a separator only by 3s
    assert parse_number("1" * 41) is None and parse_number("1/0") is None and parse_number("abc") is None
    # floats would say 0.1 + 0.2 != 0.3 the other way round; exact fractions compare exactly
    assert numeric_correct(r"\boxed{0.3}", "0.30") and not numeric_correct(r"\boxed{0.30000000000000004}", "0.3")


@pytest.mark.parametrize("text", [
    "9" * 60000, "-" * 60000, r"\boxed{" * 20000, "{" * 30000 + "}" * 30000, "1," * 30000, "<answer>" * 7000,
    "1.1." * 15000, "\\fbox{" * 10000 + "7", "x" * (MAX_CHARS + 1), "٣٤", "\x00\\boxed{\x00}", None, 12, b"7"])
def test_verifiers_never_raise_on_adversarial_inputs(text):
    t0 = time.perf_counter()
    for fn in (extract_boxed, last_number, predicted_number, reference_number, parse_number):
        fn(text)
    assert numeric_correct(text, "#### 7") in (False, True)
    comps = d1_format_components(text)
    assert all(isinstance(v, float) for v in comps.values())
    for name in ("verify_gsm8k", "verify_countdown", "verify_sudoku", "verify_json_schema", "d1_format"):
        (v,) = REWARDS[name]([text], ["1,2,3:6"], [{"answer": "#### 7"}])
        assert isinstance(v, float)
    assert time.perf_counter() - t0 < 5.0  # linear work: no catastrophic backtracking or quadratic scans


def test_unicode_digits_are_not_numbers():
    assert predicted_number("٧٢") is None and not numeric_correct("٧٢", "72")


def test_registry_verifiers_read_the_reference_from_metadata():
    from diffgrpo.tasks import get_task

    comps = [r"so \boxed{18}", "<answer>\n17\n</answer>", "nothing"]
    total, parts = compute_rewards({"verify_gsm8k": 1.0}, comps, ["q"] * 3, [{"answer": "... #### 18"}] * 3)
    assert total.tolist() == [1.0, 0.0, 0.0]
    for name in ("countdown", "sudoku", "json_schema"):  # the task's own verifier on its reference answers
        task = get_task(name)
        ex = task.instances("test")[:4]
        good = REWARDS[f"verify_{name}"]([e.answer for e in ex], [e.prompt for e in ex],
                                         [{"answer": e.answer} for e in ex])
        assert good == [task.reward(e.answer, e)["reward"] for e in ex] == [1.0] * 4
        bad = REWARDS[f"verify_{name}"](["?" + e.answer for e in ex], [e.prompt for e in ex],
                                        [{"answer": e.answer} for e in ex])
        assert max(bad) < 1.0
    # an image (not a string) and a prompt that is no instance score 0 instead of raising
    assert REWARDS["verify_countdown"]([torch.zeros(3)], ["not a puzzle"], [{}]) == [0.0]
    # d1's format rewards: strict + soft + the four tags once (nothing after the closing tag)
    full = "<reasoning>\nadd them\n</reasoning>\n<answer>\n7\n</answer>\n"
    assert d1_format_components(full) == {"format_strict": 0.5, "format_soft": 0.5, "format_xmlcount": 0.5}
    soft = "<reasoning>add</reasoning> <answer>7</answer>"
    assert d1_format_components(soft)["format_strict"] == 0.0 and d1_format_components(soft)["format_soft"] == 0.5
    assert REWARDS["d1_format"]([full, "7"], ["q", "q"], [{}, {}]) == [1.5, 0.0]


# ---------------------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    return {kind: build_remote_model(root / kind, kind) for kind in ("llada", "dream")}


def _raw(path, dtype=torch.float32):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(path), trust_remote_code=True, dtype=dtype).eval()


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_remote_code_models_load_through_the_one_path(models, kind):
    """LLaDA: position j scores token j; Dream: its raw logits are shifted by one (position j−1 scores token j);
    bf16 weights with float32 logits; the chat template with a system prompt is the tokenizer's own."""
    from diffgrpo.models.hf_masked_lm import load_hf_masked_lm

    path = models[kind]
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_hf_masked_lm(str(path), trust_remote_code=False)
    mask = LLADA_MASK if kind == "llada" else None
    if kind == "llada":  # LLaDA configs default to 126336, outside this tiny vocabulary: refused, naming the key
        with pytest.raises(ConfigError, match=r"dllm\.mask_token_id: the mask id 126336 is outside"):
            load_hf_masked_lm(str(path), trust_remote_code=True)
    pol = load_hf_masked_lm(str(path), trust_remote_code=True, mask_token_id=mask, system_prompt="be brief")
    assert pol.logits_shift == (kind == "dream") and pol.mask_id == 2 and pol.vocab.chat_template
    tok = pol.vocab.tok
    want = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4=?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert want.startswith("<|system|>be brief<|eot|><|user|>3+4=?") and want.endswith("<|assistant|>")
    ids = pol.vocab.encode_prompts(["3+4=?"], 40)
    assert ids[0, -len(tok.encode(want)):].tolist() == tok.encode(want) and ids[0, 0] == tok.pad_token_id
    x = torch.cat([ids, torch.full((1, 6), pol.mask_id)], 1)
    raw = _raw(path)
    with torch.no_grad():
        ref = raw(input_ids=x, attention_mask=(x != tok.pad_token_id).long()).logits
        out = pol(x)
    if kind == "dream":
        assert torch.equal(out[:, 1:], ref[:, :-1])
    else:
        assert torch.equal(out, ref)
    bf = load_hf_masked_lm(str(path), trust_remote_code=True, mask_token_id=mask, dtype="bfloat16")
    assert {p.dtype for p in bf.model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        lo = bf(x)
    assert lo.dtype == torch.float32 and (lo - out).abs().max() < 0.1 * out.abs().max()


def test_lora_reference_is_the_adapter_disabled_and_checkpointing_keeps_gradients(models):
    from diffgrpo.models.hf_masked_lm import (
        LORA_TARGETS,
        load_hf_masked_lm,
        transformer_blocks,
    )

    path = models["llada"]
    kw = dict(trust_remote_code=True, mask_token_id=LLADA_MASK, lora_rank=4)
    pol = load_hf_masked_lm(str(path), **kw)
    names = [n for n, _ in pol.named_trainable_parameters().items()]
    assert names and all("lora_" in n for n in names) and {n.split(".")[-4] for n in names} == set(LORA_TARGETS[0])
    assert all(p.dtype == torch.float32 for p in pol.trainable_parameters())
    x = torch.cat([pol.vocab.encode_prompts(["1+2=?", "13+14=?"], 12), torch.full((2, 6), LLADA_MASK)], 1)
    with torch.no_grad():
        base = pol(x)
        for n, p in pol.model.named_parameters():  # move the adapter (B starts at 0)
            if "lora_B" in n:
                p.add_(0.3 * torch.randn_like(p))
        moved = pol(x)
        with pol.reference():
            ref = pol(x)
    assert not torch.allclose(moved, base) and torch.equal(ref, base)
    assert pol._ref is None  # no copy of the weights
    # gradient checkpointing: the same adapter gradient as without
    grads = []
    for ckpt in (False, True):
        p2 = load_hf_masked_lm(str(path), gradient_checkpointing=ckpt, **kw)
        p2.load_state_dict(pol.state_dict())
        calls = []
        for block in transformer_blocks(p2.model):  # count the checkpointed block forwards
            if ckpt:
                fn = block._gradient_checkpointing_func
                block._gradient_checkpointing_func = lambda *a, _fn=fn, **k: calls.append(1) or _fn(*a, **k)
        p2(x).logsumexp(-1).sum().backward()
        assert len(calls) == (2 if ckpt else 0)  # both blocks, in train mode with dropout off
        grads.append(torch.cat([p.grad.flatten() for p in p2.trainable_parameters()]))
    assert grads[0].norm() > 0 and torch.allclose(grads[0], grads[1], atol=1e-5)


# ---------------------------------------------------------------------------------------------- data and config
def _gsm8k_file(path: Path, n=8, start=1) -> Path:
    rows = [{"question": f"{a}+{a + 1}=?", "answer": f"{a} plus {a + 1} is {2 * a + 1}\n#### {2 * a + 1}"}
            for a in range(start, start + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _scale_overrides(model_dir, data, *extra):
    return ["model.name=hf_masked_lm", f"dllm.model_path={model_dir}", "dllm.trust_remote_code=true",
            f"dllm.mask_token_id={LLADA_MASK}", "dllm.task=gsm8k", f"dllm.data_file={data}",
            "dllm.prompt_field=question", "dllm.prompt_length=16", "dllm.gen_length=8", "dllm.diffusion_steps=8",
            "train.prompts_per_batch=2", "train.group_size=4", "dllm.eval_size=4", "log.progress=false",
            "log.save_images=false", *extra]


def test_config_refuses_bad_combinations_before_loading(tmp_path, models):
    data = _gsm8k_file(tmp_path / "g.jsonl")
    bad = {"dllm.data_file": ["model.name=hf_masked_lm", "dllm.model_path=x", "dllm.task=gsm8k"],
           "dllm.task": ["model.name=tiny_mlm", "dllm.task=gsm8k", f"dllm.data_file={data}",
                         "dllm.prompt_field=question"],
           "dllm.chat_template": ["model.name=tiny_mlm", "dllm.chat_template=true"],
           "dllm.lora_target_modules": ["model.name=tiny_mlm", "dllm.lora_target_modules=query"],
           "dllm.dtype": [*_scale_overrides(models["llada"], data), "dllm.lora_rank=4", "dllm.dtype=bfloat16",
                          "dist.mode=fsdp2"],
           "dllm.eval_file": [*_scale_overrides(models["llada"], data), f"dllm.eval_file={tmp_path / 'none.jsonl'}"]}
    for key, overrides in bad.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
            RunConfig.from_overrides(overrides)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="dllm.data_file.*solution"):  # the answer field must exist
        RunConfig.from_overrides(_scale_overrides(models["llada"], data, "dllm.answer_field=solution"))


def test_hf_datasets_spec_feeds_the_same_examples(tmp_path):
    pytest.importorskip("datasets")
    from diffgrpo.tasks import examples_from_file, get_task

    data = _gsm8k_file(tmp_path / "g.jsonl")
    task = get_task("gsm8k")
    a = examples_from_file(str(data), task, prompt_field="question")
    b = examples_from_file(f"hf:json:{data}", task, prompt_field="question")
    assert [(e.prompt, e.answer) for e in a] == [(e.prompt, e.answer) for e in b]


def test_family_uses_file_prompts_chat_template_format_reward_and_eval_file(tmp_path, models):
    data, held = _gsm8k_file(tmp_path / "g.jsonl"), _gsm8k_file(tmp_path / "h.jsonl", n=3, start=50)
    cfg = RunConfig.from_overrides(_scale_overrides(models["dream"], data, f"dllm.eval_file={held}",
                                                    "dllm.format_reward=0.5", "dllm.lora_rank=2", "loss.beta=0.1",
                                                    "dllm.mask_token_id=-1", "seed=3"))
    logs = []
    tr = Trainer(cfg, log=logs.append)
    fam = tr.family
    assert [e.prompt for e in fam.eval_pool] == ["50+51=?", "51+52=?", "52+53=?"]
    assert not any("longer than dllm.prompt_length" in str(m) for m in logs)  # 16 tokens hold every prompt
    from diffgrpo.dllm.family import warn_long_prompts

    # "a+b=?" is 5 tokens, 8 with the template's user / end-of-turn / assistant tokens
    assert warn_long_prompts(tr.policy.vocab, fam.train_pool, 7, logs.append) == 8
    assert "8 of 8 prompts are longer than dllm.prompt_length=7 tokens (longest 8" in logs[-1]
    assert warn_long_prompts(tr.policy.vocab, fam.train_pool, 8, logs.append) == 0
    ro = tr.rollout()
    assert set(ro.prompts) <= {f"{a}+{a + 1}=?" for a in range(1, 9)}
    seq = ro.traj.sequences[0, :16].tolist()
    tok = tr.policy.vocab.tok
    want = tok.encode(tok.apply_chat_template([{"role": "user", "content": ro.prompts[0]}], tokenize=False,
                                              add_generation_prompt=True))
    assert seq[-len(want):] == want  # the prompt went through the chat template
    comps = ro.reward_components
    expect = comps["correct"] + 0.5 * (comps["format_strict"] + comps["format_soft"] + comps["format_xmlcount"])
    torch.testing.assert_close(ro.rewards, expect)
    stats, info = tr.update(ro)  # LoRA + KL reference (adapter disabled) train without a weight copy
    assert tr.policy._ref is None and stats.metrics["kl"] < 1e-8
    ev, _ = tr.evaluate()
    assert 0.0 <= ev["eval/accuracy"] <= 1.0


# ---------------------------------------------------------------------------------------------- the CLI run
def _env():
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    return env


@pytest.mark.slow
def test_cli_trains_a_remote_code_model_with_lora_in_bf16_and_peft_reproduces_it(tmp_path, models):
    """``diffgrpo train`` on a tiny remote-code LLaDA-style model: LoRA, bfloat16 weights, a JSONL prompt set, its
    chat template, the GSM8K verifier. The run's adapter (``<run>/lora``), loaded onto the base with peft,
    reproduces the completions ``diffgrpo sample`` makes from the run, and differs from the base model."""
    from peft import PeftModel

    assert torch.ones(2, dtype=torch.bfloat16).sum().item() == 2.0  # bf16 available on this CPU
    data = _gsm8k_file(tmp_path / "g.jsonl")
    run = tmp_path / "run"
    ov = _scale_overrides(models["llada"], data, "dllm.lora_rank=8", "dllm.lora_alpha=16", "dllm.dtype=bfloat16",
                          "dllm.system_prompt=answer with a number", "train.num_iterations=3", "train.lr=0.05",
                          "train.group_size=6", "dllm.temperature=1.5", "eval.every=0", "train.save_every=0",
                          "model.device=cpu", f"log.output_dir={run}", "seed=1")
    res = subprocess.run([sys.executable, "-m", "diffgrpo.cli", "train", *ov], capture_output=True, text=True,
                         env=_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (run / "lora" / "adapter_config.json").is_file() and (run / "lora" / "adapter_model.safetensors").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward" in r]
    assert len(trained) == 3 and any(r["grad_norm"] > 0 for r in trained)
    prompts = ["3+4=?", "10+11=?", "7+8=?"]
    out = tmp_path / "s.txt"
    res = subprocess.run([sys.executable, "-m", "diffgrpo.cli", "sample", "--weights", str(run), "--sde-type", "ode",
                          "--num", "1",
                          "--out", str(out), *sum((["--prompt", p] for p in prompts), []),
                          "dllm.trust_remote_code=true"],  # a saved config never enables remote code by itself
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sampled = [line.split("\t", 1)[1] for line in out.read_text().splitlines()]
    # independent reload: the base in bf16 + the run's adapter through peft, the chat template by hand
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models["llada"]))
    base = _raw(models["llada"], torch.bfloat16)
    net = PeftModel.from_pretrained(base, str(run / "lora")).eval()
    ids = torch.full((3, 16), tok.pad_token_id)
    for b, p in enumerate(prompts):
        t = tok.encode(tok.apply_chat_template([{"role": "system", "content": "answer with a number"},
                                                {"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True))[-16:]
        ids[b, 16 - len(t):] = torch.tensor(t)

    def logits_fn(x):
        return net(input_ids=x, attention_mask=(x != tok.pad_token_id).long()).logits.float()

    def decode(smp):
        texts = []
        for c in smp.completions.tolist():
            c = c[:c.index(tok.eos_token_id)] if tok.eos_token_id in c else c
            texts.append(tok.decode([i for i in c if i != tok.pad_token_id]))
        return texts

    with torch.no_grad():
        kw = dict(mask_id=LLADA_MASK, gen_length=8, block_length=8, steps=8, temperature=0.0)
        mine = decode(masked.sample(logits_fn, ids, **kw))
        with net.disable_adapter():
            x = torch.cat([ids, torch.full((3, 8), LLADA_MASK)], 1)
            base_logits = logits_fn(x)
        lora_logits = logits_fn(x)
    assert mine == sampled
    assert (lora_logits - base_logits).abs().max() > 1e-3  # the adapter trained: not the base model


# ---------------------------------------------------------------------------------------------- DDP / FSDP2
DIST_CASES = {"ddp-lora": ["dist.mode=ddp", "dllm.lora_rank=4", "loss.beta=0.05"],
              "fsdp2-full": ["dist.mode=fsdp2", "dllm.method=coupled_grpo", "dist.group_layout=spread"],
              "fsdp2-lora": ["dist.mode=fsdp2", "dllm.lora_rank=4", "loss.beta=0.05"]}
DIST_COMMON = ["engine.micro_batch_size=2", "train.lr=3e-3", "train.max_grad_norm=0", "dllm.temperature=1.5",
               "dist.backend=gloo"]


def _dist_trainer(model_dir, data, extra, *, world):
    ov = _scale_overrides(model_dir, data, *DIST_COMMON, *extra, "seed=0")
    if world == 1:
        ov = [o for o in ov if not o.startswith("dist.mode")]
    return Trainer(RunConfig.from_overrides(ov), log=lambda *a: None)


def _digit_share(texts, examples):
    """Share of digit characters in each completion (varies within a group, unlike a random model's accuracy)."""
    r = torch.tensor([sum(c.isdigit() for c in t) / max(len(t), 1) for t in texts])
    return {"reward": r, "correct": (r > 0.5).float()}


def _dist_worker(rank, world, port, model_dir, data, out_dir):
    from datetime import timedelta

    import torch.distributed as dist

    from diffgrpo import distributed

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    for name, extra in DIST_CASES.items():
        tr = _dist_trainer(model_dir, data, extra, world=world)
        if "fsdp2" in name:
            from diffgrpo.models.hf_masked_lm import transformer_blocks

            assert all(hasattr(b, "reshard") for b in transformer_blocks(tr.policy.model))  # sharded per block
            tr.evaluate()  # as training does: no-grad forwards first
        tr.family.task.rewards = _digit_share  # a random model's answers are never right: a reward that varies
        ro = tr.rollout()
        stats, _ = tr.update(ro)
        full = distributed.to_full(tr.policy.state_dict())  # a collective: every rank
        if rank == 0 and "fsdp2" in name:  # the end-of-run export from sharded weights (rank 0 only, as training)
            from safetensors.torch import save_file

            run = Path(out_dir) / f"{name}-run"
            run.mkdir()
            save_file(full, str(run / "weights.safetensors"))
            tr.policy.export(run)
        torch.save({"grads": [distributed.to_full(p.grad).detach().clone() for p in tr.params],
                    "prompts": ro.prompts, "group_ids": ro.group_ids, "rewards": ro.rewards,
                    "advantages": ro.advantages, "trained": ro.trained, "loss_weights": ro.loss_weights,
                    "traj": {k: getattr(ro.traj, k) for k in ("sequences", "log_probs", "masks", "mask_weights",
                                                               "ref_log_probs", "token_weights", "strata", "groups")}},
                   os.path.join(out_dir, f"{name}-rank{rank}.pt"))
    leave_gloo()


def _load_export(run: Path, base_dir: Path) -> dict:
    """The trained weights an export directory holds, as the ecosystem loads them: → {"weights": full state of the
    trainable part, "saved": the run's weights.safetensors}."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(run / "weights.safetensors"))
    if (run / "lora").is_dir():
        net = PeftModel.from_pretrained(_raw(base_dir), str(run / "lora"))
        weights = dict(get_peft_model_state_dict(net))
    else:
        weights = _raw(run / "model").state_dict()
    return {"weights": weights, "saved": saved}


@pytest.fixture(scope="module")
def dist_results(models, tmp_path_factory):
    import torch.multiprocessing as mp

    data = _gsm8k_file(tmp_path_factory.mktemp("distdata") / "g.jsonl")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_dist_worker, args=(2, free_port(), str(models["llada"]), str(data), d), nprocs=2, join=True)
        out = {name: [torch.load(os.path.join(d, f"{name}-rank{r}.pt"), weights_only=False) for r in range(2)]
               for name in DIST_CASES}
        for name in DIST_CASES:  # what the FSDP2 export wrote, loaded back with transformers / peft
            if "fsdp2" in name:
                out[name][0]["exported"] = _load_export(Path(d) / f"{name}-run", models["llada"])
        yield data, out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DIST_CASES))
def test_ddp_and_fsdp2_equal_one_process_on_the_union(dist_results, models, name):
    """Two gloo ranks (DDP, or FSDP2 sharded per transformer block; LoRA or full fine-tune) hold after one update
    the gradient one process computes on the union of their rollouts (advantages over whole groups, the token-mean
    normaliser over both ranks)."""
    from diffgrpo.advantages import group_advantages
    from diffgrpo.losses import aggregation_weights
    from diffgrpo.types import Rollout, TokenTrajectory

    data, results = dist_results
    parts = results[name]
    spread = "spread" in " ".join(DIST_CASES[name])
    B = len(parts[0]["prompts"])
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    gids = torch.cat([p["group_ids"] + (0 if spread else r * B) for r, p in enumerate(parts)])
    tr = _dist_trainer(models["llada"], data, DIST_CASES[name], world=1)
    fam, a = tr.family, tr.cfg.advantage
    adv, _ = group_advantages(cat("rewards"), gids, std_mode=fam.std_mode, baseline=fam.baseline, clip=a.clip,
                              eps=a.eps)
    torch.testing.assert_close(cat("advantages"), adv)
    assert not torch.equal(parts[0]["traj"]["sequences"], parts[1]["traj"]["sequences"])  # own samples per rank
    trained = cat("trained")
    lw = aggregation_weights(trained, tr.cfg.loss.aggregation)
    torch.testing.assert_close(cat("loss_weights") / 2, lw)  # × W on each rank, averaged by DDP / FSDP2
    tj = parts[0]["traj"]
    fields = {k: (tj[k] if k == "groups" or tj[k] is None else torch.cat([p["traj"][k] for p in parts])) for k in tj}
    traj = TokenTrajectory(prompt_length=fields["sequences"].shape[1] - fam.gen_length, records={}, **fields)
    ro = Rollout(prompts=parts[0]["prompts"] + parts[1]["prompts"], group_ids=gids, traj=traj, selected=trained,
                 trained=trained, rewards=cat("rewards"), advantages=adv, loss_weights=lw)
    tr.optimizer.zero_grad(set_to_none=True)
    tr.backward(ro)
    g1 = torch.cat([p.grad.flatten() for p in tr.params])
    assert g1.norm() > 0 and float(adv.abs().sum()) > 0
    for p in parts:
        g = torch.cat([x.flatten() for x in p["grads"]])
        assert ((g - g1).norm() / g1.norm()) < 1e-5
    if "exported" in parts[0]:  # FSDP2's export (from the gathered weights) loads back to the same weights
        ex = parts[0]["exported"]
        assert set(ex["saved"]) <= set(ex["weights"]) and ex["saved"]
        for k, v in ex["saved"].items():
            assert torch.equal(ex["weights"][k], v), k
