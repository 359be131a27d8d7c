"""Memory and time of one masked-LM training step under the ``dllm.*`` scale options (CPU, one thread).

A LLaDA-style remote-code model (the test's modeling file at a mid size, random weights) is loaded through
``load_hf_masked_lm`` in each configuration (a fresh process each, so peak RSS is that configuration's own):
float32 full fine-tune, bfloat16 full fine-tune, bfloat16 + LoRA, bfloat16 + LoRA + gradient checkpointing. One
step = the masked-diffusion loss on B sequences (prompt + completion) → backward → AdamW step; reported: the
process's peak resident memory growth over the loaded model, the trainable parameters and their optimizer state,
and the step time (median of ``--repeats``).

    PYTHONPATH=src:. python benchmarks/dllm_scale_memory.py --out benchmarks/results/dllm_scale/memory.md
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"float32 full": dict(dtype="float32"), "bfloat16 full": dict(dtype="bfloat16"),
           "bfloat16 + LoRA r=16": dict(dtype="bfloat16", lora_rank=16),
           "bfloat16 + LoRA r=16 + ckpt": dict(dtype="bfloat16", lora_rank=16, gradient_checkpointing=True)}
SIZE = dict(d_model=512, n_heads=8, mlp_hidden=1408, max_positions=512)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(model_dir: str, name: str, batch: int, prompt: int, gen: int, repeats: int) -> dict:
    import torch

    from diffgrpo.models.hf_masked_lm import load_hf_masked_lm, masked_diffusion_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    pol = load_hf_masked_lm(model_dir, trust_remote_code=True, mask_token_id=2, **CONFIGS[name])
    params = pol.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-5)
    vocab = len(pol.vocab)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (batch, prompt), generator=g)
    comps = torch.randint(10, vocab, (batch, gen), generator=g)
    base = _rss_mib()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = masked_diffusion_loss(pol.logits, prompts, comps, pol.mask_id, generator=g)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    weights = sum(p.numel() * p.element_size() for p in pol.model.parameters())
    return {"config": name, "weights_mib": weights / 2**20, "trainable": sum(p.numel() for p in params),
            "adam_state_mib": state / 2**20, "step_peak_growth_mib": _rss_mib() - base,
            "peak_rss_mib": _rss_mib(), "step_s": sorted(times)[len(times) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.child[0], a.child[1], a.batch, a.prompt, a.gen, a.repeats)))
        return
    from tests.helpers.remote_models import build_remote_model

    with tempfile.TemporaryDirectory() as d:
        path = build_remote_model(Path(d) / "llada", "llada", n_layers=a.layers, **SIZE)
        rows = []
        for name in CONFIGS:
            cmd = [sys.executable, __file__, "--child", str(path), name, "--batch", str(a.batch), "--prompt",
                   str(a.prompt), "--gen", str(a.gen), "--repeats", str(a.repeats)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            rows.append(json.loads(out))
            print(rows[-1], flush=True)
    n = rows[0]["trainable"]
    lines = [f"LLaDA-style model, {a.layers} blocks, d_model {SIZE['d_model']}, {n / 1e6:.1f} M parameters; one step "
             f"on {a.batch} × ({a.prompt} prompt + {a.gen} completion) tokens; CPU, 1 thread; median of {a.repeats}.",
             "", ("| configuration | weights MiB | trainable params | AdamW state MiB | peak RSS growth in the steps "
                  "MiB | peak RSS MiB | step s |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['weights_mib']:.1f} | {r['trainable']:,} | {r['adam_state_mib']:.1f} | "
                     f"{r['step_peak_growth_mib']:.0f} | {r['peak_rss_mib']:.0f} | {r['step_s']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
