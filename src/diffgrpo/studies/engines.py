"""Side-by-side engine benchmark: every variant on the same batch plan of the same model, in one process.

For each variant the batch is re-planned from the same seed (same prompts, initial noise, step noise), so all
engines see identical trajectories; the rollout runs with the variant's own hooks (recompute-free engines
work during sampling). Measured per variant (median over ``repeats``): rollout, train-phase and iteration
seconds, peak memory over the iteration, the counters, and the gradient's cosine / relative error against
``recompute`` on that same rollout.

Cost model (sample-forward units, backward ≈ 2 forwards): cost = F_nograd + F_grad + 2·B_samples, from the
counters of the timed runs (after the warm-up, whose work may differ: nft's θ_old equals θ on its first rollout).
The ideal speedup of a variant is cost(recompute) / cost(variant); efficiency = measured / ideal.
This reproduces the design's ideals: JAGG K/(#sample-backwards), Retain/Reweight (T+3K)/(T+2K),
Flash (T+3K)/(T+3).
"""
from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from ..config import MODEL_FAMILIES, RunConfig
from ..configvalues import split_overrides
from ..engines.recompute import RecomputeEngine
from ..errors import ConfigError
from ..fileio import atomic_write
from ..metering import MemoryMeter
from ..models.reference import needs_reference
from ..trainer import Trainer


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``name[:key=value,...]`` → (label, overrides); bare keys mean ``engine.<key>``; a list value in brackets
    keeps its commas."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    overrides = [f"engine.name={name}"]
    for kv in split_overrides(rest):
        key, _, val = kv.partition("=")
        overrides.append(f"{key if '.' in key else 'engine.' + key}={val}")
    return spec, overrides


ZERO_GRADIENT = ("Note: the exact gradient is zero (every group's rewards tie), so the grad cos and rel err columns "
                 "compare nothing; bench a pretrained model or a reward that varies within a group.")


def _grads(params) -> list[torch.Tensor | None]:
    """A copy of every parameter's gradient in its own dtype (None where there is none): one extra gradient's
    memory, not a float64 vector of every parameter (which at 12B parameters would not fit)."""
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def _compare(a: list, b: list) -> tuple[float, float]:
    """Cosine and relative error ‖a − b‖/‖b‖ of two gradients given as per-parameter lists, accumulated in float64
    parameter by parameter."""
    dot = na = nb = nd = torch.zeros((), dtype=torch.float64)
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        x = torch.zeros_like(y) if x is None else x
        y = torch.zeros_like(x) if y is None else y
        xd, yd = x.double(), y.double()
        dot, na, nb = dot + (xd * yd).sum().cpu(), na + (xd * xd).sum().cpu(), nb + (yd * yd).sum().cpu()
        nd = nd + ((xd - yd) ** 2).sum().cpu()
    cos = float(dot / (na.sqrt() * nb.sqrt()).clamp(min=1e-300))
    return cos, float(nd.sqrt() / nb.sqrt().clamp(min=1e-30))


def _cost(c: dict) -> float:
    return c["forwards_nograd"] + c["forwards_grad"] + 2 * c["sample_backwards"]


def _run_variant(trainer: Trainer, base_state: dict, rng_state: dict) -> dict:
    """One iteration (the family's collect + first-update backward) of ``trainer`` from fixed sampling streams."""
    trainer.policy.load_state_dict(base_state)
    trainer.family.set_rng_state(rng_state)
    c0 = dict(trainer.policy.counters)
    trainer.optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with MemoryMeter(trainer.device) as mem:
        ro, first = trainer.family.collect()
        c_roll = {k: trainer.policy.counters[k] - c0[k] for k in c0}
        stats = first if first is not None else trainer.family.backward(ro, 0)
    t_iter = time.perf_counter() - t0
    grad = _grads(trainer.params)
    counters = {"forwards_nograd": stats.forwards_nograd + c_roll["forwards_nograd"],
                "forwards_grad": stats.forwards_grad + c_roll["forwards_grad"],
                "sample_backwards": stats.sample_backwards,
                "train_forwards_grad": stats.forwards_grad, "train_forwards_nograd": stats.forwards_nograd,
                "backward_calls": stats.backward_calls, "retained_graphs": stats.retained_graphs,
                "grad_buffers": stats.grad_buffers, "allreduce_calls": stats.allreduce_calls}
    rollout_extra = stats.seconds.get("rollout_extra", 0.0)
    return {"ro": ro, "grad": grad, "t_iter": t_iter, "t_rollout": ro.timings["rollout"],
            "t_sample": ro.timings.get("sample", 0.0) - rollout_extra, "t_reward": ro.timings.get("reward", 0.0),
            "t_train": stats.seconds.get("train", 0.0) + rollout_extra, "peak": max(mem.peak, stats.peak_memory_bytes),
            "counters": counters, "metrics": stats.metrics}


