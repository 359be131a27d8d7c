"""The suite's masked-LM cell: a bidirectional transformer at LLaDA-8B's published shape (random weights, bf16,
LoRA), one GRPO iteration (diffu_grpo) per rollout decoder: the step-per-token schedule and the confidence
threshold decoder, with and without the dual key/value cache.

LLaDA-8B (GSAI-ML/LLaDA-8B-Base and -Instruct ``config.json``): d_model 4096, 32 layers, 32 heads (32 kv heads),
mlp_hidden_size 12288 (SwiGLU: three 4096 × 12288 matrices), vocabulary 126464, RMSNorm, RoPE, no weight tying:
about 8.0B parameters. LLaDA's own modelling code takes no key/value cache, so the cell uses a transformers BERT
(bidirectional, fills a transformers ``Cache``) with the same hidden size, layers, heads and vocabulary and an
intermediate size of 1.5 × 12288 = 18432, so that its two-matrix GELU MLP has the parameters and matmul FLOPs of
LLaDA's three-matrix SwiGLU MLP (learned positions instead of RoPE, LayerNorm instead of RMSNorm: negligible
FLOPs). The task is the built-in arithmetic task's prompts (its character vocabulary; the output layer still
spans the 126464 ids), completions of ``gen`` tokens in blocks of ``block``.

Random weights make no token confident, so ``threshold`` commits one token per step here (the minimum): this cell
measures what a forward costs at this shape and what the cache's window saves, not how many tokens a trained
model commits per step (that is measured on the trained tiny models, ``benchmarks/dllm_decode.py``).
"""
from __future__ import annotations

import time

import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.models.hf_masked_lm import MaskedLMPolicy, configure_model, tiny_bert
from diffgrpo.tasks import VOCAB, get_task

from .throughput import counted_flops, fraction

LLADA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=18432)
# per size: architecture, vocabulary size, completion tokens, block length, prompts, group, LoRA rank
SIZES = {
    "real": dict(arch=LLADA_8B, vocab=126464, gen=256, block=32, prompts=1, group=4, lora_rank=32),
    "small": dict(arch=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1152),
                  vocab=126464, gen=64, block=16, prompts=1, group=4, lora_rank=8),
    "toy": dict(arch=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48),
                vocab=256, gen=16, block=8, prompts=1, group=2, lora_rank=4),
}
DECODERS = {"schedule": [], "thr0.9": ["dllm.decode=threshold", "dllm.decode_threshold=0.9"],
            "thr0.9+dual": ["dllm.decode=threshold", "dllm.decode_threshold=0.9", "dllm.kv_cache=dual"]}


class WideVocab:
    """The built-in character vocabulary read through an output layer of ``size`` ids: ids past the characters
    (which a random-weight model samples) decode as "?"; everything else is the character vocabulary's."""

    def __init__(self, base, size: int):
        self.base, self.size = base, size
        self.unknown = base.index["?"]

    def __len__(self) -> int:
        return self.size

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        return self.base.decode([i if i < len(self.base) else self.unknown for i in ids], stop_at_eos=stop_at_eos)

    def __getattr__(self, name):
        return getattr(self.base, name)


def build_net(size: str, device: str, dtype: str, seed: int = 0) -> torch.nn.Module:
    s = SIZES[size]
    task = get_task("arithmetic")
    torch.manual_seed(seed)
    with torch.device(device):
        net = tiny_bert(s["vocab"], max_positions=task.prompt_length + s["gen"], **s["arch"])
    return configure_model(net, dtype=dtype, lora_rank=s["lora_rank"], lora_alpha=float(s["lora_rank"]))


def cell_config(size: str, decoder: str, device: str) -> RunConfig:
    s = SIZES[size]
    return RunConfig.from_overrides([
        # hf_masked_lm: the completion length is free (the policy is built here; the path names it only)
        "model.name=hf_masked_lm", "dllm.model_path=random-init-llada-8b-shape", "dllm.task=arithmetic",
        f"dllm.gen_length={s['gen']}",
        f"dllm.block_length={s['block']}", f"train.prompts_per_batch={s['prompts']}",
        f"train.group_size={s['group']}", "loss.beta=0", f"model.device={device}", "log.progress=false",
        "log.save_images=false", "eval.every=0", "dllm.eval_size=0", "dllm.p_mask_prompt=0", "seed=0",
        *DECODERS[decoder]])


def sequence_flops(policy, length: int) -> int:
    """FLOPs of one forward of one sequence of ``length`` tokens (FlopCounterMode)."""
    ids = torch.full((1, length), VOCAB.mask_id, dtype=torch.long, device=policy.device)
    saved = dict(policy.counters)
    try:
        return counted_flops(lambda: policy.logits(ids))
    finally:
        policy.counters.update(saved)


