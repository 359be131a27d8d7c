"""GARDO's adaptive reference (He et al., arXiv 2512.24138; its abstract): the KL term's reference policy reset to
the online policy every N iterations (``diversity.gardo_ref_every``), so the regulariser keeps the policy near a
recent, competent version of itself instead of the initial model.

After iteration i (1-based, all of its updates done) with i a multiple of N, every trainable weight of the policy
is copied into the reference's copy of it (the full fine-tune's frozen copy, ``policy._ref``, the one
``models.reference.frozen_reference`` runs); iteration i+1 measures its KL against the policy as it stood then.
Its state — the reference's trainable weights and the iteration of the last refresh — travels in every checkpoint
(``reference.safetensors``), so a resumed run regularises against the same reference bit for bit.

Cost: one copy of the trainable weights per refresh (device to device), no forward; no extra memory beyond the
frozen copy a full fine-tune with ``loss.beta > 0`` already keeps. Exact: the copy is bitwise.

Where it differs from the released code (tinnerhrhe/GARDO@1cc77fb3 ``scripts/train_sd3_grpo_gardo.py:main``; the
paper's section and equations could not be read from this machine):

* Trigger: the release resets the reference when a logged step's KL (mean over processes) exceeded a task-set
  threshold (``kl_thres``, e.g. 3e-4) during the previous iteration, or when more than ``reset_freq`` (15) iterations
  have passed since the last reset; here only the fixed period N.
* When: the release copies after the next iteration's rollout, before its update, which is the same point in the
  loop as after iteration i here (the rollout does not use the reference).
* LoRA: the release keeps the reference as a second LoRA adapter and copies the trained adapter into it; here a
  LoRA run's reference is the base model with the adapter disabled, which has no weights to reset, so the knob is
  refused for it (and under FSDP2, whose sharded weights the copy does not address).
"""
from __future__ import annotations

import torch

from .gardo import refresh_due


def reference_weights(policy) -> dict[str, torch.Tensor]:
    """The reference's copies of the policy's trainable weights, under the trainable weights' names."""
    ref = getattr(policy, "_ref", None)
    if ref is None:
        raise RuntimeError("the adaptive reference needs the policy's frozen reference copy (a full fine-tune with "
                           "loss.beta > 0)")
    mine = dict(ref.named_parameters())
    names = list(policy.named_trainable_parameters())
    missing = [n for n in names if n not in mine]
    if missing:
        raise RuntimeError(f"the reference copy lacks trainable weights {missing[:3]}")
    return {n: mine[n] for n in names}


@torch.no_grad()
def refresh(policy) -> None:
    """Copy every trainable weight of the policy into its reference copy (bitwise)."""
    online = policy.named_trainable_parameters()
    for name, dst in reference_weights(policy).items():
        dst.copy_(online[name].detach())


class AdaptiveReference:
    """The refresh clock and its checkpointed state: ``last`` (iteration of the last refresh, 0 = never) and
    ``refreshes`` (how many so far)."""

    def __init__(self, every: int):
        self.every, self.last, self.refreshes = int(every), 0, 0

    def after_iteration(self, policy, iteration: int) -> dict[str, float]:
        """Refresh when due after ``iteration``; → the ``diversity/ref_*`` metrics."""
        if refresh_due(iteration, self.every):
            refresh(policy)
            self.last, self.refreshes = iteration, self.refreshes + 1
        return {"diversity/ref_refreshes": float(self.refreshes), "diversity/ref_age": float(iteration - self.last)}

    def state(self, policy) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """(the reference's trainable weights, detached, {"last", "refreshes"}) for a checkpoint."""
        return ({n: p.detach() for n, p in reference_weights(policy).items()},
                {"last": self.last, "refreshes": self.refreshes})

    @torch.no_grad()
    def load(self, policy, weights: dict[str, torch.Tensor], counters: dict) -> None:
        """Restore :meth:`state`'s output into the policy's reference copy and the clock."""
        dst = reference_weights(policy)
        if set(dst) != set(weights):
            raise RuntimeError("the checkpoint's reference weights do not match this run's trainable weights")
        for name, p in dst.items():
            p.copy_(weights[name].to(p))
        self.last, self.refreshes = int(counters.get("last", 0)), int(counters.get("refreshes", 0))


__all__ = ["AdaptiveReference", "reference_weights", "refresh"]
