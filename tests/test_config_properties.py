"""Property tests of configuration parsing: whatever the overrides or the YAML file hold, the result is a valid
RunConfig or a one-line ConfigError (never another exception), and a valid result re-validates and round-trips
through to_yaml / from_yaml unchanged."""
import copy
import dataclasses
import math
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffgrpo import ConfigError, RunConfig
from diffgrpo.validation import validate


def _keys(obj, prefix=""):
    """Every dotted key of the config (sections and fields)."""
    hints = typing.get_type_hints(type(obj))
    out = []
    for f in dataclasses.fields(obj):
        key = prefix + f.name
        out.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            out += _keys(getattr(obj, f.name), key + ".")
    return out


KEYS = _keys(RunConfig())
SECTIONS = {k: [f.name for f in dataclasses.fields(getattr(RunConfig(), k))]
            for k in KEYS if "." not in k and dataclasses.is_dataclass(getattr(RunConfig(), k))}
FIELD_NAMES = sorted({n for names in SECTIONS.values() for n in names})

YAML_FRAGMENTS = [
    "[1,", "{a: b", "[1, 2]", "[[1]]", "{}", "[]", "{digit_alignment: 1.0}", "{':fn': 1}", "{nosuch:fn: 1}",
    ".nan", ".inf", "-.inf", "nan", "inf", "1e999", "-0.0", "1e-320", "~", "null", "true", "yes", "off", "0x1F",
    "0o17", "1_000", "1e3", "1.5e3", "2020-13-45", "2020-01-01", "2001-12-14t21:59:43.10-05:00", "&a [*a]", "*x",
    "!!python/object:os.system", "!!binary aGVsbG8=", "!!set {a}", "? [a]\n: b", "--- 1\n--- 2", "%YAML 1.1\n--- 1",
    "'quoted'", '"\\x00"', '"\\u2028"', "a: b: c", "- a", ":", "=", "'", '"', "#", "|\n x", "[" * 300,
    "9" * 5000, "-1", "0", "1", "2", "65536", "65537", "1000000000", "10" * 30,
    "jagg", "retain", "single_step", "json:dumps", "json:JSONDecoder", ":Bar", "foo:Bar", "tiny_mlm", "hf_masked_lm",
    "diffusers", "cuda", "cuda:3", "gpu", "cpu", "mps", "window", "~/x", "/", ".", "/etc/passwd", "/nonexistent/x",
    "sudoku", "json_schema", "countdown", "diffu_grpo", "sml", "spread", "fsdp2",
]

texts = st.text(max_size=24)
numbers = st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True)).map(repr)
fragments = st.sampled_from(YAML_FRAGMENTS)
values = st.one_of(texts, numbers, fragments,
                   st.lists(st.one_of(fragments, numbers), min_size=1, max_size=3).map(", ".join),
                   st.lists(st.one_of(fragments, numbers), max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"))
keys = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).map(lambda k: k + "." + "x"), texts,
                 st.sampled_from(KEYS).flatmap(lambda k: st.sampled_from([k.upper(), k[:-1], k + "s", " " + k])),
                 st.just("reward.weights").flatmap(lambda k: texts.map(lambda t: f"{k}.{t}")))
overrides = st.one_of(st.tuples(keys, values).map(lambda kv: f"{kv[0]}={kv[1]}"), texts)


def _leaf_fields(obj, prefix=""):
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(getattr(obj, f.name), prefix + f.name + ".")
        else:
            yield prefix + f.name, hints[f.name], f.metadata


def _typed_value(tp, meta):
    """Values of roughly the field's type (in and out of range), so that many overrides are valid."""
    if meta.get("choices"):
        return st.one_of(st.sampled_from(meta["choices"]).map(str), texts)
    if tp is bool:
        return st.sampled_from(["true", "false", "yes", "no", "1", "0", "maybe"])
    if tp is int:
        return st.one_of(st.integers(-2, 70), st.integers()).map(str)
    if tp is float:
        return st.one_of(st.floats(-1, 10), st.floats(allow_nan=True, allow_infinity=True)).map(repr)
    return st.one_of(texts, fragments)


typed = st.sampled_from(list(_leaf_fields(RunConfig()))).flatmap(
    lambda kf: _typed_value(kf[1], kf[2]).map(lambda v: f"{kf[0]}={v}"))
# a likely-valid override now and then, so that the valid branch (re-validation, round trip) is exercised too
plausible = st.sampled_from(["model.name=tiny_mlm", "engine.name=jagg", "sampler.num_steps=6", "train.group_size=4",
                             "steps.mode=window", "dllm.gen_length=6", "dllm.block_length=2", "log.output_dir=~/r"])

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), texts,
                    fragments)
docs_values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(texts, c, max_size=3),
                           max_leaves=8)
sections = st.sampled_from(sorted(SECTIONS)).flatmap(
    lambda s: st.tuples(st.just(s), st.dictionaries(st.one_of(st.sampled_from(SECTIONS[s]), st.sampled_from(FIELD_NAMES),
                                                              texts), docs_values, max_size=4)))
documents = st.one_of(
    st.lists(sections, max_size=4).map(dict),
    st.dictionaries(st.one_of(st.sampled_from(KEYS), texts), docs_values, max_size=4),
    docs_values,
)


def _check(build):
    """Run ``build``: a ConfigError is fine (one line); a RunConfig must re-validate and round-trip."""
    try:
        cfg = build()
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
        return None
    assert isinstance(cfg, RunConfig)
    again = copy.deepcopy(cfg)
    validate(again)
    assert again.to_dict() == cfg.to_dict()
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "config.yaml"
        p.write_text(cfg.to_yaml())
        back = RunConfig.from_yaml(p)
    assert back.to_dict() == cfg.to_dict()
    for v in _floats(back.to_dict()):
        assert math.isfinite(v)
    return cfg


def _floats(d):
    for v in d.values():
        if isinstance(v, dict):
            yield from _floats(v)
        elif isinstance(v, float):
            yield v


SETTINGS = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SETTINGS
@given(st.lists(st.one_of(overrides, typed, plausible), max_size=4))
def test_random_overrides_give_a_config_or_a_config_error(items):
    _check(lambda: RunConfig.from_overrides(items))


@SETTINGS
@given(documents)
def test_random_yaml_documents_give_a_config_or_a_config_error(doc):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        try:
            p.write_text(yaml.safe_dump(doc))
        except yaml.YAMLError:
            return
        _check(lambda: RunConfig.from_yaml(p))


@SETTINGS
@given(st.one_of(texts, st.lists(st.one_of(fragments, texts), max_size=5).map("\n".join),
                 st.binary(max_size=40)))
def test_random_file_contents_give_a_config_or_a_config_error(content):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8")
        _check(lambda: RunConfig.from_yaml(p))


@pytest.mark.parametrize("items", [["model.name=tiny_mlm", "dllm.gen_length=6", "dllm.block_length=2"],
                                   ["engine.name=jagg", "sampler.num_steps=6", "steps.mode=window"], []])
def test_valid_configs_round_trip(items):
    assert _check(lambda: RunConfig.from_overrides(items)) is not None
