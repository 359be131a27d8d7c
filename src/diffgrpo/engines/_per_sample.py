"""Per-sample parameter gradients of a batched network output from ONE backward pass.

For a layer y = a·Wᵀ + b applied to a batch, the summed weight gradient is Σ_n Σ_tokens δ_n aᵀ_n; keeping
the sum over tokens but not over samples gives every sample's gradient (the "ghost"/Opacus identity). We
record the inputs a and outputs y of every module that owns trainable parameters during a grad-enabled
forward, ask autograd for δ = ∂(out·g)/∂y w.r.t. those outputs (which skips the summed weight gradients
altogether), and contract per sample. Supported owners: ``nn.Linear`` and ``nn.Conv2d`` (groups = 1, numeric
padding). Anything else makes :meth:`PerSampleGrads.supported` False and callers fall back to one backward
per sample (:func:`per_sample_grads_loop`), which is exact but costs n backwards. peft LoRA adapters are
covered: their ``lora_A`` / ``lora_B`` are ``nn.Linear`` owners, and the frozen base layers own no trainable
parameter, so they are neither hooked nor contracted.

Network batches larger than the sample batch (classifier-free guidance runs [x; x]) map network row j to
sample j mod n.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

# Linear layers: per-sample gradients accumulated into the buffer by one GEMM (False: the einsum, then an add;
# kept for the equality test and benchmarks/engines_floor.py)
_FUSED = True


def _root_modules(policy) -> list[nn.Module]:
    for name in ("transformer", "model", "module"):
        m = getattr(policy, name, None)
        if isinstance(m, nn.Module):
            return [m]
    return []


class PerSampleGrads:
    """Records layer inputs/outputs while active; turns an upstream gradient into (n, P) per-sample grads."""

    def __init__(self, policy, params: list[torch.Tensor]):
        self.params = list(params)
        self.offsets = {}
        off = 0
        for p in self.params:
            self.offsets[id(p)] = (off, p.numel())
            off += p.numel()
        self.numel = off
        self.owners: list[nn.Module] = []
        # owner → (offset, size) of its weight and bias, fixed here: under FSDP2 a module's registered parameters
        # are swapped for unsharded copies during (and, for the root, after) its forward, so they are never
        # looked up again by identity
        self.slots: dict[nn.Module, tuple] = {}
        covered = set()
        for root in _root_modules(policy):
            for m in root.modules():
                own = [p for p in m.parameters(recurse=False) if id(p) in self.offsets]
                if not own:
                    continue
                ok = isinstance(m, nn.Linear) or (isinstance(m, nn.Conv2d) and m.groups == 1
                                                  and not isinstance(m.padding, str) and m.padding_mode == "zeros")
                if ok:
                    self.owners.append(m)
                    self.slots[m] = tuple(self.offsets.get(id(getattr(m, n))) for n in ("weight", "bias"))
                    covered.update(id(p) for p in own)
        self._supported = covered == set(self.offsets)
        self._records: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []
        self._active = False
        self._handles = []

    def supported(self) -> bool:
        return self._supported

    def _hook(self, mod, inp, out):
        if self._active and torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            self._records.append((mod, inp[0].detach(), out))

    @contextlib.contextmanager
    def recording(self):
        """While inside, grad-enabled forwards of the covered layers are recorded (hooks removed on exit)."""
        self._handles = [m.register_forward_hook(self._hook) for m in self.owners]
        self._active = True
        try:
            yield self
        finally:
            self._active = False
            for h in self._handles:
                h.remove()
            self._handles = []
            self._records = []

    def take(self) -> list:
        """The records of the forwards since the last call (hand them to :meth:`grads`)."""
        recs, self._records = self._records, []
        return recs

    def grads(self, records: list, out: torch.Tensor, grad_out: torch.Tensor, n: int, *,
              retain_graph: bool, into: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Per-sample ∂(Σ out·grad_out)/∂θ for the forward that produced ``out`` (n, *S).

        Returns (n, P) float32, or, with ``into=(buffer (B, P), rows (n,))``, adds sample j's gradient to
        ``buffer[rows[j]]`` in place (no (n, P) temporary: the buffers are the memory traffic that matters)
        and returns the buffer."""
        ys = [r[2] for r in records]
        deltas = torch.autograd.grad(out, ys, grad_outputs=grad_out, retain_graph=retain_graph, allow_unused=True)
        if into is None:
            flat, rows = torch.zeros(n, self.numel, device=out.device, dtype=torch.float32), None
        else:
            flat, rows = into
            if rows.numel() == flat.shape[0] and torch.equal(rows.cpu(), torch.arange(flat.shape[0])):
                rows = None  # every row in order: plain in-place adds
        for (mod, a, _), d in zip(records, deltas):
            if d is None:
                continue
            N = d.shape[0]
            if N % n:
                raise RuntimeError(f"network batch {N} is not a multiple of the sample batch {n}")
            if _FUSED and rows is None and N == n and isinstance(mod, nn.Linear):
                self._add_linear(flat, mod, a, d)
                continue
            gw, gb = _layer_grads(mod, a, d)  # (N, *W.shape), (N, O) or None
            w_slot, b_slot = self.slots[mod]
            self._add(flat, rows, w_slot, gw, n)
            if gb is not None:
                self._add(flat, rows, b_slot, gb, n)
        return flat

    def _add_linear(self, flat, mod, a, d):
        """Sample j's weight gradient Σ_tokens δ_j a_jᵀ accumulated straight into row j of ``flat`` by one batched
        GEMM (no (n, out, in) temporary, no second pass over it), its bias gradient Σ_tokens δ_j added. Rows of
        ``flat`` in sample order, one network row per sample. a (n, *, in), d (n, *, out)."""
        n = d.shape[0]
        a2 = a.float().reshape(n, -1, a.shape[-1])  # (n, L, in)
        d2 = d.float().reshape(n, -1, d.shape[-1])  # (n, L, out)
        w_slot, b_slot = self.slots[mod]
        if w_slot is not None:
            off, size = w_slot
            flat[:, off:off + size].view(n, d2.shape[-1], a2.shape[-1]).baddbmm_(d2.transpose(1, 2), a2)
        if b_slot is not None:
            off, size = b_slot
            flat[:, off:off + size] += d2.sum(1)

    def _add(self, flat, rows, slot, g, n):
        if slot is None:  # a frozen weight or bias
            return
        off, size = slot
        g = g.reshape(-1, n, size).sum(0).to(flat.dtype)  # rows j and j + n·m belong to sample j
        if rows is None:
            flat[:, off:off + size] += g
        else:
            flat[:, off:off + size].index_add_(0, rows, g)


