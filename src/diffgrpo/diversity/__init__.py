"""Diversity-preserving objectives: parts that change the rewards the advantages are formed from, the samples
that train, or the advantages themselves — never the engine — so they work with every flow engine.

``DIVERSITY`` maps each ``diversity.method`` name to its ``objective(knobs, feats (B, D), rewards (B,),
group_ids (B,)) -> Part``; several compose with :func:`compose`.

The features are the guards' feature space (``eval.guard_features``; :func:`guards.diversity_feature_fn`); on the
shapes tasks, where the guards have none, the objectives measure samples in the shapes checker's detection space
(per (shape, colour) label: count, mean position and size; :mod:`diffgrpo.rewards.shapes_features`).
"""
from __future__ import annotations

from . import diversegrpo, drift, gardo
from .groups import cosine_distances, mean_pairwise_distance, nearest_neighbour_distance
from .part import Part, compose, parse_methods

DIVERSITY = {"gardo": gardo.objective, "diversegrpo": diversegrpo.objective, "drift": drift.objective}
METHODS = tuple(DIVERSITY)

__all__ = ["DIVERSITY", "METHODS", "Part", "compose", "parse_methods", "cosine_distances", "mean_pairwise_distance",
           "nearest_neighbour_distance", "gardo", "diversegrpo", "drift"]
