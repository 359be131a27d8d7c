"""The one resolver of ``module:attr`` plug-ins: a good spec, a missing module or attribute, a malformed spec, a
module that raises on import, the current directory importable; and the callers that word its errors."""
from __future__ import annotations

import json
import os
import sys

import pytest

from diffgrpo import plugins
from diffgrpo.errors import ConfigError


def _message(spec: str, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        plugins.resolve(spec, **{"key": "some.key", **kw})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("some.key: "), msg
    return msg


def test_a_good_spec_resolves_to_the_attribute():
    assert plugins.resolve("json:dumps", key="some.key") is json.dumps
    assert plugins.resolve("os.path:join", key="some.key") is os.path.join
    assert plugins.resolve("json.decoder:JSONDecoder", key="some.key") is json.decoder.JSONDecoder


def test_a_missing_module_names_the_key_and_the_error():
    assert _message("no_such_module_xyz:fn") == ("some.key: cannot import 'no_such_module_xyz:fn' "
                                                 "(ModuleNotFoundError: No module named 'no_such_module_xyz')")


def test_a_missing_attribute_names_the_key_and_the_error():
    msg = _message("json:NoSuchThing")
    assert msg.startswith("some.key: cannot import 'json:NoSuchThing' (AttributeError: "), msg
    assert "NoSuchThing" in msg[len("some.key: cannot import 'json:NoSuchThing'"):]


@pytest.mark.parametrize("spec, problem", [
    (":fn", "the module name is empty"),
    ("json:", "'' is not a Python name"),
    (".rel:fn", "'.rel' is not a dotted module name"),
    ("a b:fn", "'a b' is not a dotted module name"),
    ("json:not-a-name", "'not-a-name' is not a Python name"),
    ("no_colon_at_all", "no ':' between module and name"),
])
def test_a_malformed_spec_is_refused_before_any_import(spec, problem):
    assert _message(spec) == f"some.key: {spec!r} is not a valid module:attr ({problem})"


def test_the_spec_splits_at_its_last_colon():
    assert plugins.split("pkg.mod:fn") == ("pkg.mod", "fn", "")
    assert plugins.split("a:b:fn") == ("a:b", "fn", "'a:b' is not a dotted module name")


def test_a_module_raising_on_import_is_one_line_with_its_type(tmp_path, monkeypatch):
    (tmp_path / "raising_plugin_mod.py").write_text("raise RuntimeError('broken\\n  on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = _message("raising_plugin_mod:fn")
    assert msg == "some.key: cannot import 'raising_plugin_mod:fn' (RuntimeError: broken on import)"


def test_a_long_import_error_is_cut_to_one_bounded_line(tmp_path, monkeypatch):
    (tmp_path / "long_error_plugin_mod.py").write_text("raise ValueError('x' * 5000)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = _message("long_error_plugin_mod:fn")
    assert msg.endswith("…)") and len(msg) < len("some.key: cannot import 'long_error_plugin_mod:fn' (ValueError: )") \
        + plugins.ERROR_CHARS + 1


def test_templates_and_hint_word_the_message():
    kw = {"malformed": "{key}: value {spec!r} is not a valid module:Class ({problem})",
          "failed": "{key}: value {spec!r} cannot be imported ({error})", "hint": "; choose {one} of ['a']"}
    assert _message(":X", **kw) == "some.key: value ':X' is not a valid module:Class (the module name is empty); " \
                                   "choose {one} of ['a']"
    assert _message("no_such_module_xyz:X", **kw) == ("some.key: value 'no_such_module_xyz:X' cannot be imported "
                                                      "(ModuleNotFoundError: No module named 'no_such_module_xyz'); "
                                                      "choose {one} of ['a']")


def test_the_current_directory_is_importable(tmp_path, monkeypatch):
    """A console script does not put the current directory on sys.path; the resolver appends it (never ahead of
    installed packages)."""
    (tmp_path / "cwd_plugin_mod.py").write_text("def score(images, prompts, metadata):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_plugin_mod", raising=False)
    fn = plugins.resolve("cwd_plugin_mod:score", key="reward.weights")
    assert fn([], [], []) == [1.0] and fn.__module__ == "cwd_plugin_mod"
    assert sys.path[-1] == os.getcwd()
    monkeypatch.delitem(sys.modules, "cwd_plugin_mod")


def test_every_plug_in_key_resolves_through_it(monkeypatch):
    """Rewards, engines and guard rewards name their key and keep their own wording."""
    from diffgrpo.config import EngineConfig
    from diffgrpo.engines import build_engine
    from diffgrpo.flow.rules import engine_class
    from diffgrpo.guards import plugin
    from diffgrpo.rewards import resolve_reward

    seen = []
    real = plugins.resolve

    def spy(spec, **kw):
        seen.append((spec, kw["key"]))
        return real(spec, **kw)

    monkeypatch.setattr(plugins, "resolve", spy)
    assert resolve_reward("json:dumps") is json.dumps
    assert engine_class("json.decoder:JSONDecoder") is json.decoder.JSONDecoder
    assert plugin("json:loads", "eval.guard_rewards") is json.loads
    with pytest.raises(ConfigError, match=r"^engine.name: cannot import 'no_such_module_xyz:E' "):
        build_engine(EngineConfig(name="no_such_module_xyz:E"))
    assert seen == [("json:dumps", "reward.weights"), ("json.decoder:JSONDecoder", "engine.name"),
                    ("json:loads", "eval.guard_rewards"), ("no_such_module_xyz:E", "engine.name")]
    with pytest.raises(ConfigError, match=r"^reward\.weights: cannot import reward 'no_such_module_xyz:fn' "
                                          r"\(ModuleNotFoundError: No module named 'no_such_module_xyz'\)$"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match=r"^reward\.weights: reward ':fn' is not a valid module:function \(the "
                                          r"module name is empty\); choose one of \["):
        resolve_reward(":fn")
    with pytest.raises(ConfigError, match=r"^eval\.guard_rewards: cannot import 'no_such_module_xyz:fn' "
                                          r"\(ModuleNotFoundError: .*\); give a registry reward or "
                                          r"package\.module:function$"):
        plugin("no_such_module_xyz:fn", "eval.guard_rewards")