def _layer_grads(mod: nn.Module, a: torch.Tensor, d: torch.Tensor):
    """Per-row weight and bias gradients of one layer call. a: layer input, d: ∂/∂output (same batch N)."""
    N = d.shape[0]
    a, d = a.float(), d.float()  # under autocast the input and the output gradient may differ in dtype
    if isinstance(mod, nn.Linear):
        a2 = a.reshape(N, -1, a.shape[-1])  # (N, L, in)
        d2 = d.reshape(N, -1, d.shape[-1])  # (N, L, out)
        return torch.einsum("nlo,nli->noi", d2, a2), d2.sum(1)
    # Conv2d: unfold the input into patches, then it is a Linear over patch positions
    # cols (N, C·kh·kw, L)
    cols = F.unfold(a, mod.kernel_size, dilation=mod.dilation, padding=mod.padding, stride=mod.stride)
    d2 = d.reshape(N, d.shape[1], -1)  # (N, O, L)
    gw = torch.einsum("nol,nkl->nok", d2, cols).reshape(N, *mod.weight.shape)
    return gw, d2.sum(2)


def per_sample_grads_loop(params: list[torch.Tensor], out: torch.Tensor, grad_out: torch.Tensor, *,
                          retain_graph: bool) -> torch.Tensor:
    """Exact fallback: one backward per sample through the batched graph → (n, P). Costs n backwards."""
    n = out.shape[0]
    rows = []
    for j in range(n):
        g = torch.zeros_like(grad_out)
        g[j] = grad_out[j]
        gs = torch.autograd.grad(out, params, grad_outputs=g, retain_graph=retain_graph or j < n - 1,
                                 allow_unused=True)
        rows.append(torch.cat([(x if x is not None else torch.zeros_like(p)).flatten().float()
                               for x, p in zip(gs, params)]))
    return torch.stack(rows)
