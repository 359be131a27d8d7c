"""The GPU suite: every gradient engine against ``recompute`` on transformers at real sizes (random weights, no
download), with and without LoRA and activation checkpointing, through ``diffgrpo.studies.engines.bench_engines`` (what
``diffgrpo bench engines`` runs). Run it with ``bash benchmarks/gpu/suite.sh`` (one H200: at most 8 minutes);
``--size toy`` runs the same cells on the CPU at toy sizes (CI), ``--size small`` gives the CPU memory table.

Per model and cell (full fine-tune or LoRA, checkpointing on or off, micro-batches) it writes
``<out>/<model>/<cell>/engines.{json,md}`` and, after every cell, the aggregate ``<out>/suite.json`` and
``<out>/suite.md`` (command, hardware line, model sizes, one row per engine and cell). A cell that fails (out of
memory) or runs past ``--cell-limit`` is recorded as such and the suite goes on; cells that cannot finish before
``--budget`` seconds are skipped and listed.

Where each second goes (``benchmarks/gpu/throughput.py``): per engine and cell the time shares of sampling, reward
and train phase, the forwards' TFLOP/s and their fraction of the device's dense bf16 peak, the warm-up iteration;
``+compile`` cells (``model.compile``) against the same cell eager; the masked-LM cell at LLaDA-8B's shape with
both rollout decoders (``benchmarks/gpu/mlm.py``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import signal
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `python benchmarks/gpu/suite.py` from the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu import mlm  # noqa: E402
from benchmarks.gpu.models import MODELS, build_policy, build_transformer, parameter_count  # noqa: E402
from benchmarks.gpu.throughput import annotate, flow_forward_flops, fraction, peak_bf16  # noqa: E402
from diffgrpo import RunConfig  # noqa: E402
from diffgrpo.distributed import resolve_device  # noqa: E402
from diffgrpo.engines import ENGINES, FORWARD_ENGINES  # noqa: E402
from diffgrpo.models.regional_compile import repeated_blocks  # noqa: E402
from diffgrpo.studies.engines import bench_engines  # noqa: E402

# cell name → (LoRA adapter, gradient checkpointing, engine.micro_batch_size); the rank is the size's lora_rank.
# "<cell>+compile": the same cell with model.compile (regional, the size's compile_backend), compared with <cell>;
# it runs COMPILE_VARIANTS only (its blocks are compiled in place and reset to eager after the cell)
CELLS = {"full": (False, False, 0), "full+ckpt": (False, True, 0), "lora": (True, False, 0),
         "lora+ckpt": (True, True, 0), "full+mb2": (False, False, 2), "lora+mb2": (True, False, 2)}
COMPILE_VARIANTS = ["recompute"]  # compile on/off: the baseline engine, eager (the <cell> row) against compiled
# per size: (model, cells, prompts per batch, group size); full fine-tune cells first (LoRA adds layers in place);
# "mlm": the masked-LM cell at LLaDA-8B's shape (benchmarks/gpu/mlm.py), its cell names the decoders' LoRA run
PLANS = {
    "real": [("sd3", ["full", "full+compile", "full+ckpt", "lora", "lora+ckpt"], 2, 2), ("mlm", ["lora"], 1, 4),
             ("wan", ["lora", "lora+ckpt"], 2, 2), ("flux", ["lora+ckpt"], 1, 2), ("flux2_klein", ["lora+ckpt"], 1, 2),
             ("wan22_a14b", ["lora+ckpt"], 1, 2)],
    # toy: the masked-LM cell first (about 3 s on an idle CPU; its budget share is added to the toy budget below)
    "toy": [("mlm", ["lora"], 1, 2), ("sd3", ["full", "full+compile", "lora+ckpt"], 2, 2),
            ("wan", ["lora+ckpt"], 2, 2), ("flux", ["lora+ckpt"], 2, 2), ("flux2_klein", ["lora+ckpt"], 1, 2),
            ("wan22_a14b", ["lora+ckpt"], 1, 2)],
    "small": [("sd3", ["full", "full+ckpt", "full+mb2", "lora", "lora+ckpt", "lora+mb2"], 2, 2)],
}
# cells a size runs only when --cells names them: at toy size Dynamo's tracing of the SD3 blocks alone takes longer
# than CI's cell limit (tests/test_gpu_suite.py runs it under the slow marker)
ON_REQUEST = {"toy": {"full+compile"}}
DEFAULTS = {"real": dict(budget=450.0, cell_limit=150.0, dtype="bfloat16", lora_rank=32, compile_backend="inductor"),
            # the GPU's dtype paths; compilation by Dynamo's graph capture alone (no inductor C++ build on a CPU)
            "toy": dict(budget=55.0, cell_limit=16.0, dtype="bfloat16", lora_rank=4, compile_backend="eager"),
            "small": dict(budget=3000.0, cell_limit=900.0, dtype="float32", lora_rank=32,
                          compile_backend="inductor")}
NUM_STEPS, STEP_FRACTION = 8, 0.5  # T = 8 sampling steps, the first half (4 steps) trained: one JAGG window of 4


class CellTimeout(BaseException):
    """A cell ran past its limit (a BaseException: bench_engines' keep_going does not swallow it)."""


def hardware_line(device: torch.device) -> str:
    import diffusers

    soft = f"torch {torch.__version__}, diffusers {diffusers.__version__}"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (f"{p.name} ({p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}, {soft}, "
                f"{os.cpu_count()} CPU cores")
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU only: {cpu}, {os.cpu_count()} cores visible, {torch.get_num_threads()} torch threads, {soft}"


def cell_spec(cell: str) -> tuple[bool, bool, int, bool]:
    """(LoRA, checkpointing, micro-batch size, compiled) of a cell name."""
    base = cell.removesuffix("+compile")
    return (*CELLS[base], base != cell)


def cell_config(cell: str, prompts: int, group: int, device: str, lora_rank: int,
                compile_backend: str = "inductor") -> RunConfig:
    lora, ckpt, micro, compiled = cell_spec(cell)
    lora = lora_rank if lora else 0
    return RunConfig.from_overrides([
        *(["model.compile=true", f"model.compile_backend={compile_backend}"] if compiled else []),
        "log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
        f"sampler.num_steps={NUM_STEPS}", "steps.mode=first_fraction", f"steps.fraction={STEP_FRACTION}",
        f"train.prompts_per_batch={prompts}", f"train.group_size={group}", "loss.beta=0", f"model.device={device}",
        f"model.lora_rank={lora}", f"model.gradient_checkpointing={str(ckpt).lower()}",
        f"engine.micro_batch_size={micro}", "seed=0"])


def _alarm(seconds: float):
    def handler(signum, frame):
        raise CellTimeout(f"cell ran past its limit of {seconds:.0f} s")
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))


