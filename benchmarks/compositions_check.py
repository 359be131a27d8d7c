"""Same-rollout gradient check of the Retain compositions on the pretrained built-in model (T = 10, K = 9).

For each composition: roll out with its hooks, take the first-update gradient, then the gradient of the same
engine with recompute evaluation on that same rollout, and print the relative error (KL off/on, CFG off/on).

    DIFFGRPO_CACHE=/tmp/dgcache OMP_NUM_THREADS=1 python benchmarks/compositions_check.py
"""
import dataclasses

import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.engines import ENGINES


def flat(params):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double() for p in params])


def main():
    torch.set_num_threads(1)
    print("| composition | settings | rel. err vs recompute evaluation | train F grad | sample bwd |")
    print("|---|---|---|---|---|")
    for eng in (["engine.name=jagg", "engine.window=4"], ["engine.name=single_step"]):
        for extra in ([], ["loss.beta=0.04"], ["model.guidance_scale=4.5"]):
            cfg = RunConfig.from_overrides([*eng, "engine.evaluation=retain", "log.progress=false", *extra])
            tr = Trainer(cfg, log=lambda *a: None)
            if extra and extra[0].startswith("loss.beta"):  # move θ off the reference so that KL has a gradient
                g = torch.Generator().manual_seed(0)
                with torch.no_grad():
                    for p in tr.params:
                        p.add_(1e-3 * torch.randn(p.shape, generator=g))
            ro = tr.rollout()
            s = tr.backward(ro, 0)
            g_ret = flat(tr.params)
            tr.optimizer.zero_grad(set_to_none=True)
            ENGINES[cfg.engine.name](dataclasses.replace(cfg.engine, evaluation="recompute")).backward(tr.family.ctx, ro, 0)
            g_rc = flat(tr.params)
            err = float((g_ret - g_rc).norm() / g_rc.norm())
            print(f"| {' '.join(eng)} | {' '.join(extra) or 'default'} | {err:.1e} | {s.forwards_grad} | "
                  f"{s.sample_backwards} |")


if __name__ == "__main__":
    main()
