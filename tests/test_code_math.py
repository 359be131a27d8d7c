"""Code tasks (the completion runs against tests in the sandbox), the toy code task of the built-in masked LM, and
competition-math answers compared for equivalence by math-verify."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

import diffgrpo
from diffgrpo.config import RunConfig
from diffgrpo.errors import ConfigError
from diffgrpo.models.hf_masked_lm import MaskedLMPolicy, tiny_bert
from diffgrpo.rewards import check_options, compute_rewards, make_rewards
from diffgrpo.sandbox import LocalBackend, SandboxPool
from diffgrpo.tasks import VOCAB, examples_from_file, get_task
from diffgrpo.tasks.code import (
    CodeTask,
    CodeToy,
    extract_code,
    read_records,
    toy_functions,
)
from diffgrpo.tasks.competition_math import MathTask, math_equal, parse_answer
from diffgrpo.trainer import Trainer
from diffgrpo.validation import validate


@pytest.fixture(scope="module")
def local_pool():
    return SandboxPool(LocalBackend(), workers=2, log=lambda *a: None)


def test_extract_code_prefers_a_fenced_block():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\ntrailing") == "def f():\n    return 1\n"
    assert extract_code("```\nx = 2\n```") == "x = 2\n"
    assert extract_code("<answer>x = 3</answer>") == "x = 3"
    assert extract_code("x = 4") == "x = 4"
    assert extract_code(None) == "" and extract_code("x" * 70000) == ""


# ---------------------------------------------------------------------------------------------- code (files)
def test_shipped_mbpp_set_reference_solutions_pass_and_wrong_ones_do_not(local_pool):
    task = CodeTask()
    task.scorer.use(local_pool)
    exs = [e for split in ("train", "test") for e in
           task.examples_from_records(read_records(f"builtin:code/{split}", key="k", prompt_field="text"),
                                      key="k", path=split)]
    assert len(exs) == 16 and all(e.meta["tests"] and e.answer for e in exs)
    fenced = [f"Sure.\n```python\n{e.answer}\n```\nDone." for e in exs]
    got = task.rewards(fenced, exs)
    assert got["reward"].tolist() == [1.0] * 16 and got["pass_at_1"].tolist() == [1.0] * 16
    wrong = task.rewards(["def sum_squares(xs):\n    return 14", "not python at all ("], exs[:2])
    assert wrong["reward"][0] == pytest.approx(1 / 3) and wrong["pass_at_1"][0] == 0.0  # one of three asserts holds
    assert wrong["reward"][1] == 0.0 and wrong["correct"].tolist() == [0.0, 0.0]


HUMANEVAL = {"task_id": "toy/0", "prompt": 'def add(a, b):\n    """Return a + b."""\n',
             "canonical_solution": "    return a + b\n", "entry_point": "add",
             "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"}


def test_humaneval_layout_continues_the_prompt_or_takes_a_whole_function(tmp_path, local_pool):
    f = tmp_path / "he.jsonl"
    f.write_text(json.dumps(HUMANEVAL) + "\n")
    task = CodeTask()
    task.scorer.use(local_pool)
    (ex,) = examples_from_file(str(f), task)
    comps = ["    return a + b\n", "```python\ndef add(a, b):\n    return b + a\n```", "    return a - b\n"]
    assert task.rewards(comps, [ex] * 3)["reward"].tolist() == [1.0, 1.0, 0.0]


def test_a_record_without_tests_is_a_one_line_config_error(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"text": "write f", "code": "def f(): pass"}) + "\n")
    with pytest.raises(ConfigError, match="dllm.data_file: file .* record 1: neither MBPP") as e:
        examples_from_file(str(f), CodeTask(), prompt_field="text")
    assert "\n" not in str(e.value)


def test_verify_code_registry_rewards_and_their_options():
    meta = [{"test_list": ["assert f(1) == 2", "assert f(2) == 3", "assert f(0) == 5"]}] * 3
    comps = ["def f(x):\n    return x + 1", "```python\ndef f(x):\n    return 5 if x == 0 else x + 1\n```", "oops("]
    fns = make_rewards({"verify_code": 1.0, "verify_code_pass_at_1": 1.0},
                       {"verify_code": {"backend": "local", "workers": 2, "timeout": 5.0},
                        "verify_code_pass_at_1": {"backend": "local"}})
    total, parts = compute_rewards({"verify_code": 1.0, "verify_code_pass_at_1": 1.0}, comps, ["p"] * 3, meta,
                                   rewards=fns)
    assert parts["verify_code"].tolist() == pytest.approx([2 / 3, 1.0, 0.0])
    assert parts["verify_code_pass_at_1"].tolist() == [0.0, 1.0, 0.0]
    assert total.tolist() == pytest.approx([2 / 3, 2.0, 0.0])
    check_options({"verify_code": 1.0}, {"verify_code": {"workers": 4, "backend": "bwrap", "url": "http://x"}})
    with pytest.raises(ConfigError, match="reward.options.verify_code.backend: value 'docker' is not allowed"):
        check_options({"verify_code": 1.0}, {"verify_code": {"backend": "docker"}})
    with pytest.raises(ConfigError, match="reward.options.verify_code.gpus: unknown option"):
        check_options({"verify_code": 1.0}, {"verify_code": {"gpus": 1}})


# ---------------------------------------------------------------------------------------------- code_toy
def test_code_toy_splits_by_function_and_fits_the_built_in_model():
    task = get_task("code_toy")
    train, test = task.instances("train"), task.instances("test")
    f_train = {e.meta["function"] for e in train}
    f_test = {e.meta["function"] for e in test}
    assert f_train and f_test and not f_train & f_test and f_train | f_test == set(toy_functions())
    assert len(test) / (len(train) + len(test)) == pytest.approx(0.2, abs=0.08)
    for e in train + test:
        assert len(VOCAB.encode(e.prompt)) <= task.prompt_length and len(VOCAB.encode(e.answer)) <= task.gen_length
        assert len(VOCAB.encode(task.slip(e))) <= task.gen_length
    ex = test[3]
    assert task.example(ex.prompt, ex.answer).meta["function"] == ex.meta["function"]


def test_code_toy_scores_in_the_sandbox(local_pool):
    task = CodeToy()
    task.scorer.use(local_pool)
    exs = task.instances("test")[:6] + task.instances("train")[:6]
    right = task.rewards([e.answer for e in exs], exs)
    assert right["reward"].tolist() == [1.0] * 12 and right["correct"].tolist() == [1.0] * 12
    slip = task.rewards([task.slip(e) for e in exs], exs)
    assert slip["correct"].tolist() == [0.0] * 12 and slip["format"].tolist() == [1.0] * 12
    assert slip["reward"].tolist() == pytest.approx([0.1] * 12)
    odd = task.rewards(["<answer></answer>", "2*x+1", "<answer>x*x*x-x*x-2*x+__import__('os').getpid()*0</answer>",
                        "<answer>(lambda: 1)(</answer>"], exs[:4])
    assert odd["format"].tolist() == [0.0, 0.0, 1.0, 1.0] and odd["correct"].tolist() == [0.0] * 4


def test_code_toy_trains_through_the_trainer_with_its_sandbox():
    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "dllm.task=code_toy", "dllm.sandbox=local",
                                    "dllm.sandbox_workers=2", "train.prompts_per_batch=2", "train.group_size=4",
                                    "log.progress=false", "log.save_images=false", "dllm.eval_size=4"])
    validate(cfg)
    torch.manual_seed(0)
    task = get_task("code_toy")
    net = tiny_bert(len(VOCAB), max_positions=task.prompt_length + task.gen_length, hidden_size=32,
                    num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    tr = Trainer(cfg, policy=MaskedLMPolicy(net, vocab=VOCAB, keep_reference=False), log=lambda *a: None)
    assert tr.family.task.scorer.pool.backend.name == "local"
    ro = tr.rollout()
    assert ro.rewards.shape == (8,) and set(ro.reward_components) >= {"format", "correct"}
    row, _ = tr.family.evaluate()
    assert 0.0 <= row["eval/accuracy"] <= 1.0 and "eval/rewards/format/mean" in row


def test_sandbox_keys_are_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="dllm.sandbox_workers: applies to the code tasks"):
        validate(RunConfig.from_overrides(["model.name=tiny_mlm", "dllm.sandbox_workers=2"]))
    with pytest.raises(ConfigError, match="dllm.sandbox_url: value '' must be the service's http"):
        validate(RunConfig.from_overrides(["model.name=tiny_mlm", "dllm.task=code_toy", "dllm.sandbox=remote"]))
    with pytest.raises(ConfigError, match="dllm.sandbox: value 'docker' is not allowed"):
        RunConfig.from_overrides(["model.name=tiny_mlm", "dllm.task=code_toy", "dllm.sandbox=docker"])
    with pytest.raises(ConfigError, match="dllm.task: value 'code' needs model.name=hf_masked_lm"):
        validate(RunConfig.from_overrides(["model.name=tiny_mlm", "dllm.task=code",
                                           "dllm.data_file=builtin:code/train", "dllm.prompt_field=text"]))


# ---------------------------------------------------------------------------------------------- math
EQUIVALENT = [
    ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$."),
    ("\\frac{1}{2}", "\\boxed{\\dfrac12}"),
    ("\\frac{3}{4}", "<answer>0.75</answer>"),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}"),
    ("\\frac{\\sqrt{3}}{3}", "\\boxed{\\frac{1}{\\sqrt{3}}}"),
    ("[1, 2)", "so x lies in \\boxed{[1,2)}"),
    ("(-\\infty, 3]", "\\boxed{(-\\infty,3]}"),
    ("50\\%", "\\boxed{\\frac{1}{2}}"),
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),
    ("\\{1, 2, 3\\}", "\\boxed{\\{3,2,1\\}}"),
    ("72", "Total: \\boxed{72.0}"),
    ("\\pi", "\\boxed{\\pi}"),
    ("Solution ... so the answer is $\\boxed{\\frac{5}{6}}$.", "\\boxed{\\frac{10}{12}}"),
]
NOT_EQUIVALENT = [
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"),
    ("(1, 2)", "\\boxed{[1,2]}"),
    ("[1, 2)", "\\boxed{(1,2]}"),
    ("2\\sqrt{2}", "\\boxed{2\\sqrt{3}}"),
    ("72", "\\boxed{73}"),
    ("x^2+1", "\\boxed{(x+1)^2}"),
    ("\\{1, 2\\}", "\\boxed{\\{1,2,3\\}}"),
    ("3", "no answer here"),
    ("3", ""),
]


@pytest.mark.parametrize("ref,completion", EQUIVALENT)
def test_math_verify_accepts_equivalent_answers(ref, completion):
    assert math_equal(completion, ref)


@pytest.mark.parametrize("ref,completion", NOT_EQUIVALENT)
def test_math_verify_refuses_different_answers(ref, completion):
    assert not math_equal(completion, ref)


def test_math_in_a_worker_thread_agrees_with_the_main_thread():
    """math-verify's alarm works only in the main thread: another thread gets the same answers (without it)."""
    pairs = EQUIVALENT + NOT_EQUIVALENT
    main = [math_equal(c, r) for r, c in pairs]
    got = []
    t = threading.Thread(target=lambda: got.extend(math_equal(c, r) for r, c in pairs))
    t.start()
    t.join(120)
    assert got == main == [True] * len(EQUIVALENT) + [False] * len(NOT_EQUIVALENT)


