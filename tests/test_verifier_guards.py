"""Guards around scoring: reward plug-ins that misbehave stop the run with one line naming them; the built-in
verifiers score adversarial completions 0 without raising and in bounded time; the tiny dLLM pretraining cache
is built once under concurrency."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import sys
import time

import numpy as np
import pytest
import torch

from diffgrpo.cli.app import main
from diffgrpo.config import PretrainConfig
from diffgrpo.rewards import REWARDS, RewardError, compute_rewards
from diffgrpo.tasks import TASKS, Example, get_task, safe_eval

EXPECTED = "; expected (B,) numbers, one per sample"
B = 6


# ---------------------------------------------------------------------------------------------- reward misuse
def _score(monkeypatch, fn, name="bad"):
    monkeypatch.setitem(REWARDS, name, fn)
    return compute_rewards({name: 1.0}, torch.rand(B, 1, 4, 4), [f"p{i}" for i in range(B)], [{}] * B,
                           log=lambda *a: None)


class UserStop(BaseException):
    pass


@pytest.mark.parametrize("value, message", [
    ("oops", "reward 'bad' returned a str 'oops'" + EXPECTED),
    (b"\x00", "reward 'bad' returned a bytes b'\\x00'" + EXPECTED),
    (None, "reward 'bad' returned None" + EXPECTED),
    ({"score": [1.0] * B}, "reward 'bad' returned a dict with keys ['score']" + EXPECTED),
    (torch.ones(B - 1), "reward 'bad' returned shape (5,) for 6 samples" + EXPECTED),
    (torch.ones(2, B // 2), "reward 'bad' returned shape (2, 3) for 6 samples" + EXPECTED),
    (torch.ones(B, 2), "reward 'bad' returned shape (6, 2) for 6 samples" + EXPECTED),
    (np.ones((B, 1, 1)), "reward 'bad' returned shape (6, 1, 1) for 6 samples" + EXPECTED),
    (0.5, "reward 'bad' returned a single number (float) for 6 samples" + EXPECTED),
    (["x"] * B, "reward 'bad' returned a list that does not convert to numbers" + EXPECTED),
    ([1.0, [2.0, 3.0], 4.0, 5.0, 6.0, 7.0], "reward 'bad' returned a list that does not convert to numbers" +
     EXPECTED),  # a None entry is TRL's "not scored" (NaN): test_user_rewards
    (torch.ones(B, dtype=torch.complex64), "reward 'bad' returned a Tensor of complex numbers" + EXPECTED),
])
def test_unusable_return_value_stops_with_one_line_naming_the_reward(monkeypatch, value, message):
    calls = []

    def bad(images, prompts, metadata):
        calls.append(1)
        return value

    with pytest.raises(RewardError) as info:
        _score(monkeypatch, bad)
    assert str(info.value) == message
    assert "\n" not in str(info.value)
    e = info.value  # no torch traceback chained to it
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)
    assert len(calls) == 1  # a wrong return value is a bug, not a transient failure: no retry


def test_generator_return_value(monkeypatch):
    with pytest.raises(RewardError, match="^reward 'gen' returned a generator that does not convert to numbers; "
                                          r"expected \(B,\) numbers, one per sample$"):
        _score(monkeypatch, lambda *a: (x for x in range(B)), name="gen")


@pytest.mark.parametrize("value", [torch.arange(B), torch.ones(B, 1), np.arange(B, dtype=np.float64),
                                   [1, 2, 3, 4, 5, 6], (True,) * B, torch.ones(B, requires_grad=True) * 2])
def test_usable_return_values_still_accepted(monkeypatch, value):
    total, comps = _score(monkeypatch, lambda *a: value)
    assert total.shape == (B,) and comps["bad"].dtype == torch.float32 and not comps["bad"].requires_grad


def test_nan_still_marks_a_sample_invalid(monkeypatch):
    total, _ = _score(monkeypatch, lambda *a: [0.1, float("nan"), float("inf"), 0.2, 0.3, 0.4])
    assert torch.isnan(total[1:3]).all() and torch.isfinite(total[[0, 3, 4, 5]]).all()


@pytest.mark.parametrize("code, shown", [(3, "sys.exit(3)"), (None, "sys.exit()"), ("bye", "sys.exit('bye')")])
def test_sys_exit_in_a_reward_is_a_reward_error_not_a_silent_exit(monkeypatch, code, shown):
    calls = []

    def exits(images, prompts, metadata):
        calls.append(1)
        sys.exit(code)

    with pytest.raises(RewardError) as info:
        _score(monkeypatch, exits, name="quits")
    assert str(info.value).startswith(f"reward 'quits' called {shown}; a reward returns scores or raises an "
                                      f"exception, so the run stops here")
    assert len(calls) == 1  # not retried


def test_other_base_exceptions_are_reward_errors_but_keyboard_interrupt_propagates(monkeypatch):
    def stops(images, prompts, metadata):
        raise UserStop("halt")

    with pytest.raises(RewardError, match=r"^reward 'stops' raised UserStop \(a BaseException, not an Exception\): "
                                          "halt; the run stops$"):
        _score(monkeypatch, stops, name="stops")

    def interrupted(images, prompts, metadata):
        raise KeyboardInterrupt

    import signal

    # Python's own SIGINT handler installed (no run's handler, no library's): the KeyboardInterrupt may be Ctrl-C
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _score(monkeypatch, interrupted, name="ctrl_c")
        signal.signal(signal.SIGINT, lambda *a: None)  # another handler, no signal noted: the reward raised it
        with pytest.raises(RewardError, match="raised KeyboardInterrupt itself"):
            _score(monkeypatch, interrupted, name="ctrl_c")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_raising_reward_still_retried_once_and_reported_on_one_line(monkeypatch):
    calls = []

    def flaky(images, prompts, metadata):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("server\nsaid no")
        return torch.ones(B)

    total, _ = _score(monkeypatch, flaky, name="flaky")
    assert len(calls) == 2 and torch.equal(total, torch.ones(B))

    def down(images, prompts, metadata):
        raise ValueError("line one\nline two")

    with pytest.raises(RewardError) as info:
        _score(monkeypatch, down, name="down")
    assert str(info.value).startswith("reward 'down' raised ValueError: line one line two (after one retry)")
    assert "\n" not in str(info.value)


def test_run_with_a_reward_returning_a_string_stops_with_reward_error(make_trainer, monkeypatch, tmp_path):
    monkeypatch.setitem(REWARDS, "text_reward", lambda images, prompts, metadata: "great image")
    tr = make_trainer("reward.weights={text_reward: 1.0}", "train.num_iterations=2", "eval.every=0",
                      f"log.output_dir={tmp_path / 'run'}")
    with pytest.raises(RewardError, match="^reward 'text_reward' returned a str 'great image'; expected "
                                          r"\(B,\) numbers, one per sample$"):
        tr.train()
    assert tr.iteration == 0


def test_run_with_a_reward_calling_sys_exit_stops_with_reward_error(make_trainer, monkeypatch, tmp_path):
    monkeypatch.setitem(REWARDS, "quits", lambda images, prompts, metadata: sys.exit(3))
    tr = make_trainer("reward.weights={quits: 1.0}", "train.num_iterations=2", "eval.every=0",
                      f"log.output_dir={tmp_path / 'run'}")
    with pytest.raises(RewardError, match=r"^reward 'quits' called sys\.exit\(3\)"):
        tr.train()


def returns_text(images, prompts, metadata):
    """A ``module:function`` plug-in that returns a string (see the CLI test)."""
    return "excellent"


def test_cli_prints_the_plugin_misuse_as_one_line(tmp_path, capsys):
    name = f"{__name__}:returns_text"
    rc = main(["train", "train.task=digits", "model.image_size=8", "model.num_layers=1", "model.num_heads=2",
               "model.head_dim=8", "model.text_dim=16", "pretrain.steps=20", "pretrain.batch_size=16", "sampler.num_steps=2",
               "train.prompts_per_batch=2", "train.group_size=2", "train.num_iterations=1", "eval.every=0",
               "log.progress=false", f"reward.weights={{{name}: 1.0}}", f"log.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1] == f"error: reward '{name}' returned a str 'excellent'" + EXPECTED
    assert not any("Traceback" in line for line in err)


# ---------------------------------------------------------------------------------------------- verifiers
def _instance(name: str, **meta) -> Example:
    """The first train instance of a task whose meta matches ``meta`` (or the first one)."""
    for ex in get_task(name).instances("train") + get_task(name).instances("test"):
        if all(ex.meta.get(k) == v for k, v in meta.items()):
            return ex
    raise LookupError(meta)


def _check(name: str, completion, ex=None, *, via_score=False, seconds=0.5) -> dict[str, float]:
    task = get_task(name)
    ex = ex or task.instances("train")[0]
    t0 = time.perf_counter()
    r = task.score(completion, ex) if via_score else task.reward(completion, ex)
    assert time.perf_counter() - t0 < seconds, (name, completion[:40])
    assert set(r) == set(task.refused), r
    for k, v in r.items():
        assert np.isfinite(v), (k, v)
        assert (-1.0 <= v) if k == "errors" else (0.0 <= v <= 1.0), (k, v)
    return r


ZERO = {"reward": 0.0, "correct": 0.0}


def _zero(r: dict[str, float]) -> bool:
    return r["reward"] == 0.0 and r["correct"] == 0.0


@pytest.mark.parametrize("answer", ["1" + "0" * 308, "9**9**9", "9" * 5000, "9" * 10**6, "(" * 10**5 + "1" + ")" * 10**5,
                                    "1+" * 10**5 + "1", "-" * 10**5 + "1", "2**10", "1e309"])
def test_countdown_adversarial_answers_score_zero(answer):
    assert _zero(_check("countdown", f"<answer>{answer}</answer>"))


@pytest.mark.parametrize("expr", ["1" + "0" * 308, "9" * 16, "9**9**9", "(" * 33 + "1" + ")" * 33, "-" * 33 + "1",
                                  "1" + "+1" * 300, "(" * 10**5 + "1" + ")" * 10**5, "1" * 10**6])
def test_safe_eval_bounded(expr):
    t0 = time.perf_counter()
    v = safe_eval(expr)
    assert time.perf_counter() - t0 < 0.5
    assert v is None or (expr == "1" + "+1" * 300 and v == (301.0, [1] * 301))


def test_countdown_within_the_length_bound_is_still_read_safely():
    ex = _instance("countdown")
    # the verifier itself (no length refusal): a 309-digit literal used to raise OverflowError in int → float
    assert _zero(_check("countdown", "<answer>1" + "0" * 308 + "</answer>", ex, via_score=True))
    # a product past the float range is a well-formed wrong answer (inf), not an error
    r = _check("countdown", "<answer>" + "*".join(["999999999999999"] * 30) + "</answer>", ex, via_score=True)
    assert r == {"reward": pytest.approx(0.1), "format": 1.0, "correct": 0.0}
    assert safe_eval("(" * 32 + "1" + ")" * 32) == (1.0, [1])  # nesting up to 32 is read
    assert safe_eval("3 * (2 + 1) - -4 / 2") == (11.0, [3, 2, 1, 4, 2])
    assert safe_eval("07+1") is None and safe_eval("00+1") == (1.0, [0, 1])  # Python's literal rules


@pytest.mark.parametrize("depth", [10**5, 65, 1000])
def test_json_nested_too_deep_scores_as_not_json(depth):
    r = _check("json_schema", "[" * depth + "]" * depth)
    assert r == {"reward": 0.0, "errors": -1.0, "correct": 0.0}


def test_json_depth_limit_is_exact_and_ignores_brackets_in_strings():
    spec = "a:str"
    from diffgrpo.tasks import schema_from_spec

    ex = Example(spec, "", {"schema": schema_from_spec(spec)})
    assert _check("json_schema", "[" * 64 + "]" * 64, ex)["errors"] == 1.0  # valid JSON, wrong type
    assert _check("json_schema", '{"a":"' + "[" * 500 + '"}', ex) == {"reward": 1.0, "errors": 0.0, "correct": 1.0}
    assert _check("json_schema", '{"a":"\\"' + "{" * 500 + '"}', ex)["correct"] == 1.0  # escaped quote
    assert _zero(_check("json_schema", '{"a":' + "9" * 5000 + "}", ex))
    assert _check("json_schema", '{"a":1e999}', ex)["errors"] == 1.0  # inf is a number, not a string


def test_arithmetic_past_the_int_conversion_limit_scores_zero():
    ex = _instance("arithmetic", target=19)
    assert _zero(_check("arithmetic", "<answer>" + "1" * 4301 + "</answer>", ex))
    # the verifier itself compares digit strings, never int(): no ValueError past 4300 digits, same answer as int()
    r = _check("arithmetic", "<answer>" + "1" * 4301 + "</answer>", ex, via_score=True)
    assert r == {"reward": pytest.approx(0.1), "format": 1.0, "correct": 0.0}
    assert _check("arithmetic", "<answer>" + "0" * 5000 + "19</answer>", ex, via_score=True)["correct"] == 1.0
    assert _check("arithmetic", "<answer>19</answer>", ex)["correct"] == 1.0


@pytest.mark.parametrize("digits", ["١٩", "１９", "۱۹", "19\x00", "\x0019", "1\u200b9", "¹⁹"])
def test_arithmetic_only_ascii_digits_count(digits):
    ex = _instance("arithmetic", target=19)
    assert _check("arithmetic", f"<answer>{digits}</answer>", ex) == {"reward": 0.0, "format": 0.0, "correct": 0.0}


def test_sudoku_unicode_digits_do_not_solve_and_do_not_raise():
    ex = get_task("sudoku").instances("train")[0]
    sol = ex.meta["solution"]
    arabic = sol.translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    assert _check("sudoku", arabic, ex) == {"reward": 0.0, "cell_accuracy": 0.0, "correct": 0.0}  # was solved
    assert _zero(_check("sudoku", "²" * 16, ex))  # was ValueError from int('²')
    assert _zero(_check("sudoku", "\x00" * 16, ex))
    assert _check("sudoku", sol, ex)["correct"] == 1.0


@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize("make", [
    lambda ex: "x" * 10**6, lambda ex: "9" * 10**6, lambda ex: "[" * 10**6, lambda ex: "\x00" * 10**6,
    lambda ex: "<answer>" * 10**5, lambda ex: ex.answer + " " * 10**6, lambda ex: ex.answer * 10**5,
    lambda ex: "\x00", lambda ex: "", lambda ex: "<mask>" * 64, lambda ex: "\x00" * len(ex.answer),
])
def test_every_task_scores_adversarial_strings_zero_quickly(name, make):
    ex = get_task(name).instances("train")[0]
    assert _zero(_check(name, make(ex), ex, seconds=0.2))


@pytest.mark.parametrize("name", list(TASKS))
def test_non_strings_are_refused_and_batches_stay_in_range(name):
    task = get_task(name)
    ex = task.instances("train")[0]
    for junk in (None, b"<answer>19</answer>", 19, ["<answer>"]):
        assert task.reward(junk, ex) == task.refused
    batch = [ex.answer, "x" * 10**6, "\x00", "٣" * 16, "[" * 10**5, "<answer>" + "9" * 5000 + "</answer>"]
    scored = task.rewards(batch, [ex] * len(batch))
    assert scored["reward"].tolist()[0] == 1.0 and (scored["reward"][1:] == 0).all()
    assert all(torch.isfinite(v).all() for v in scored.values())


def test_long_completion_bound_follows_gen_length():
    for name, cls in TASKS.items():
        task = cls()
        ex = task.instances("train")[0]
        assert task.max_chars == 64 * task.gen_length
        assert task.reward(ex.answer + " " * (task.max_chars - len(ex.answer)), ex)["correct"] == 1.0, name
        assert task.reward(ex.answer + " " * (task.max_chars - len(ex.answer) + 1), ex) == task.refused, name


# ---------------------------------------------------------------------------------------------- pretraining cache
def _pretrain_in_child(cache_dir: str, pcfg, barrier, out):
    import os

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from diffgrpo.models.hf_masked_lm import load_or_pretrain_mlm

    lines: list[str] = []
    barrier.wait()  # both check the cache at the same moment
    net = load_or_pretrain_mlm(get_task("arithmetic"), pcfg, cache_dir=cache_dir, progress=False,
                               log=lines.append)
    h = hashlib.sha256()
    for k, v in sorted(net.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    out.put((lines, h.hexdigest()))


def test_two_processes_pretrain_the_tiny_dllm_once_and_load_the_same_weights(tmp_path):
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    pcfg = PretrainConfig(steps=30, batch_size=8)
    procs = [ctx.Process(target=_pretrain_in_child, args=(str(tmp_path / "cache"), pcfg, barrier, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    pretrained = [line for lines, _ in results for line in lines if "pretraining" in line]
    assert len(pretrained) == 1, pretrained
    assert results[0][1] == results[1][1]
    entries = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 1 and entries[0].startswith("tiny-mlm-arithmetic-")  # no temporary left behind
