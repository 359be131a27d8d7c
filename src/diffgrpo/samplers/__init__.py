"""Samplers: flow-matching transition kernels (``flow_sde``) and trajectory sampling (``rollout``)."""
from . import flow_sde
from .flow_sde import SDE_TYPES, sigma_grid, step

__all__ = ["flow_sde", "step", "sigma_grid", "SDE_TYPES"]