def test_math_never_evaluates_the_completion_as_code(tmp_path):
    flag = tmp_path / "evaluated"
    bait = f"__import__('pathlib').Path({str(flag)!r}).touch()"
    for text in (bait, f"<answer>{bait}</answer>", f"\\boxed{{{bait}}}"):
        parse_answer(text)
        math_equal(text, "1")
    assert not flag.exists()


def test_math_task_from_a_file(tmp_path):
    f = tmp_path / "math.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
        {"problem": "Solve x^2 = 2 for x > 0.", "solution": "So $x = \\boxed{\\sqrt{2}}$.", "answer": "\\sqrt{2}"},
    ]) + "\n")
    task = MathTask()
    exs = examples_from_file(str(f), task, prompt_field="problem")
    got = task.rewards(["\\boxed{0.75}", "x = \\boxed{2^{1/2}}"], exs)
    assert got["correct"].tolist() == [1.0, 1.0]
    assert task.rewards(["\\boxed{3/4}", "\\boxed{2}"], exs)["correct"].tolist() == [1.0, 0.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "p", "answer": "\\frac{"}) + "\n")
    with pytest.raises(ConfigError, match="bad.jsonl.* record 1.*dllm.task=math"):
        examples_from_file(str(bad), task, prompt_field="problem")


