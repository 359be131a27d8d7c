"""Verifiable-reward tasks for dLLMs: hand-written correct, wrong and malformed completions; splits; vocabulary."""
from __future__ import annotations

import pytest
import torch

from diffgrpo.tasks import (
    TASKS,
    VOCAB,
    Example,
    all_sudoku_grids,
    count_solutions,
    get_task,
    schema_from_spec,
)


def test_vocab_roundtrip_and_specials():
    text = "<answer>12+7</answer>"
    ids = VOCAB.encode(text)
    assert len(ids) == 2 + 4  # tags are single tokens
    assert VOCAB.decode(ids) == text
    assert VOCAB.decode(ids + [VOCAB.eos_id, VOCAB.index["1"]]) == text  # stops at eos
    p = VOCAB.encode_prompts(["1+2="], 6)
    assert p[0, :2].tolist() == [VOCAB.pad_id] * 2 and VOCAB.decode(p[0]) == "1+2="
    c = VOCAB.encode_completions(["ab"], 4)
    assert c[0].tolist()[2:] == [VOCAB.eos_id] * 2
    with pytest.raises(ValueError):
        VOCAB.encode("é")
    assert len({VOCAB.pad_id, VOCAB.mask_id, VOCAB.eos_id}) == 3


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_disjoint_reference_answers_correct_and_fit(name):
    task = get_task(name)
    tr, te = task.instances("train"), task.instances("test")
    assert len(tr) > 50 and len(te) > 10
    assert not ({e.prompt for e in tr} & {e.prompt for e in te})
    for e in tr[:50] + te[:50]:
        r = task.reward(e.answer, e)
        assert r["correct"] == 1.0 and r["reward"] == pytest.approx(1.0)
        assert len(VOCAB.encode(e.prompt)) <= task.prompt_length
        assert len(VOCAB.encode(e.answer)) <= task.gen_length
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [e.prompt for e in task.sample("train", 8, g1)] == [e.prompt for e in task.sample("train", 8, g2)]


def test_arithmetic_rewards():
    t = get_task("arithmetic")
    ex = Example("12+7=", "<answer>19</answer>", {"target": 19})
    assert t.reward("<answer>19</answer>", ex) == {"reward": 1.0, "format": 1.0, "correct": 1.0}
    assert t.reward(" <answer> 19 </answer> ", ex)["correct"] == 1.0
    assert t.reward("<answer>18</answer>", ex) == {"reward": pytest.approx(0.1), "format": 1.0, "correct": 0.0}
    for bad in ["19", "<answer>19", "<answer>19</answer>x", "<answer>1 9</answer>", "<answer></answer>",
                "<answer><answer>19</answer>", "", "<answer>19</answer><answer>19</answer>"]:
        assert t.reward(bad, ex)["reward"] == 0.0, bad
    neg = Example("3-5=", "<answer>-2</answer>", {"target": -2})
    assert t.reward("<answer>-2</answer>", neg)["correct"] == 1.0


def test_sudoku_uniqueness_split_by_solution_and_rewards():
    grids = all_sudoku_grids()
    assert len(grids) == 288 and len(set(grids)) == 288
    t = get_task("sudoku")
    tr_sol = {e.meta["solution"] for e in t.instances("train")}
    te_sol = {e.meta["solution"] for e in t.instances("test")}
    assert not (tr_sol & te_sol)
    for e in t.instances("test")[:30]:
        assert count_solutions([0 if c == "." else int(c) for c in e.prompt]) == 1
    ex = Example("12..341221434.21", "1234341221434321", {"solution": "1234341221434321"})
    assert ex.prompt.count(".") == 3
    assert t.reward("1234341221434321", ex)["reward"] == 1.0
    # one blank wrong (position 2 '3' -> '4'): 2/3 cells right, not solved
    r = t.reward("1244341221434321", ex)
    assert r["cell_accuracy"] == pytest.approx(2 / 3) and r["correct"] == 0.0
    assert r["reward"] == pytest.approx(0.5 * 2 / 3)
    # violates a given (solved grid must keep the givens): givens are not scored as cells, but not solved
    r = t.reward("4321123434122143", ex)
    assert r["correct"] == 0.0
    # malformed: short, letters, empty
    assert t.reward("12", ex)["reward"] == 0.0
    assert t.reward("", ex)["reward"] == 0.0
    assert t.reward("12ab341221434321", ex)["correct"] == 0.0