def bench_engines(cfg: RunConfig, variants: list[str], *, repeats: int = 3, out_dir: str | Path | None = None,
                  log=print, policy=None, command: str | None = None, keep_going: bool = False) -> dict:
    """Run every variant side by side; write ``engines.json`` and ``engines.md`` (headed by the command line that
    produced them) to ``out_dir``. ``policy``: a policy built by the caller (e.g. a transformer at a real size with
    random weights, benchmarks/gpu/) instead of the one ``cfg.model`` names; ``command``: the command line to
    record (default: this process's); ``keep_going``: a variant other than ``recompute`` that raises (out of memory)
    is left out of the rows and listed in ``report["errors"]`` instead of ending the benchmark."""
    if MODEL_FAMILIES[cfg.model.name] != "flow":
        raise ConfigError(f"bench engines: gradient engines are the flow family's; model.name={cfg.model.name} is a "
                          "masked diffusion LM (compare its methods with benchmarks/dllm_train.py)")
    cfg = RunConfig.from_overrides(["log.progress=false"], base=cfg)
    base = Trainer(RunConfig.from_overrides(["engine.name=recompute"], base=cfg), policy=policy, log=log)
    base_state = {k: v.clone() for k, v in base.policy.state_dict().items()}
    rng_state = base.family.rng_state()  # every variant replays the same prompts, noise and steps
    trainers = _variant_trainers(cfg, variants, base, log)
    results = {label: [] for label in trainers}
    errors: dict[str, str] = {}  # keep_going: variants that raised, with the first line of their error
    for r in range(repeats + 1):  # first round is warm-up
        order = list(trainers) if r % 2 == 0 else list(reversed(trainers))
        for label in order:
            if label in errors:
                continue
            try:
                res = _measure(trainers[label], base, base_state, rng_state, reference=r == 0)
            except Exception as e:  # e.g. out of memory at a real size: drop this variant, keep the others
                if not keep_going or label == "recompute":
                    raise
                errors[label] = _drop(label, e, (trainers[label], base), log)
                continue
            results[label].append(res)
            res.pop("ro", None)
            res.pop("grad", None)
    base.policy.load_state_dict(base_state)
    rows = [_row(label, results[label]) for label in trainers if label not in errors]
    b = next((row for row in rows if row["variant"] == "recompute"), None)
    if b is not None:
        for row in rows:
            row.update(_versus_recompute(row, b))
    report = {
        "config": cfg.to_dict(), "repeats": repeats, "device": str(base.device),
        "torch_threads": torch.get_num_threads(), "batch": cfg.train.prompts_per_batch * cfg.train.group_size,
        "command": command or "diffgrpo " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "num_steps": cfg.sampler.num_steps, "rows": rows, "errors": errors,
    }
    if any(run.get("ref_zero") for run in results.get("recompute", [])[:1]):  # the warm-up compares gradients
        report["note"] = ZERO_GRADIENT
    md = to_markdown(report)
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "engines.json", json.dumps(report, indent=2))
        atomic_write(out / "engines.md", md)
    log(md)
    return report


def _variant_trainers(cfg: RunConfig, variants: list[str], base: Trainer, log) -> dict[str, Trainer]:
    """label → a trainer of that variant sharing ``base``'s policy (its reference made when the variant needs it)."""
    trainers = {}
    for spec in variants:
        label, ov = parse_variant(spec)
        vcfg = RunConfig.from_overrides(ov, base=cfg)
        if needs_reference(vcfg):  # e.g. dgpo: the reference is part of its loss
            base.policy.ensure_reference()
        trainers[label] = Trainer(vcfg, policy=base.policy, log=log)
    return trainers


def _measure(trainer: Trainer, base: Trainer, base_state: dict, rng_state: dict, *, reference: bool) -> dict:
    """One measured iteration of ``trainer``; with ``reference`` also its gradient's cosine and relative error
    against the exact one: recompute on this variant's own rollout (same selected steps), in ``base``."""
    res = _run_variant(trainer, base_state, rng_state)
    if reference:
        ro = res["ro"]
        base.optimizer.zero_grad(set_to_none=True)
        RecomputeEngine().backward(trainer.family.ctx, ro, 0)
        res["ref_cos"], res["ref_relerr"] = _compare(res["grad"], [p.grad for p in base.params])
        res["ref_zero"] = all(p.grad is None or not bool(p.grad.any()) for p in base.params)
        base.optimizer.zero_grad(set_to_none=True)
    return res