def test_verify_math_registry_reward_and_gsm8k_keeps_its_numeric_rule():
    _, parts = compute_rewards({"verify_math": 1.0}, ["\\boxed{0.5}", "\\boxed{72}"], ["p", "p"],
                               [{"answer": "\\frac{1}{2}"}, {"answer": "73"}])
    assert parts["verify_math"].tolist() == [1.0, 0.0]
    _, parts = compute_rewards({"verify_gsm8k": 1.0}, ["\\boxed{1/2}", "\\boxed{72.0}"], ["p", "p"],
                               [{"answer": "#### 0.5"}, {"answer": "#### 72"}])
    assert parts["verify_gsm8k"].tolist() == [1.0, 1.0]


def test_shipped_code_set_is_package_data():
    root = Path(diffgrpo.__file__).parent / "prompts" / "code"
    assert (root / "train.jsonl").is_file() and (root / "test.jsonl").is_file()


# ------------------------------------------------------------------------- SIGTERM while the sandboxes run
def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _sandboxes(pid: int) -> list[int]:
    """The descendants of ``pid`` that are sandboxed interpreters (``python -I -S``)."""
    out = []
    for k in _children(pid):
        try:
            argv = Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-I" in argv and b"-S" in argv:
            out.append(k)
    return out


@pytest.mark.slow
def test_a_code_run_stops_in_seconds_on_sigterm_and_resumes_from_the_cli(tmp_path):
    """``diffgrpo train dllm.task=code`` on a tiny remote-code masked LM whose every program sleeps in its setup
    code: SIGTERM while sandboxes run → the sandboxes end at their deadline (dllm.sandbox_timeout), the iteration
    ends, a checkpoint is written and the process exits 143 within seconds, leaving no process behind; the
    resume finishes with exit 0."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers.remote_models import build_remote_model

    model = build_remote_model(tmp_path / "llada", "llada")
    data = tmp_path / "slow.jsonl"
    data.write_text("".join(json.dumps({"text": f"f(1)={a}", "code": f"def f(x):\n    return x+{a - 1}",
                                        "test_list": [f"assert f(2)=={a + 1}"],
                                        "test_setup_code": "import time\ntime.sleep(60)"}) + "\n"
                            for a in range(1, 7)))
    run = tmp_path / "run"
    args = ["model.name=hf_masked_lm", f"dllm.model_path={model}", "dllm.trust_remote_code=true",
            "dllm.mask_token_id=2", "dllm.task=code", f"dllm.data_file={data}", "dllm.prompt_field=text", "dllm.prompt_length=16",
            "dllm.gen_length=8", "dllm.diffusion_steps=4", "dllm.eval_size=2", "dllm.sandbox=local",
            "dllm.sandbox_timeout=2", "dllm.sandbox_workers=2", "train.prompts_per_batch=2", "train.group_size=2",
            "train.num_iterations=3", "train.save_every=1", "eval.every=0", "log.progress=false",
            "log.save_images=false", f"log.output_dir={run}"]
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root + "/src", root]))
    p = subprocess.Popen([sys.executable, "-m", "diffgrpo.cli", "train", *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline, kids = time.time() + 240, []
        while time.time() < deadline and p.poll() is None:  # until a training iteration's sandbox runs
            kids = _sandboxes(p.pid) if (run / "metrics.jsonl").is_file() else []  # after the start evaluation
            if kids:
                break
            time.sleep(0.05)
        assert kids and p.poll() is None, p.communicate()[0][-2000:]
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        text = p.communicate(timeout=60)[0]
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 143, text[-2000:]
    assert took < 20.0, (took, text[-2000:])  # the evaluation's sandboxes (2 s deadlines), then the checkpoint
    assert not [k for k in kids if Path(f"/proc/{k}").exists() and "zombie" not in Path(f"/proc/{k}/status")
                .read_text()]
    assert (run / "checkpoints" / "latest.json").is_file(), text[-2000:]
    done = subprocess.run([sys.executable, "-m", "diffgrpo.cli", "train", "--resume", str(run),
                           "dllm.trust_remote_code=true"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "reward" in r] == [1, 2, 3]  # each once: the interrupted one redone
