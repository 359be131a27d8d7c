"""Policy adapters. ``POLICIES`` maps ``model.name`` to a factory ``(RunConfig, progress, log) -> policy``.

Every policy provides ``trainable_parameters()``, ``named_trainable_parameters()``, ``state_dict()`` /
``load_state_dict()`` (the trainable weights), ``reference()`` (context manager: the KL reference weights),
``export(run_dir)`` (the end-of-run export in the ecosystem's format), ``save_checkpoint_files(directory,
trainable)`` (files a checkpoint carries beside the trainable weights, e.g. ``lora/``), ``forward_module`` (what its forwards go
through: the trained module or its data-parallel wrapper), ``uses_cfg``, ``device`` and ``counters``
({"forwards_grad", "forwards_nograd"} sample-forward counts).

Flow policies (one class for every flow model, :class:`DiffusersFlowPolicy`, the built-in tiny SD3 included):
``encode(prompts, sources=None) -> cond`` (dict of tensors batched on dim 0; ``sources``: each prompt's source
images, read by the editing pipelines of ``pipelines/editing.py``), ``velocity(x, sigma, cond)`` (CFG inside),
``decode(x) -> images in [0, 1]``, ``latent_shape``, ``transformer``. Masked-LM policies
(:class:`~diffgrpo.models.hf_masked_lm.MaskedLMPolicy`): ``logits(input_ids)``, ``vocab``, ``model``.
"""
from __future__ import annotations

from .diffusers_adapter import DiffusersFlowPolicy, PolicyOptions, build_diffusers_policy
from .hf_masked_lm import build_hf_masked_lm_policy, build_tiny_mlm_policy
from .tiny import build_tiny_policy
from .tiny_block import build_tiny_block_policy

POLICIES = {
    "tiny": build_tiny_policy,
    "tiny_mlm": build_tiny_mlm_policy,  # masked diffusion LMs: logits(input_ids), see hf_masked_lm.py
    "tiny_block": build_tiny_block_policy,  # block-causal masked LM (exact block cache), see tiny_block.py
    "hf_masked_lm": build_hf_masked_lm_policy,
    "diffusers": build_diffusers_policy,  # the architectures of pipelines/, see diffusers_adapter.py
}

__all__ = ["POLICIES", "build_tiny_policy", "DiffusersFlowPolicy", "PolicyOptions", "build_diffusers_policy"]
