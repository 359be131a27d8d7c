"""The GPU suite (benchmarks/gpu/suite.sh) at toy size on the CPU: the same script, models, cells and bf16 weights a
GPU run uses, so it cannot rot before a GPU is lent. Every engine runs against recompute in every cell that fits the toy
budget; the exact engines reproduce recompute's gradient; the tables carry the command and the hardware line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffgrpo.engines import ENGINES, FORWARD_ENGINES

LIKELIHOOD_ENGINES = set(ENGINES) - set(FORWARD_ENGINES)  # the suite's default variants

ROOT = Path(__file__).resolve().parents[1]
EXACT = ("retain", "reweight", "single_step")  # exact against recompute on the same rollout and steps


def test_gpu_suite_runs_at_toy_size(tmp_path):
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "SUITE_TIMEOUT": "90"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "suite.sh"), "--size", "toy", "--out", str(out),
                           "--threads", "1", "--peak-tflops", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rep = json.loads((out / "suite.json").read_text())
    assert rep["size"] == "toy" and rep["device"] == "cpu" and rep["hardware"].startswith("CPU only")
    assert rep["dtype"] == "bfloat16"  # the weights' dtype of a GPU run: its casts are exercised here
    assert set(rep["models"]) == {"sd3", "wan", "flux"} or set(rep["models"]) >= {"sd3"}
    cells = {(c["model"], c["cell"]): c for c in rep["cells"]}
    assert ("sd3", "full") in cells and ("sd3", "lora+ckpt") in cells
    for key, c in cells.items():
        assert c["status"] == "ok" or c["status"].startswith("skipped ("), (key, c["status"])
    assert ("sd3", "full+compile") not in cells  # on request only at toy size (the slow test below)
    for key in (("sd3", "full"), ("sd3", "lora+ckpt"), ("mlm", "lora")):
        assert cells[key]["status"] == "ok", cells[key]
    assert rep["peak_bf16_flops"] == 1e12  # --peak-tflops 1: the CPU has no table entry
    for (model, cell), c in cells.items():
        if c["status"] != "ok" or model == "mlm":
            continue
        assert c["flops_per_forward"] > 0
        rows = {r["variant"]: r for r in c["rows"]}
        for r in rows.values():  # where each second goes: shares of the iteration, throughput against the peak
            sh, tp = r["shares"], r["throughput"]
            assert all(0 <= v <= 1 for v in sh.values()) and sum(sh.values()) == pytest.approx(1, abs=1e-6)
            assert sh["sample"] > 0 and sh["train"] > 0 and r["first_iteration_s"] > 0
            assert tp["model_peak_fraction"] == pytest.approx(tp["model_tflops"] / 1.0)
            assert tp["sample_tflops"] > 0
        if cell.endswith("+compile"):  # compile on/off: recompute compiled, against the eager cell's recompute
            assert set(rows) == {"recompute"} and c["compiled"]
            continue
        assert set(rows) == LIKELIHOOD_ENGINES
        assert (out / model / cell / "engines.json").is_file()
        for name, r in rows.items():
            assert r["peak_memory_bytes"] > 0 and r["train_s"] > 0 and r["ideal_train_speedup"] > 0
            if name in EXACT:  # up to bf16 rounding of the gradients (8 mantissa bits: ~4e-3 per rounding)
                assert r["grad_cos_vs_recompute"] > 1 - 1e-4 and r["grad_relerr_vs_recompute"] < 2e-2, (model, cell, r)
            else:  # JAGG's interpolated Jacobians: an approximation, close on these models
                assert 0.5 < r["grad_cos_vs_recompute"] <= 1 + 1e-9
        assert rows["recompute"]["train_speedup"] == pytest.approx(1.0)
        assert rows["recompute"]["grad_cos_vs_recompute"] == pytest.approx(1.0)  # a gradient, not zeros
        assert rows["jagg"]["ideal_train_speedup"] == pytest.approx(2.0)  # one window of W = 4: W/2
        lora = cell.startswith("lora")
        assert (c["trainable_parameters"] < rep["models"][model]["parameters"]) is lora
    mlm = cells[("mlm", "lora")]["mlm"]
    dec = {r["decoder"]: r for r in mlm["rows"]}
    assert set(dec) == {"schedule", "thr0.9", "thr0.9+dual"} and mlm["trainable_parameters"] < mlm["parameters"]
    assert dec["schedule"]["fwd_per_tok"] == 1.0 and dec["schedule"]["cost_per_tok"] == 1.0  # one token per step
    assert dec["thr0.9+dual"]["cost_per_tok"] < dec["thr0.9"]["cost_per_tok"]  # the cached window
    for r in dec.values():
        assert r["forwards_grad"] > 0 and r["train_s"] > 0 and 0 < r["sample_peak_fraction"]
    md = (out / "suite.md").read_text()
    assert "Command: `bash benchmarks/gpu/suite.sh --size toy" in md and "Hardware: CPU only" in md
    assert "Where each second goes" in md and "| sd3 | full | reweight |" in md
    assert "| thr0.9+dual |" in md
    assert md.count("| sd3 | full |") == 2 * len(LIKELIHOOD_ENGINES)  # the engines table and the seconds table


def test_bench_keep_going_drops_a_failing_variant_and_keeps_the_others(monkeypatch):
    """At real sizes one engine may run out of memory; with keep_going the others are still measured and the
    failure is reported, without it the benchmark stops."""
    from diffgrpo import RunConfig
    from diffgrpo.engines.single_step import SingleStepEngine
    from diffgrpo.models.tiny import build_tiny_policy
    from diffgrpo.studies.engines import bench_engines
    from tests.helpers.tiny import TINY

    def oom(self, ctx, rollout, epoch=0):
        raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB\nmore detail")

    monkeypatch.setattr(SingleStepEngine, "backward", oom)
    cfg = RunConfig.from_overrides([*TINY, "model.device=cpu", "loss.beta=0"])
    torch.manual_seed(0)
    policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
    rep = bench_engines(cfg, ["recompute", "single_step", "jagg:window=2"], repeats=1, log=lambda *a: None,
                        keep_going=True, policy=policy)
    assert [r["variant"] for r in rep["rows"]] == ["recompute", "jagg:window=2"]
    assert rep["errors"] == {"single_step": "RuntimeError: CUDA out of memory. Tried to allocate 80.00 GiB"}
    assert rep["rows"][1]["grad_cos_vs_recompute"] > 0.99  # W = 2 is exact
    with pytest.raises(RuntimeError, match="out of memory"):
        bench_engines(cfg, ["recompute", "single_step"], repeats=1, log=lambda *a: None, policy=policy)


def test_peak_table_reads_the_device_name():
    """The bf16 peak a fraction is taken of: H200 = 989 TFLOP/s dense; the PCIe H100 is not the SXM one."""
    from benchmarks.gpu.throughput import peak_bf16, peak_for_name

    assert peak_for_name("NVIDIA H200") == 989e12
    assert peak_for_name("NVIDIA H100 PCIe") == 756e12 and peak_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_for_name("NVIDIA GeForce GTX 1080") is None
    assert peak_bf16(torch.device("cpu")) is None and peak_bf16(torch.device("cpu"), 2.5) == 2.5e12


@pytest.mark.slow
def test_gpu_suite_compiled_cell_against_eager_at_toy_size(tmp_path):
    """``+compile``: recompute with model.compile (the toy size's eager backend: Dynamo's graph capture) against the
    same cell eager; the × eager column is the eager iteration over the compiled one."""
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "SUITE_TIMEOUT": "600"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "suite.sh"), "--size", "toy", "--out", str(out),
                           "--threads", "1", "--models", "sd3", "--cells", "full,full+compile", "--variants",
                           "recompute", "--budget", "500", "--cell-limit", "240"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=660, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rep = json.loads((out / "suite.json").read_text())
    cells = {c["cell"]: c for c in rep["cells"]}
    assert cells["full"]["status"] == "ok" and cells["full+compile"]["status"] == "ok", cells
    assert cells["full+compile"]["compiled"] and not cells["full"]["compiled"]
    (eager,), (compiled,) = cells["full"]["rows"], cells["full+compile"]["rows"]
    assert eager["variant"] == compiled["variant"] == "recompute"
    assert compiled["first_iteration_s"] > compiled["iteration_s"]  # the warm-up compiles
    ratio = eager["iteration_s"] / compiled["iteration_s"]
    md = (out / "suite.md").read_text()
    assert f"| {ratio:.2f} |" in md.split("| sd3 | full+compile | recompute | ")[2]  # the seconds table's last column
    assert rep["peak_bf16_flops"] is None and "| n/a |" in md  # a CPU has no peak without --peak-tflops