def test_countdown_rewards():
    t = get_task("countdown")
    ex = Example("2,3,5:13", "", {"numbers": [2, 3, 5], "target": 13})
    assert t.reward("<answer>2*5+3</answer>", ex)["reward"] == 1.0
    assert t.reward("<answer>(2+3)*5-12</answer>", ex)["reward"] == pytest.approx(0.1)  # uses 12: wrong numbers
    assert t.reward("<answer>2+3+5</answer>", ex)["reward"] == pytest.approx(0.1)  # wrong value
    assert t.reward("<answer>2*5+3+3</answer>", ex)["reward"] == pytest.approx(0.1)  # 3 used twice
    assert t.reward("<answer>13</answer>", ex)["reward"] == pytest.approx(0.1)
    for bad in ["2*5+3", "<answer>2*5+</answer>", "<answer>2**5</answer>", "<answer>a+b</answer>",
                "<answer>5/(3-3)+2</answer>", "<answer>2*5+3", ""]:
        assert t.reward(bad, ex)["reward"] == 0.0, bad
    ex2 = Example("2,4,6:3", "", {"numbers": [2, 4, 6], "target": 3})
    assert t.reward("<answer>6/2*4/4</answer>", ex2)["reward"] == pytest.approx(0.1)  # four numbers
    assert t.reward("<answer>6/(4-2)</answer>", ex2)["reward"] == 1.0


def test_json_schema_rewards():
    t = get_task("json_schema")
    spec = "a:int,b:str,c:bool"
    ex = Example(spec, "", {"schema": schema_from_spec(spec)})
    assert t.reward('{"a":3,"b":"x","c":true}', ex) == {"reward": 1.0, "errors": 0.0, "correct": 1.0}
    assert t.reward('{"a":"3","b":"x","c":true}', ex)["reward"] == pytest.approx(0.5)  # one type error
    assert t.reward('{"a":true,"b":1}', ex)["reward"] == pytest.approx(1 / 4)  # 2 type errors + missing c
    assert t.reward('{"a":3,"b":"x","c":true,"d":1}', ex)["reward"] == pytest.approx(0.5)  # additional property
    assert t.reward("[1,2]", ex)["reward"] == pytest.approx(0.5)  # wrong top-level type
    for bad in ['{"a":3,', "", "{a:3}", "<answer>{}</answer>"]:
        assert t.reward(bad, ex)["reward"] == 0.0, bad


@pytest.mark.parametrize("name", list(TASKS))
def test_slips_are_wrong_answers_in_the_right_format(name):
    """pretrain.answer_noise's slips: every one is scored wrong, yet well formed (a number or an expression of the
    right numbers in tags, a valid grid, valid JSON with one type error), and fits the completion length."""
    from diffgrpo.tasks.generated import _valid_grid

    task = get_task(name)
    for ex in task.instances("train") + task.instances("test"):
        s = task.slip(ex)
        r = task.reward(s, ex)
        assert r["correct"] == 0.0
        assert len(VOCAB.encode(s)) <= task.gen_length
        if name in ("arithmetic", "countdown"):
            assert r["format"] == 1.0
        elif name == "sudoku":
            assert _valid_grid([int(c) for c in s])  # a valid grid that contradicts the givens
        else:
            assert r["errors"] == 1.0  # valid JSON, one type error


def test_answer_noise_changes_the_pretraining_recipe_only_when_on():
    from dataclasses import replace

    from diffgrpo.config import PretrainConfig
    from diffgrpo.models.hf_masked_lm import TINY_ARCH, _recipe_key

    clean = replace(PretrainConfig(), answer_noise=0.0)
    keys = {_recipe_key("arithmetic", TINY_ARCH, replace(clean, answer_noise=a)) for a in (0.0, 0.2, 0.4)}
    assert len(keys) == 3
    # a clean recipe's key does not mention the noise, so clean models cached before the knob stay valid
    import hashlib
    import json
    blob = json.dumps({"task": "arithmetic", "arch": TINY_ARCH, "steps": clean.steps, "bs": clean.batch_size,
                       "lr": clean.lr, "seed": clean.seed, "kind": "mdm", "v": 1}, sort_keys=True)
    assert _recipe_key("arithmetic", TINY_ARCH, clean) == hashlib.sha256(blob.encode()).hexdigest()[:12]