def one_iteration(tr: Trainer) -> dict:
    """A rollout and the first update's backward (the bench's iteration), timed."""
    tr.optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    ro, first = tr.family.collect()
    stats = first if first is not None else tr.family.backward(ro, 0)
    t_iter = time.perf_counter() - t0
    if tr.device.type == "cuda":
        torch.cuda.synchronize(tr.device)
    smp = ro.traj
    return {"iteration_s": t_iter, "sample_s": ro.timings["sample"], "reward_s": ro.timings["reward"],
            "train_s": stats.seconds.get("train", 0.0), "sequences": smp.sequences.shape[0]}


def run_mlm_cell(size: str, device: str, *, dtype: str = "bfloat16", peak: float | None = None,
                 decoders: list[str] | None = None, log=print) -> dict:
    """One iteration per decoder (after a warm-up iteration) on one network; rows with counts, times, shares and
    throughput."""
    s = SIZES[size]
    net = build_net(size, device, dtype)
    policy = MaskedLMPolicy(net, vocab=WideVocab(VOCAB, s["vocab"]), device=device, keep_reference=False)
    N = get_task("arithmetic").prompt_length + s["gen"]
    flops = sequence_flops(policy, N)
    rows = []
    for name in decoders or list(DECODERS):
        tr = Trainer(cell_config(size, name, device), policy=policy, log=lambda *a: None)
        samples = record_samples(tr.family)
        one_iteration(tr)  # warm-up: allocations, the cache check
        c0 = dict(policy.counters)
        r = one_iteration(tr)
        smp = samples[-1]  # the timed rollout's MaskedSample: its sequence-forwards and positions computed
        row = {"decoder": name, **r, "forwards_nograd": policy.counters["forwards_nograd"] - c0["forwards_nograd"],
               "forwards_grad": policy.counters["forwards_grad"] - c0["forwards_grad"],
               "sample_forwards": smp.forwards, "query_tokens": smp.query_tokens, "flops_per_forward": flops}
        row.update(mlm_throughput(row, r["sequences"] * s["gen"], N, peak))
        rows.append(row)
        log(f"[mlm] {name}: {row['iteration_s']:.2f} s per iteration, {row['fwd_per_tok']:.3f} forwards per token")
    return {"parameters": sum(p.numel() for p in net.parameters()),
            "trainable_parameters": sum(p.numel() for p in policy.trainable_parameters()),
            "sequence": N, "gen": s["gen"], "block": s["block"], "batch": s["prompts"] * s["group"],
            "arch": s["arch"], "vocab": s["vocab"], "rows": rows}


def record_samples(family) -> list:
    """Keep every MaskedSample the family's sampler returns (the rollout does not hand it on)."""
    samples, generate = [], family.generate

    def recording(*args, **kw):
        samples.append(generate(*args, **kw))
        return samples[-1]

    family.generate = recording
    return samples


def mlm_throughput(row: dict, n_tok: int, N: int, peak: float | None) -> dict:
    """Forwards and positions per completion token of the sampler, time shares, TFLOP/s and peak fractions."""
    it = max(row["iteration_s"], 1e-12)
    fwd, q = row["sample_forwards"], row["query_tokens"]
    sample_flops = q / N * row["flops_per_forward"]  # a cached step computes its window only
    shares = {"sample": row["sample_s"] / it, "reward": row["reward_s"] / it, "train": row["train_s"] / it}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    tflops = sample_flops / max(row["sample_s"], 1e-12) / 1e12
    return {"fwd_per_tok": fwd / n_tok, "cost_per_tok": q / N / n_tok, "shares": shares,
            "sample_tflops": tflops, "sample_peak_fraction": None if peak is None else tflops * 1e12 / peak}


def to_markdown(cell: dict) -> list[str]:
    lines = ["", f"Masked LM at {'LLaDA-8B' if cell['arch'] == LLADA_8B else 'a reduced'} shape "
                 f"({cell['parameters'] / 1e9:.3f}B parameters, {cell['trainable_parameters'] / 1e6:.1f}M trainable "
                 f"LoRA; sequence {cell['sequence']}, {cell['gen']} completion tokens in blocks of {cell['block']}, "
                 f"batch {cell['batch']}; one diffu_grpo iteration per decoder):", "",
             "| decoder | fwd/tok | cost/tok | sample s | reward s | train s | iter s | sample % | reward % | "
             "train % | sample TFLOP/s | of peak |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in cell["rows"]:
        sh = r["shares"]
        lines.append(f"| {r['decoder']} | {r['fwd_per_tok']:.3f} | {r['cost_per_tok']:.3f} | {r['sample_s']:.3f} | "
                     f"{r['reward_s']:.3f} | {r['train_s']:.3f} | {r['iteration_s']:.3f} | {100 * sh['sample']:.0f} | "
                     f"{100 * sh['reward']:.0f} | {100 * sh['train']:.0f} | {r['sample_tflops']:.3g} | "
                     f"{fraction(r['sample_peak_fraction'])} |")
    return lines