def _drop(label: str, e: Exception, trainers: tuple[Trainer, ...], log) -> str:
    """A variant that raised leaves the benchmark: its gradients and the cached device memory are freed, the
    others go on. → the first line of its error."""
    error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    for t in trainers:
        t.optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"bench engines: {label} failed ({error}); the other variants go on")
    return error


def _row(label: str, runs: list[dict]) -> dict:
    """A variant's row: medians over the timed runs (the warm-up when it is the only one), the warm-up's
    gradient comparison and metrics."""
    timed = runs[1:] if len(runs) > 1 else runs
    return {
        "variant": label,
        "rollout_s": statistics.median(x["t_rollout"] for x in timed),
        "train_s": statistics.median(x["t_train"] for x in timed),
        "iteration_s": statistics.median(x["t_iter"] for x in timed),
        # sampling (without an engine's rollout-time backwards, which count as train), reward, and the warm-up
        # iteration (compilation, first-call allocations)
        "sample_s": statistics.median(x["t_sample"] for x in timed),
        "reward_s": statistics.median(x["t_reward"] for x in timed),
        "first_iteration_s": runs[0]["t_iter"],
        "peak_memory_bytes": max(x["peak"] for x in timed),
        # the timed runs' counters (an engine's work may differ on the warm-up: nft's θ_old equals θ bit for
        # bit on its first rollout and needs no θ_old forwards then); the warm-up's are kept if they differ
        "counters": timed[-1]["counters"],
        **({"counters_first": runs[0]["counters"]} if runs[0]["counters"] != timed[-1]["counters"] else {}),
        "grad_cos_vs_recompute": runs[0]["ref_cos"],
        "grad_relerr_vs_recompute": runs[0]["ref_relerr"],
        "metrics": runs[0]["metrics"],
    }


def _versus_recompute(row: dict, b: dict) -> dict:
    """A row's measured and ideal speed-ups (counted cost), efficiencies and memory against recompute's row ``b``."""
    out = {"train_speedup": b["train_s"] / max(row["train_s"], 1e-12),
           "iteration_speedup": b["iteration_s"] / max(row["iteration_s"], 1e-12)}
    bc, rc = b["counters"], row["counters"]
    tb = bc["train_forwards_grad"] + bc["train_forwards_nograd"] + 2 * bc["sample_backwards"]
    tr = rc["train_forwards_grad"] + rc["train_forwards_nograd"] + 2 * rc["sample_backwards"]
    out["ideal_train_speedup"] = tb / max(tr, 1e-12)
    out["ideal_iteration_speedup"] = _cost(bc) / max(_cost(rc), 1e-12)
    out["train_efficiency"] = out["train_speedup"] / out["ideal_train_speedup"]
    out["iteration_efficiency"] = out["iteration_speedup"] / out["ideal_iteration_speedup"]
    out["memory_vs_recompute"] = row["peak_memory_bytes"] / max(b["peak_memory_bytes"], 1)
    return out


def to_markdown(report: dict) -> str:
    hdr = ("| variant | train s | iter s | train × | ideal × | eff | iter × | ideal × | grad cos | rel err | "
           "peak mem | F grad | F nograd | sample bwd |")
    lines = ([f"Command: `{report['command']}`", ""] if report.get("command") else []) + [f"Engines on {report['device']} ({report['torch_threads']} threads), batch {report['batch']}, "
             f"T = {report['num_steps']}, median of {report['repeats']} runs.", "", hdr,
             "|" + "---|" * (hdr.count("|") - 1)]
    for r in report["rows"]:
        c = r["counters"]
        lines.append(
            f"| {r['variant']} | {r['train_s']:.3f} | {r['iteration_s']:.3f} | {r.get('train_speedup', 1):.2f} | "
            f"{r.get('ideal_train_speedup', 1):.2f} | {r.get('train_efficiency', 1):.2f} | "
            f"{r.get('iteration_speedup', 1):.2f} | {r.get('ideal_iteration_speedup', 1):.2f} | "
            f"{r['grad_cos_vs_recompute']:.5f} | {r['grad_relerr_vs_recompute']:.1e} | "
            f"{r['peak_memory_bytes'] / 2**20:.1f} MiB | {c['forwards_grad']} | {c['forwards_nograd']} | "
            f"{c['sample_backwards']} |")
    return "\n".join(lines + (["", report["note"]] if report.get("note") else [])) + "\n"