def run_suite(size: str, out: Path, *, device: str = "auto", models: list[str] | None = None,
              cells: list[str] | None = None, variants: list[str] | None = None, repeats: int = 1,
              budget: float | None = None, cell_limit: float | None = None, dtype: str | None = None,
              peak_tflops: float = 0.0, command: str = "", log=print) -> dict:
    start = time.monotonic()
    d = DEFAULTS[size]
    budget = d["budget"] if budget is None else budget
    cell_limit = d["cell_limit"] if cell_limit is None else cell_limit
    wdtype = getattr(torch, dtype or d["dtype"])
    dev = torch.device(resolve_device(device))
    peak = peak_bf16(dev, peak_tflops)
    # the likelihood engines by default (the suite's cells set steps.*; nft / awm train units of their own)
    variants = variants or [e for e in ENGINES if e not in FORWARD_ENGINES]
    if "recompute" not in variants:
        variants = ["recompute"] + variants
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "hardware": hardware_line(dev), "size": size, "device": str(dev),
              "dtype": str(wdtype).replace("torch.", ""), "num_steps": NUM_STEPS,
              "trained_steps": int(round(STEP_FRACTION * (NUM_STEPS - 1))), "repeats": repeats, "budget_s": budget,
              "cell_limit_s": cell_limit, "lora_rank": d["lora_rank"], "compile_backend": d["compile_backend"],
              "peak_bf16_flops": peak, "models": {}, "cells": []}

    def save():
        report["elapsed_s"] = time.monotonic() - start
        (out / "suite.json").write_text(json.dumps(report, indent=2))
        (out / "suite.md").write_text(to_markdown(report))

    for family, plan_cells, prompts, group in PLANS[size]:
        if models and family not in models:
            continue
        todo = [c for c in plan_cells if c in cells] if cells else [
            c for c in plan_cells if c not in ON_REQUEST.get(size, ())]
        if not todo:
            continue
        if time.monotonic() - start > budget - 5:
            report["cells"] += [{"model": family, "cell": c, "status": "skipped (suite budget spent)"} for c in todo]
            save()
            continue
        if family == "mlm":
            report["cells"].append(masked_lm_cell(size, dev, wdtype, peak, min(cell_limit * 2, budget - (
                time.monotonic() - start)), log))
            save()
            continue
        t0 = time.monotonic()
        try:
            tr = build_transformer(family, size, str(dev), wdtype)
        except torch.cuda.OutOfMemoryError as e:
            report["cells"] += [{"model": family, "cell": c, "status": f"model does not fit: {e}".splitlines()[0]}
                                for c in todo]
            save()
            continue
        spec = MODELS[family]
        report["models"][family] = {"class": spec["class"], "parameters": parameter_count(tr),
                                    "latents": list(spec["latents"][size]), "pixels": spec["pixels"][size],
                                    "text_tokens": spec["text"][size][0], "build_s": time.monotonic() - t0,
                                    "batch": prompts * group}
        log(f"[{family}] {spec['class']} at size {size}: {parameter_count(tr) / 1e9:.3f}B parameters, built in "
            f"{time.monotonic() - t0:.1f} s")
        took = []
        for cell in todo:
            left = budget - (time.monotonic() - start)
            need = max(took) * 1.1 if took else cell_limit / 2  # a model's first cell: half the cell limit
            if left < need:
                report["cells"].append({"model": family, "cell": cell,
                                        "status": f"skipped ({left:.0f} s of the budget left, needs ~{need:.0f} s)"})
                save()
                continue
            entry = {"model": family, "cell": cell, "batch": prompts * group}
            t1 = time.monotonic()
            try:
                lora, ckpt, _, compiled = cell_spec(cell)
                _alarm(min(cell_limit, left))
                policy = build_policy(tr, family, size, str(dev), lora_rank=d["lora_rank"] if lora else 0,
                                      gradient_checkpointing=ckpt)
                entry["trainable_parameters"] = sum(p.numel() for p in policy.trainable_parameters())
                entry["flops_per_forward"] = flow_forward_flops(policy)  # eager, before any compilation
                rep = bench_engines(cell_config(cell, prompts, group, str(dev), d["lora_rank"], d["compile_backend"]),
                                    COMPILE_VARIANTS if compiled else variants, repeats=repeats,
                                    out_dir=out / family / cell, log=lambda *a: None, policy=policy,
                                    command=command, keep_going=True)
                annotate(rep["rows"], entry["flops_per_forward"], peak)
                entry.update(status="ok", rows=rep["rows"], errors=rep["errors"], compiled=compiled)
            except (Exception, CellTimeout) as e:  # out of memory, the cell's time limit, anything: record, go on
                entry["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                for block in repeated_blocks(tr):  # a compiled cell's blocks back to eager for the next cell
                    block._compiled_call_impl = None
                policy = None
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            entry["seconds"] = time.monotonic() - t1
            took.append(entry["seconds"])
            report["cells"].append(entry)
            log(f"[{family}] {cell}: {entry['status']} in {entry['seconds']:.1f} s")
            save()
        del tr
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save()
    return report


def masked_lm_cell(size: str, dev: torch.device, wdtype: torch.dtype, peak: float | None, limit: float, log) -> dict:
    """The masked-LM cell (benchmarks/gpu/mlm.py) under its own time limit; recorded like a flow cell."""
    entry, t0 = {"model": "mlm", "cell": "lora"}, time.monotonic()
    if limit < 5:
        return {**entry, "status": f"skipped ({limit:.0f} s of the budget left)"}
    try:
        _alarm(limit)
        res = mlm.run_mlm_cell(size, str(dev), dtype=str(wdtype).replace("torch.", ""), peak=peak, log=log)
        entry.update(status="ok", mlm=res, trainable_parameters=res["trainable_parameters"])
    except (Exception, CellTimeout) as e:
        entry["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    entry["seconds"] = time.monotonic() - t0
    log(f"[mlm] {entry['status']} in {entry['seconds']:.1f} s")
    return entry


def to_markdown(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "", f"Hardware: {report['hardware']}", "",
             f"Size `{report['size']}`, weights {report['dtype']}, random initialisation from the published config "
             f"numbers (no download). T = {report['num_steps']} sampling steps, the first {report['trained_steps']} "
             f"trained (one JAGG window of 4), LoRA rank {report['lora_rank']}, KL off (loss.beta=0), median of "
             f"{report['repeats']} timed run(s) after a warm-up. Text encoders and VAE are stubs (seeded random "
             "prompt embeddings of the pipelines' shapes; decoder = first three latent channels, upsampled to ≥ 64 "
             "px); reward: JPEG size. Ratios are against `recompute` on the same rollout; ideal = the cost model (forwards + 2 × sample-backwards from the counters); eff = measured / "
             "ideal. Peak memory: `torch.cuda.max_memory_allocated` over the iteration (weights included) on CUDA; on "
             "the CPU the peak bytes of tensors saved for backward (activations only).", ""]
    if report["models"]:
        lines += ["| model | class | parameters | latents | pixels | text tokens | batch |",
                  "|---|---|---|---|---|---|---|"]
        for name, m in report["models"].items():
            lines.append(f"| {name} | {m['class']} | {m['parameters'] / 1e9:.3f}B | {tuple(m['latents'])} | "
                         f"{m['pixels']} | {m['text_tokens']} | {m['batch']} |")
        lines.append("")
    hdr = ("| model | cell | engine | train × | ideal | eff | iter × | ideal | eff | peak mem | mem / recompute | "
           "grad cos | rel err | train s | iter s |")
    lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for c in report["cells"]:
        if c.get("status") != "ok":
            lines.append(f"| {c['model']} | {c['cell']} | {c['status']} |" + " |" * 12)
            continue
        for r in c.get("rows", []):
            mem = r["peak_memory_bytes"]
            mem_s = f"{mem / 2**30:.2f} GiB" if mem >= 2**30 else f"{mem / 2**20:.2f} MiB"
            lines.append(
                f"| {c['model']} | {c['cell']} | {r['variant']} | {r.get('train_speedup', 1):.2f} | "
                f"{r.get('ideal_train_speedup', 1):.2f} | {r.get('train_efficiency', 1):.2f} | "
                f"{r.get('iteration_speedup', 1):.2f} | {r.get('ideal_iteration_speedup', 1):.2f} | "
                f"{r.get('iteration_efficiency', 1):.2f} | {mem_s} | {r.get('memory_vs_recompute', 1):.2f} | "
                f"{r['grad_cos_vs_recompute']:.5f} | {r['grad_relerr_vs_recompute']:.1e} | {r['train_s']:.3f} | "
                f"{r['iteration_s']:.3f} |")
        for name, err in c.get("errors", {}).items():
            lines.append(f"| {c['model']} | {c['cell']} | {name} | failed: {err} |" + " |" * 11)
    lines += seconds_table(report)
    for c in report["cells"]:
        if c.get("status") == "ok" and "mlm" in c:
            lines += mlm.to_markdown(c["mlm"])
    lines += memory_table(report)
    lines.append(f"\nSuite time {report.get('elapsed_s', 0):.0f} s (budget {report['budget_s']:.0f} s).")
    return "\n".join(lines) + "\n"


def seconds_table(report: dict) -> list[str]:
    """Per flow cell and engine: the iteration's time shares, the forwards' TFLOP/s and fraction of the bf16 peak,
    the warm-up iteration, and for a compiled cell the eager cell's iteration time over this one."""
    peak = report.get("peak_bf16_flops")
    lines = ["", "Where each second goes (shares of the iteration; TFLOP/s from the counted forwards × the FLOPs of "
                 "one forward, FlopCounterMode; peak: dense bf16 "
                 f"{'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}; first s = the warm-up iteration, "
                 "compilation included; × eager = the same engine's iteration in the cell without +compile over "
                 "this one):", "",
             "| model | cell | engine | sample % | reward % | train % | other % | sample TFLOP/s | of peak | "
             "model TFLOP/s | of peak | first s | iter s | × eager |", "|" + "---|" * 14]
    ok = {(c["model"], c["cell"]): c for c in report["cells"] if c.get("status") == "ok" and "rows" in c}
    for (model, cell), c in ok.items():
        eager = ok.get((model, cell.removesuffix("+compile"))) if cell.endswith("+compile") else None
        for r in c["rows"]:
            sh, tp = r["shares"], r["throughput"]
            e = next((x for x in eager["rows"] if x["variant"] == r["variant"]), None) if eager else None
            ratio = f"{e['iteration_s'] / max(r['iteration_s'], 1e-12):.2f}" if e else ""
            lines.append(f"| {model} | {cell} | {r['variant']} | {100 * sh['sample']:.0f} | {100 * sh['reward']:.0f} | "
                         f"{100 * sh['train']:.0f} | {100 * sh['other']:.0f} | {tp['sample_tflops']:.3g} | "
                         f"{fraction(tp['sample_peak_fraction'])} | {tp['model_tflops']:.3g} | "
                         f"{fraction(tp['model_peak_fraction'])} | {r['first_iteration_s']:.2f} | "
                         f"{r['iteration_s']:.3f} | {ratio} |")
    return lines


def _mem(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"


def memory_table(report: dict) -> list[str]:
    """Peak memory per engine (rows) and cell (columns), one table per model, with the trainable parameters of each
    cell (their gradients and AdamW's two moments add 3 × 4 bytes each in float32, not part of the measured peak
    here: the bench takes no optimizer step)."""
    lines = []
    for model in report["models"]:
        done = [c for c in report["cells"] if c["model"] == model and c.get("status") == "ok"]
        if not done:
            continue
        lines += ["", f"Peak memory, {model} ({report['models'][model]['parameters'] / 1e6:.1f}M parameters, batch "
                      f"{report['models'][model]['batch']}):", "",
                  "| engine | " + " | ".join(c["cell"] for c in done) + " |", "|---|" + "---|" * len(done)]
        for name in [r["variant"] for r in done[0]["rows"]]:
            cols = [next((_mem(r["peak_memory_bytes"]) for r in c["rows"] if r["variant"] == name), "") for c in done]
            lines.append(f"| {name} | " + " | ".join(cols) + " |")
        lines.append("| trainable parameters | " + " | ".join(f"{c['trainable_parameters'] / 1e6:.2f}M"
                                                              for c in done) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(PLANS), default="real")
    ap.add_argument("--device", default="auto", help="auto (the accelerator when there is one), cpu, cuda, ...")
    ap.add_argument("--out", default=None, help="default benchmarks/results/gpu (real), runs/gpu-suite-<size> else")
    ap.add_argument("--models", default="", help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--cells", default="", help="comma-separated subset of " + ",".join(CELLS))
    ap.add_argument("--variants", default="", help="';'-separated engine variants (default: every engine)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole suite")
    ap.add_argument("--cell-limit", type=float, default=None, help="seconds per cell")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="dense bf16 peak of the device in TFLOP/s (0: throughput.PEAK_BF16 by device name)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out or ("benchmarks/results/gpu" if a.size == "real" else f"runs/gpu-suite-{a.size}"))
    command = "bash benchmarks/gpu/suite.sh " + " ".join(shlex.quote(x) for x in (argv if argv is not None
                                                                                   else sys.argv[1:]))
    rep = run_suite(a.size, out, device=a.device, models=[m for m in a.models.split(",") if m] or None,
                    cells=[c for c in a.cells.split(",") if c] or None,
                    variants=[v for v in a.variants.split(";") if v] or None, repeats=a.repeats, budget=a.budget,
                    cell_limit=a.cell_limit, dtype=a.dtype, peak_tflops=a.peak_tflops,
                    command=command.strip())
    print(f"tables in {out}/suite.md and {out}/suite.json")
    return 0 if any(c.get("status") == "ok" for c in rep["cells"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
