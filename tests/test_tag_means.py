"""GenEval's overall score is the mean over its categories: ``rewards.tag_means`` against a hand computation."""
import math

import torch

from diffgrpo.rewards import tag_means


def test_tag_means_average_each_category_then_leave_nans_out():
    v = torch.tensor([1.0, 0.0, 0.0, 1.0, float("nan"), 1.0])
    meta = [{"tag": "a"}, {"tag": "a"}, {"tag": "b"}, {"tag": "c"}, {"tag": "c"}, {"tag": "c"}]
    got = tag_means(v, meta)
    assert got == {"a": 0.5, "b": 0.0, "c": 1.0}  # first-seen order, NaN excluded from c
    overall = sum(got.values()) / len(got)
    assert math.isclose(overall, 0.5) and not math.isclose(overall, float(v[torch.isfinite(v)].mean()))


def test_tag_means_are_empty_unless_every_record_has_a_tag():
    v = torch.ones(3)
    assert tag_means(v, [{"tag": "a"}, {}, {"tag": "b"}]) == {}
    assert tag_means(v, [None, None, None]) == {}
    assert math.isnan(tag_means(torch.tensor([float("nan")]), [{"tag": "a"}])["a"])
