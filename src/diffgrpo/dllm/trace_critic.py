"""TraceRL's value network (``dllm.trace_value=on``): per-token values of the sampler's states, their regression
onto the decoding-step returns, and its checkpoint state.

The network is, as in the released code (``train/init_sdar_value_model.py``), a copy of the policy's trunk at the
start of training with a scalar head (hidden → 1, no bias, zero at start: every value 0, so the first update's
advantage is the reward) on the trunk's final hidden state, trained by its own AdamW (betas 0.9 / 0.999, no weight
decay, constant lr ``dllm.trace_value_lr``, gradient norm clipped at ``train.max_grad_norm``). It is built for the
built-in block model (``model.name=tiny_block``): its trunk is small enough to copy in float32. Token j's value
V_j is read in the state its decoding step saw (the trace masks of :mod:`.trace_rl`: the prompt, earlier blocks
clean, the block's tokens of steps >= step(j) masked), one block-causal forward per block as the policy's scores
(:mod:`.block_likelihood`). The math is :mod:`.trace_value`.

Per rollout: V_old under the trace masks (no grad), then returns R and advantages A
(:func:`~.trace_value.returns_and_advantages` with the group-normalised reward), stored in the trajectory's
records (``value_old``, ``value_return``, ``value_advantage``) for the policy's surrogate. Per policy update: one
value step on the clipped value loss (token mean over the trained tokens). Cost per rollout: as many value-network
row-forwards without grad as ℓ_old takes (the trace rows), and per update as many with grad and backwards; all
are counted in the policy's forward counters.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..metering import chunks, record_backward
from ..models.tiny_block import BlockBase, block_keep, block_lm_forward
from ..types import EngineStats, Rollout
from .block_likelihood import map_blocks
from .trace_value import clipped_value_loss, returns_and_advantages

RECORDS = ("value_old", "value_return", "value_advantage")


def block_values(value_fn, ids: torch.Tensor, masks: torch.Tensor, weights: torch.Tensor, mask_id: int,
                 block_length: int) -> torch.Tensor:
    """Σ_m w_mj · v(x^(m, k(j)))_j: ids (B, N), masks (B, M, N), weights (B, M, L) → (B, L), with x^(m, k) the
    prompt, the clean blocks before k and block k under mask m (:mod:`.block_likelihood`'s context). ``value_fn``:
    ids (r, n) → values (r, n). Differentiable through it."""
    P = ids.shape[1] - weights.shape[-1]
    v = map_blocks(lambda need, x, s, e: value_fn(x)[:, P + s:].float(), ids, masks, weights, mask_id, block_length)
    return (v * weights).sum(1)  # (B, L)


class TraceCritic:
    """The value network with its optimizer. ``policy``: the block-causal policy (counters, device, block_size,
    pad id); ``d``: the dllm section; ``lr``, ``max_grad_norm``, ``micro_batch_size``: its update's settings."""

    def __init__(self, policy, d, *, lr: float, max_grad_norm: float, micro_batch_size: int = 0):
        base = next(m for m in policy.model.modules() if isinstance(m, BlockBase))
        trunk = copy.deepcopy(base).float()
        head = nn.Linear(trunk.norm.normalized_shape[0], 1, bias=False)
        nn.init.zeros_(head.weight)  # V = 0 at start, as the released initialisation
        self.net = nn.ModuleDict({"trunk": trunk, "head": head}).to(policy.device).train(False)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        self.policy, self.d = policy, d
        self.max_grad_norm, self.micro_batch_size = max_grad_norm, micro_batch_size

    def value_fn(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (r, n) long → values (r, n) float32 (block-causal; pad keys hidden as the policy's forward)."""
        pol = self.policy
        pol.counters["forwards_grad" if torch.is_grad_enabled() else "forwards_nograd"] += ids.shape[0]
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)  # (1, n)
        keep = block_keep(pos, pos, pol.block_size, ids != pol.pad_id if pol.use_attention_mask else None)
        return block_lm_forward(self.net["trunk"], self.net["head"], pol.block_size, ids, attention_mask=keep,
                                position_ids=pos).squeeze(-1)

    def values(self, ids, masks, weights) -> torch.Tensor:
        """Per-token values (n, L) of rows under their trace masks (grad follows the caller's mode)."""
        return block_values(self.value_fn, ids, masks, weights, self.policy.vocab.mask_id, self.policy.block_size)

    @torch.no_grad()
    def attach(self, ro: Rollout) -> None:
        """V_old, returns and advantages of a fresh rollout into ``ro.traj.records`` (see :data:`RECORDS`)."""
        tj, d = ro.traj, self.d
        rows = chunks(torch.arange(tj.sequences.shape[0], device=tj.sequences.device), self.micro_batch_size)
        old = torch.cat([self.values(tj.sequences[i], tj.masks[i], tj.mask_weights[i]) for i in rows])  # (B, L)
        reward = torch.nan_to_num(ro.advantages.float(), nan=0.0)  # (B,) the group-normalised reward
        ret, adv = returns_and_advantages(tj.records["commit_step"], ro.selected, old, reward, d.trace_gamma,
                                          d.trace_lambda)
        tj.records.update(value_old=old, value_return=ret, value_advantage=adv)

    def update(self, ro: Rollout, stats: EngineStats) -> dict[str, float]:
        """One AdamW step on the clipped value loss of the rollout's trained tokens → its metrics."""
        tj = ro.traj
        rec = tj.records
        sel = ro.trained & (rec["commit_step"] >= 0)  # (B, L)
        n = max(float(sel.sum()), 1.0)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for idx in chunks(torch.nonzero(sel.any(1)).flatten(), self.micro_batch_size):
            v = self.values(tj.sequences[idx], tj.masks[idx], tj.mask_weights[idx])  # (n, L) with grad
            tok = clipped_value_loss(v, rec["value_old"][idx], rec["value_return"][idx], self.d.clip_range)
            loss = (tok * sel[idx]).sum() / n
            loss.backward()
            record_backward(stats, len(idx) * tj.masks.shape[1])
            total += float(loss.detach())
        if self.max_grad_norm > 0:
            nn.utils.clip_grad_norm_(self.net.parameters(), self.max_grad_norm)
        self.opt.step()
        adv = rec["value_advantage"][sel]
        return {"value_loss": total, "value_mean": float(rec["value_old"][sel].mean()) if sel.any() else 0.0,
                "value_adv_std": float(adv.std()) if adv.numel() > 1 else 0.0}

    # ------------------------------------------------------------------ checkpoint state (safetensors-ready)
    def state(self) -> dict[str, torch.Tensor]:
        """The network's weights (``net.<name>``) and the optimizer's moments and step (``opt.<i>.<key>``)."""
        out = {f"net.{k}": v.detach().clone() for k, v in self.net.state_dict().items()}
        for i, st in self.opt.state_dict()["state"].items():
            out.update({f"opt.{i}.{k}": torch.as_tensor(v).clone() for k, v in st.items()})
        return out

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state` (bit for bit)."""
        self.net.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("net.")})
        opt: dict[int, dict] = {}
        for k, v in state.items():
            if k.startswith("opt."):
                _, i, key = k.split(".", 2)
                opt.setdefault(int(i), {})[key] = v
        self.opt.load_state_dict({"state": opt, "param_groups": self.opt.state_dict()["param_groups"]})


__all__ = ["RECORDS", "TraceCritic", "block_values"]
