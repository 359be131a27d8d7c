"""Regional compilation of flow transformers (model.compile): equal to eager within the stated tolerance (outputs
and gradients), and no compilation after the first iteration, for sampling and every engine.

The default tests trace with ``aot_eager`` (Dynamo + AOTAutograd, no code generation: the same graphs inductor
gets, seconds to build); inductor itself (C++ code generation on CPU, slow to build) runs behind the slow marker.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from diffgrpo import RunConfig
from diffgrpo.engines import ENGINES
from diffgrpo.errors import ConfigError
from diffgrpo.models.regional_compile import (
    COMPILE_BACKENDS,
    compile_blocks,
    compile_policy,
    repeated_blocks,
)
from diffgrpo.models.tiny import TinyFlowNet
from diffgrpo.validation import validate

ENGINE_ARGS = {"jagg": ["engine.window=3"], "retain": [], "single_step": [], "reweight": [], "recompute": [],
               "nft": [], "awm": [], "dgpo": []}


class GraphCounter:
    """A torch.compile backend that counts the graphs it is given and runs them through ``aot_eager``."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, example_inputs)


def _net(seed=0):
    torch.manual_seed(seed)
    return TinyFlowNet(image_size=8, patch_size=2, num_layers=2, num_heads=2, head_dim=8, text_dim=16).transformer


def _inputs(B, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(B, 1, 8, 8, generator=g), "encoder_hidden_states": torch.randn(B, 5, 16,
                generator=g), "pooled_projections": torch.randn(B, 16, generator=g),
                "timestep": torch.rand(B, generator=g) * 1000}


def _out_and_grads(tr, inputs):
    tr.zero_grad(set_to_none=True)
    out = tr(**inputs, return_dict=False)[0]
    (out.square().mean() + out.sum() * 0.1).backward()
    return out.detach(), {n: p.grad.clone() for n, p in tr.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend,tol", [("aot_eager", 1e-6),
                                         pytest.param("inductor", 1e-4, marks=pytest.mark.slow)])
def test_compiled_blocks_equal_eager_outputs_and_gradients(backend, tol):
    torch._dynamo.reset()
    eager = _net()
    comp = copy.deepcopy(eager)
    n = compile_blocks(comp, backend)
    assert n == len(repeated_blocks(eager)) == 2
    for B in (3, 2, 3):  # a second shape, then the first again
        x = _inputs(B)
        o1, g1 = _out_and_grads(eager, x)
        o2, g2 = _out_and_grads(comp, x)
        scale = float(o1.abs().max())
        torch.testing.assert_close(o2, o1, atol=tol * (1 + scale), rtol=tol)
        assert g1.keys() == g2.keys() and len(g1) > 10
        for k in g1:
            torch.testing.assert_close(g2[k], g1[k], atol=tol * (1 + float(g1[k].abs().max())), rtol=tol, msg=k)


def test_each_block_shape_compiles_once():
    torch._dynamo.reset()
    counter = GraphCounter()
    tr = _net()
    for block in repeated_blocks(tr):
        block.compile(backend=counter, dynamic=False)
    x = _inputs(3)
    tr(**x, return_dict=False)[0].sum().backward()
    with torch.no_grad():  # grad mode is part of a graph's guards: sampling (no grad) compiles its own
        tr(**x, return_dict=False)
    first = counter.graphs
    assert first == 4  # the two SD3 block variants (the last block drops the text stream) × grad mode
    for _ in range(3):
        tr(**x, return_dict=False)[0].sum().backward()
        with torch.no_grad():
            tr(**x, return_dict=False)
    assert counter.graphs == first


# by default the baseline, the one-step and a forward-process engine; every engine with -m slow
DEFAULT_COMPILE_ENGINES = ("recompute", "single_step", "nft")


@pytest.mark.parametrize("engine", [e if e in DEFAULT_COMPILE_ENGINES else pytest.param(e, marks=pytest.mark.slow)
                                    for e in sorted(ENGINES)])
def test_no_compilation_after_the_first_iteration(engine, make_trainer, monkeypatch):
    """Sampling and the engine's forward/backward run compiled blocks; the second and third iterations compile
    nothing (the counting backend receives no new graph), and the trained weights stay finite."""
    torch._dynamo.reset()
    counter = GraphCounter()
    monkeypatch.setattr("diffgrpo.models.regional_compile.COMPILE_BACKENDS", (*COMPILE_BACKENDS, counter))
    monkeypatch.setattr("diffgrpo.flow.family.compile_policy",
                        lambda policy, backend: compile_policy(policy, counter))  # the family's call, counted
    tr = make_trainer("model.compile=true", "model.compile_backend=aot_eager", f"engine.name={engine}",
                      "loss.beta=0.01", *ENGINE_ARGS[engine])
    tr.step()
    first = counter.graphs
    assert first > 0  # the blocks ran compiled
    tr.step()
    tr.step()
    assert counter.graphs == first, f"{engine}: {counter.graphs - first} compilations after the first iteration"
    assert all(torch.isfinite(p).all() for p in tr.params)


def test_compile_keys_are_checked():
    with pytest.raises(ConfigError, match=r"^model\.compile_backend: value 'aot_eager' applies only"):
        validate(RunConfig.from_overrides(["model.compile_backend=aot_eager"]))
    with pytest.raises(ConfigError, match=r"^model\.compile: value True is not supported with dist\.mode=fsdp2"):
        validate(RunConfig.from_overrides(["model.compile=true", "dist.mode=fsdp2"]))
    with pytest.raises(ConfigError, match=r"^model\.compile: does not apply to model\.name=tiny_mlm"):
        validate(RunConfig.from_overrides(["model.name=tiny_mlm", "model.compile=true"]))
