"""Where each second of a suite cell goes, and how much of the device's bf16 peak the forwards reach.

Time shares (per engine row of ``bench_engines``, fractions of the iteration's wall-clock):
  sample   the sampler's forwards (an engine's rollout-time backwards excluded: they are train)
  reward   decoding and scoring
  train    the train phase (recompute forwards, backwards, buffers; rollout-time backwards included)
  other    the rest (encoding, planning, advantages, weights)

Throughput. The FLOPs of one network forward per sample are counted once per model by
``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions and attention from the operator shapes; the
elementwise operators are not counted) on a batch of one at the cell's shapes. From the counters (sample-forwards,
a backward ≈ 2 forwards, as in the cost model):
  sample TFLOP/s   rollout no-grad forwards × FLOPs / sample seconds
  model TFLOP/s    (F_nograd + F_grad + 2·B_samples) × FLOPs / iteration seconds
and each as a fraction of the device's dense bf16 peak (``PEAK_BF16``, by device name; ``--peak-tflops`` for a
device not in the table; none on a CPU unless given).
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

# dense (no sparsity) bf16 tensor-core peak, FLOP/s, from the vendors' data sheets; matched by substring of
# torch.cuda.get_device_name, first match wins (so "H100 PCIe" before "H100")
PEAK_BF16 = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def peak_bf16(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """Dense bf16 peak FLOP/s of ``device``: ``override_tflops`` if > 0, else the table's entry; None if unknown."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def peak_for_name(name: str) -> float | None:
    """The table's dense bf16 peak for a CUDA device name (first key contained in it), None if absent."""
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def counted_flops(fn) -> int:
    """FLOPs of ``fn()`` as FlopCounterMode counts them (no grad)."""
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())


def flow_forward_flops(policy, prompt: str = "a photo") -> int:
    """FLOPs of one CFG-free transformer forward of one sample of ``policy`` (its latent shape, its conditioning)."""
    cond = policy.encode([prompt])
    x = torch.zeros(1, *policy.latent_shape, device=policy.device, dtype=torch.float32)
    sigma = torch.full((1,), 0.5, device=policy.device)
    saved = dict(policy.counters)
    scale, policy.guidance_scale = policy.guidance_scale, 1.0
    try:
        return counted_flops(lambda: policy.velocity(x, sigma, cond))
    finally:
        policy.guidance_scale = scale
        policy.counters.update(saved)


def time_shares(row: dict) -> dict:
    """Fractions of the iteration: sample, reward, train, other (see the module docstring)."""
    it = max(row["iteration_s"], 1e-12)
    s = {"sample": row["sample_s"] / it, "reward": row["reward_s"] / it, "train": row["train_s"] / it}
    s["other"] = max(0.0, 1.0 - sum(s.values()))
    return s


def throughput(row: dict, flops: int, peak: float | None) -> dict:
    """Sample and model TFLOP/s of one ``bench_engines`` row and their fractions of ``peak`` (None if unknown)."""
    c = row["counters"]
    sample_fwd = c["forwards_nograd"] - c["train_forwards_nograd"]  # the rollout's no-grad forwards
    sample = sample_fwd * flops / max(row["sample_s"], 1e-12)
    model = (c["forwards_nograd"] + c["forwards_grad"] + 2 * c["sample_backwards"]) * flops / max(
        row["iteration_s"], 1e-12)
    return {"sample_tflops": sample / 1e12, "model_tflops": model / 1e12,
            "sample_peak_fraction": None if peak is None else sample / peak,
            "model_peak_fraction": None if peak is None else model / peak}


def annotate(rows: list[dict], flops: int, peak: float | None) -> None:
    """Add ``shares`` and ``throughput`` to every row in place."""
    for r in rows:
        r["shares"] = time_shares(r)
        r["throughput"] = throughput(r, flops, peak)


def fraction(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"
