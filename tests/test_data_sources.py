"""Prompt data with metadata: text / JSONL / CSV / datasets sources, their one-line errors, metadata reaching the
rewards in training and evaluation, and the seeded epoch sampler (whole groups, every prompt once per epoch,
layouts, resume)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.cli.app import main
from diffgrpo.data_sources import EpochSampler, load_prompts, split_hf_spec
from diffgrpo.distributed import WorldInfo
from diffgrpo.errors import ConfigError
from diffgrpo.flow.family import FlowFamily
from diffgrpo.rewards import REWARDS
from diffgrpo.tasks import TASKS, get_task
from tests.helpers.tiny import FAST_CLI, make_dllm_trainer

HAS_DATASETS = importlib.util.find_spec("datasets") is not None


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _error(fn, *a, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*a, **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------ formats
def test_text_file(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("a cat\n\n  a dog  \n", encoding="utf-8")
    assert load_prompts(str(p)) == [{"prompt": "a cat"}, {"prompt": "a dog"}]


def test_jsonl_keeps_metadata(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a red cube", "color": "red", "count": 1, "tags": ["a"]},
                                      {"prompt": "two cats", "count": 2}])
    (tmp_path / "p.jsonl").write_text(p.read_text() + "\n", encoding="utf-8")  # a trailing blank line is fine
    assert load_prompts(str(p)) == [{"prompt": "a red cube", "color": "red", "count": 1, "tags": ["a"]},
                                    {"prompt": "two cats", "count": 2}]


def test_csv_keeps_metadata_and_named_column(tmp_path):
    p = tmp_path / "p.csv"
    p.write_text('caption,style\n"a cat, sitting",photo\na dog,sketch\n', encoding="utf-8")
    assert load_prompts(str(p), column="caption") == [{"prompt": "a cat, sitting", "style": "photo"},
                                                      {"prompt": "a dog", "style": "sketch"}]


def test_bad_files_are_one_line_errors_naming_the_key(tmp_path):
    missing = str(tmp_path / "none.jsonl")
    assert _error(load_prompts, missing, key="eval.prompts_file") == \
        f"eval.prompts_file: file {missing!r} does not exist"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n', encoding="utf-8")
    assert _error(load_prompts, str(bad)).startswith(f"train.prompts_file: file {str(bad)!r} line 2 is not JSON")
    bad.write_text('["a list"]\n', encoding="utf-8")
    assert "line 1 is a JSON list, not an object" in _error(load_prompts, str(bad))
    bad.write_text('{"text": "a cat"}\n', encoding="utf-8")
    assert "line 1 has no field 'prompt' (fields: text); name the prompt field with train.prompt_column" in \
        _error(load_prompts, str(bad))
    assert "line 1 has no field 'prompt' (fields: text); name the prompt field with dllm.prompt_field" in \
        _error(load_prompts, str(bad), key="dllm.data_file")  # a masked LM's file names its own key
    bad.write_text('{"prompt": 3}\n', encoding="utf-8")
    assert "the prompt 3 is not a non-empty string" in _error(load_prompts, str(bad))
    csvf = tmp_path / "bad.csv"
    csvf.write_text("text,style\na,b\n", encoding="utf-8")
    assert "has no column 'prompt' (columns: text, style)" in _error(load_prompts, str(csvf))
    csvf.write_text("prompt,style\na,b,c\n", encoding="utf-8")
    assert "line 2 has more values than the header has columns" in _error(load_prompts, str(csvf))
    csvf.write_text("prompt,style\n", encoding="utf-8")
    assert _error(load_prompts, str(csvf)) == f"train.prompts_file: file {str(csvf)!r} holds no prompts"
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    assert "is not UTF-8 text (byte 0xe9" in _error(load_prompts, str(latin))


def test_config_validates_prompt_files_before_any_model(tmp_path):
    bad = tmp_path / "p.csv"
    bad.write_text("caption\na cat\n", encoding="utf-8")
    for key in ("train.prompts_file", "eval.prompts_file"):
        msg = _error(RunConfig.from_overrides, [f"{key}={bad}"])
        assert msg.startswith(f"{key}: file {str(bad)!r} has no column 'prompt'"), msg
        RunConfig.from_overrides([f"{key}={bad}", "train.prompt_column=caption"])
    msg = _error(RunConfig.from_overrides, ["model.name=tiny_mlm", "train.prompt_column=caption"])
    assert msg.startswith("train.prompt_column: does not apply to model.name=tiny_mlm"), msg


def test_a_shipped_set_keeps_its_prompt_field_whatever_the_column(tmp_path):
    assert load_prompts("builtin:shapes/test", column="caption") == load_prompts("builtin:shapes/test")
    own = tmp_path / "p.csv"
    own.write_text("caption\na cat\n", encoding="utf-8")
    cfg = RunConfig.from_overrides(["train.task=shapes", f"train.prompts_file={own}", "train.prompt_column=caption"])
    assert cfg.eval.prompts_file == "builtin:shapes/test"  # the task's held-out prompts, read as shipped


def test_hf_spec_syntax():
    assert split_hf_spec("hf:org/name") == ("org/name", None, "train")
    assert split_hf_spec("hf:org/name:test") == ("org/name", None, "test")
    assert split_hf_spec("hf:json:/d/p.json") == ("json", "/d/p.json", "train")
    assert split_hf_spec("hf:json:/d/p.json:validation") == ("json", "/d/p.json", "validation")
    assert split_hf_spec("hf:json:p") == ("json", "p", "train")


@pytest.mark.skipif(HAS_DATASETS, reason="the datasets package is installed")
def test_hf_spec_without_datasets_names_the_package():
    assert _error(load_prompts, "hf:org/name", key="eval.prompts_file") == \
        "eval.prompts_file: 'hf:org/name' needs the datasets package (pip install datasets)"


@pytest.mark.skipif(not HAS_DATASETS, reason="needs the datasets package")
def test_hf_json_spec(tmp_path):
    p = _jsonl(tmp_path / "d.json", [{"caption": "a cat", "k": 1}, {"caption": "a dog", "k": 2}])
    assert load_prompts(f"hf:json:{p}", column="caption") == [{"prompt": "a cat", "k": 1}, {"prompt": "a dog", "k": 2}]


# ------------------------------------------------------------------------------------------ metadata → rewards
@pytest.fixture
def recording_reward(monkeypatch):
    seen = []

    def record(images, prompts, metadata):
        seen.append((list(prompts), [dict(m) for m in metadata]))
        return torch.zeros(len(prompts)) + torch.arange(len(prompts)) % 2

    monkeypatch.setitem(REWARDS, "record_metadata", record)
    return seen


def test_jsonl_metadata_reaches_the_rewards(tmp_path, make_trainer, recording_reward):
    rows = [{"prompt": f"a shape {i}", "shape": s, "id": i} for i, s in enumerate(["cube", "ball", "cone"])]
    p = _jsonl(tmp_path / "p.jsonl", rows)
    tr = make_trainer(f"train.prompts_file={p}", f"eval.prompts_file={p}", "eval.seeds_per_prompt=1",
                      "reward.weights={record_metadata: 1.0}")
    ro = tr.family.rollout()
    prompts, meta = recording_reward[-1]
    assert prompts == ro.prompts and meta == ro.metadata and len(meta) == 6
    by_prompt = {r["prompt"]: r for r in rows}
    for q, m in zip(prompts, meta):
        assert m == {"digit": int(q[-1]), "shape": by_prompt[q]["shape"], "id": by_prompt[q]["id"]}
    tr.family.evaluate()
    prompts, meta = recording_reward[-1]
    assert prompts == [r["prompt"] for r in rows]
    assert meta == [{"digit": r["id"], "shape": r["shape"], "id": r["id"]} for r in rows]


def test_digit_prompts_keep_their_metadata(make_trainer, recording_reward):
    tr = make_trainer("reward.weights={record_metadata: 1.0}")
    tr.family.rollout()
    prompts, meta = recording_reward[-1]
    assert meta == [{"digit": int(q[-1])} for q in prompts]


# ------------------------------------------------------------------------------------------ the epoch sampler
def test_epoch_sampler_every_prompt_once_per_epoch_and_seeded():
    s = EpochSampler(7, seed=3)
    drawn = s.take(4) + s.take(4) + s.take(6)  # crosses the epoch boundary mid-batch
    assert sorted(drawn[:7]) == list(range(7)) and sorted(drawn[7:]) == list(range(7))
    assert drawn[:7] != drawn[7:]  # a fresh permutation each epoch
    assert s.state() == {"epoch": 2, "index": 0}
    again = EpochSampler(7, seed=3)
    assert again.take(14) == drawn
    assert EpochSampler(7, seed=4).take(14) != drawn
    r = EpochSampler(7, seed=3)
    r.set_state({"epoch": 1, "index": 1})
    assert r.take(6) == drawn[8:]


def _family(tr, rank: int, world: int, layout: str) -> FlowFamily:
    tr.cfg.dist.group_layout = layout
    return FlowFamily(tr.cfg, tr.policy, WorldInfo(rank, world, rank))


def test_batches_keep_groups_whole_and_cover_the_file_across_ranks(tmp_path, make_trainer):
    p = tmp_path / "p.txt"
    p.write_text("".join(f"prompt {i}\n" for i in range(8)), encoding="utf-8")
    tr = make_trainer(f"train.prompts_file={p}", "train.prompts_per_batch=4", "train.group_size=2")
    # local layout: rank r takes its P/W slice of each batch; two batches are one epoch over both ranks
    fams = [_family(tr, r, 2, "local") for r in range(2)]
    seen = []
    for _ in range(2):
        for f in fams:
            prompts, gids, meta = f.sample_prompts()
            assert len(prompts) == 4 and gids.tolist() == [0, 0, 1, 1]
            assert prompts[0] == prompts[1] and prompts[2] == prompts[3]  # groups whole
            seen += prompts[::2]
    assert sorted(seen) == sorted(f"prompt {i}" for i in range(8))
    # spread layout: every rank plans the same whole batch and keeps its share of every group
    fams = [_family(tr, r, 2, "spread") for r in range(2)]
    plans = [f.plan() for f in fams]
    assert plans[0].prompts == plans[1].prompts and len(plans[0].prompts) == 4
    assert Counter(plans[0].prompts + plans[1].prompts) == Counter({q: 2 for q in set(plans[0].prompts)})
    assert [m["digit"] for m in plans[0].metadata] == [int(q[-1]) for q in plans[0].prompts]


def test_resumed_run_draws_the_same_next_prompts(tmp_path, make_trainer, recording_reward):
    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"item {i}", "i": i} for i in range(5)])
    common = [f"train.prompts_file={p}", "reward.weights={record_metadata: 1.0}", "eval.every=0",
              "eval.seeds_per_prompt=1", "train.save_every=2"]

    def train_prompts(*overrides, resume=False):
        recording_reward.clear()
        make_trainer(*common, *overrides).train(resume=resume)
        return [q for q, _ in recording_reward if len(q) == 6]  # training batches (evaluation: 10 digit prompts)

    full = train_prompts("train.num_iterations=4", f"log.output_dir={tmp_path / 'full'}")
    first = train_prompts("train.num_iterations=2", f"log.output_dir={tmp_path / 'cut'}")
    rest = train_prompts("train.num_iterations=4", f"log.output_dir={tmp_path / 'cut'}", resume=True)
    assert len(full) == 4 and first == full[:2] and rest == full[2:]
    # 4 batches of 2 prompts over 5 records: the first 5 draws are one epoch
    draws = [q for batch in full for q in batch[::3]]
    assert sorted(draws[:5]) == [f"item {i}" for i in range(5)]


# ------------------------------------------------------------------------------------------ dLLM data files
def test_dllm_tasks_build_verified_examples_from_prompt_and_answer():
    for name in TASKS:
        task = get_task(name)
        for ex in task.instances("train")[:5]:
            made = task.example(ex.prompt, ex.answer)
            assert made.meta == ex.meta and task.reward(ex.answer, made)["correct"] == 1.0


def test_dllm_data_file_replaces_the_train_split(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "<answer>2</answer>", "source": "x"}, {"prompt": "3-5=", "answer": "<answer>-2</answer>"}]
    p = _jsonl(tmp_path / "d.jsonl", rows)
    tr = make_dllm_trainer(f"dllm.data_file={p}")
    ex, gids = tr.family.examples()
    assert {e.prompt for e in ex} <= {"1+1=", "3-5="} and len(ex) == 8 and gids.tolist() == [0] * 4 + [1] * 4
    assert [ex[0].meta] == [{"target": int(ex[0].answer[8:-9])}]
    ro = tr.family.rollout()
    assert set(ro.prompts) <= {"1+1=", "3-5="} and torch.isfinite(ro.rewards).all()


def test_dllm_data_file_errors_name_the_key(tmp_path):
    bad = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "<answer>3</answer>"}])
    msg = _error(RunConfig.from_overrides, ["model.name=tiny_mlm", f"dllm.data_file={bad}"])
    assert msg.startswith(f"dllm.data_file: file {str(bad)!r} record 1: the answer '<answer>3</answer>' does not "
                          "pass the dllm.task=arithmetic verifier"), msg
    _jsonl(bad, [{"prompt": "1+1="}])
    assert "record 1 has no non-empty string field 'answer'" in \
        _error(RunConfig.from_overrides, ["model.name=tiny_mlm", f"dllm.data_file={bad}"])
    _jsonl(bad, [{"prompt": "one plus one", "answer": "<answer>2</answer>"}])
    assert "record 1 is not a dllm.task=arithmetic instance (prompt 'one plus one' is not an integer expression" in \
        _error(RunConfig.from_overrides, ["model.name=tiny_mlm", f"dllm.data_file={bad}"])
    _jsonl(bad, [{"prompt": "100000+1=", "answer": "<answer>100001</answer>"}])
    assert "has 9 tokens; the built-in tiny_mlm for dllm.task=arithmetic reads at most 6" in \
        _error(RunConfig.from_overrides, ["model.name=tiny_mlm", f"dllm.data_file={bad}"])
    txt = tmp_path / "d.txt"
    txt.write_text("1+1=\n", encoding="utf-8")
    assert "is not a .jsonl file" in _error(RunConfig.from_overrides, ["model.name=tiny_mlm", f"dllm.data_file={txt}"])


# ------------------------------------------------------------------------------------------- shipped prompt sets
def test_shipped_prompt_sets_load_by_name_with_their_metadata():
    from diffgrpo.data_sources import builtin_sets

    assert builtin_sets() == ["code/test", "code/train", "edit/test", "edit/train", "geneval/test", "geneval/train",
                              "ocr/test", "ocr/train", "preference/test",
                              "preference/train", "shapes/test", "shapes/train", "shapes_video/test",
                              "shapes_video/train"]  # code/: MBPP records (dllm.task=code)
    sets = {n: load_prompts(f"builtin:{n}") for n in builtin_sets() if not n.startswith("code/")}
    for name in ("geneval", "ocr", "preference", "shapes"):  # train and test never share a prompt
        assert not {r["prompt"] for r in sets[f"{name}/train"]} & {r["prompt"] for r in sets[f"{name}/test"]}
    edits = {split: sets[f"edit/{split}"] for split in ("train", "test")}  # (instruction, source image) records
    assert all(set(r) == {"prompt", "image"} and Path(r["image"]).is_file() for v in edits.values() for r in v)
    assert not {r["image"] for r in edits["train"]} & {r["image"] for r in edits["test"]}  # unseen test sources
    pref = sets["preference/train"] + sets["preference/test"]
    assert len(pref) >= 200 and len({r["prompt"] for r in pref}) == len(pref)
    assert all(set(r) == {"prompt"} for r in pref)
    for r in sets["ocr/train"] + sets["ocr/test"]:  # the target text is metadata and appears quoted in the prompt
        assert set(r) == {"prompt", "text"} and f'"{r["text"]}"' in r["prompt"]
    tags = {"single_object", "two_object", "counting", "colors", "color_attr", "position"}
    for split in ("train", "test"):
        recs = sets[f"geneval/{split}"]
        assert {r["tag"] for r in recs} == tags
        for r in recs:  # GenEval's metadata format
            assert r["include"] and all(isinstance(o["class"], str) and o["count"] >= 1 for o in r["include"])
            assert all(o["class"] in r["prompt"] for o in r["include"])
            if r["tag"] == "counting":
                assert r["exclude"] == [{"class": r["include"][0]["class"], "count": r["include"][0]["count"] + 1}]
            if r["tag"] in ("colors", "color_attr"):
                assert all(o["color"] in r["prompt"] for o in r["include"])
            if r["tag"] == "position":
                rel, ref = r["include"][1]["position"]
                assert ref == 0 and f" {rel} " in r["prompt"]


def test_unknown_shipped_set_is_one_line_listing_the_sets():
    with pytest.raises(ConfigError) as e:
        load_prompts("builtin:ocr/validation", key="eval.prompts_file")
    msg = str(e.value)
    assert msg.startswith("eval.prompts_file: 'builtin:ocr/validation'") and "builtin:ocr/test" in msg
    assert "\n" not in msg


def test_shipped_prompt_files_are_package_data():
    """Every shipped prompt file matches a package-data pattern of pyproject.toml, so a wheel carries it."""
    import fnmatch
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["diffgrpo"]
    pkg = root / "src" / "diffgrpo"
    files = [f.relative_to(pkg).as_posix() for f in (pkg / "prompts").rglob("*")
             if f.suffix in (".txt", ".jsonl", ".md", ".png")]  # .png: the editing set's sources
    assert len(files) == 23 and all(any(fnmatch.fnmatch(f, p) for p in patterns) for f in files)


# ---------------------------------------------------------------- issue 25 H-3: prompt files moved or edited on resume
def test_prompts_file_is_pinned_by_absolute_path_and_content(tmp_path, monkeypatch, capsys):
    first, second = tmp_path / "a", tmp_path / "b"
    for d in (first, second):
        d.mkdir()
        (d / "prompts.txt").write_text("a handwritten digit 3\na handwritten digit 4\n" if d is first
                                       else "a handwritten digit 8\n")
    out = tmp_path / "run"
    monkeypatch.chdir(first)
    assert main(["train", *FAST_CLI, "train.num_iterations=1", "train.save_every=1", "train.prompts_file=prompts.txt",
                 f"log.output_dir={out}"]) == 0
    saved = (out / "config.yaml").read_text()
    assert f"prompts_file: {first / 'prompts.txt'}" in saved
    monkeypatch.chdir(second)  # a resume from elsewhere reads the run's own file, not ./prompts.txt
    assert main(["train", "--resume", str(out), "train.num_iterations=2"]) == 0
    assert f"prompts_file: {first / 'prompts.txt'}" in (out / "config.yaml").read_text()
    (first / "prompts.txt").write_text("a handwritten digit 9\n")
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "train.num_iterations=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.prompts_file: ") and "changed since the run started" in err[0]


# ----------------------------------------------------------------- issue 25 M-1, M-2: prompt lines that cannot be read
def test_jsonl_prompt_may_hold_a_raw_line_separator(tmp_path):  # M-1 (and the text-file split, low)
    from diffgrpo.data_sources import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a handwritten\\u2028 digit 3"}\n'.replace("\\u2028", "\u2028"), encoding="utf-8")
    assert load_prompts(str(f)) == [{"prompt": "a handwritten\u2028 digit 3"}]
    t = tmp_path / "p.txt"
    t.write_text("one\u2028two\nthree\n", encoding="utf-8")
    assert [r["prompt"] for r in load_prompts(str(t))] == ["one\u2028two", "three"]


@pytest.mark.parametrize("line, why", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                       ('{"prompt": "x", "n": ' + "7" * 5000 + "}", "Exceeds the limit")])
def test_unparseable_prompt_lines_are_one_line_errors(tmp_path, line, why):  # M-2
    from diffgrpo.data_sources import load_prompts
    from diffgrpo.errors import ConfigError

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError) as err:
        load_prompts(str(f))
    assert str(err.value).startswith(f"train.prompts_file: file {str(f)!r} line 2 cannot be read") and why in str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_deep_nesting_through_hf_json_is_one_line_not_a_crash(tmp_path):  # M-2, through datasets
    """pyarrow's JSON reader segfaulted on 100k-deep nesting; the file is refused in one line first, in a child
    process (a crash would kill it, not the test run). Brackets inside strings do not count."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"prompt": "a", "x": ' + "[" * 100000 + "]" * 100000 + "}\n")
    fine = tmp_path / "fine.jsonl"
    fine.write_text(json.dumps({"prompt": "a " + "[" * 5000 + ' \\" ['}) + "\n")
    code = ("import sys\nfrom diffgrpo.data_sources import load_prompts\nfrom diffgrpo.errors import ConfigError\n"
            "try:\n    print(len(load_prompts('hf:json:' + sys.argv[1])))\n"
            "except ConfigError as e:\n    print('ConfigError', e)\n")
    for f, want in ((deep, "ConfigError train.prompts_file: file"), (fine, "1")):
        out = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 0, (out.returncode, out.stderr[-500:])
        assert out.stdout.strip().startswith(want), out.stdout
        assert f is fine or "nested more than 1000 deep" in out.stdout


# ----------------------------------------------------- issue 25, low ones (item 4): CSV columns, odd files, huge files
@pytest.mark.parametrize("text, why", [("prompt,a,a\nx,1,2\n", "names the column(s) ['a'] more than once"),
                                       ("prompt,a,b\nx,1\n", "line 2 has fewer values than the header has columns")])
def test_csv_duplicate_columns_and_short_rows_are_refused(tmp_path, text, why):
    from diffgrpo.data_sources import load_prompts
    from diffgrpo.errors import ConfigError

    f = tmp_path / "p.csv"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_prompts(str(f))
    assert why in str(err.value) and str(err.value).startswith("train.prompts_file: ")


def test_one_liners_say_what_is_wrong(tmp_path):
    from diffgrpo.data_sources import load_prompts
    from diffgrpo.errors import ConfigError

    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    for spec, why in ((str(fifo), "is not a regular file"), (str(tmp_path), "is not a regular file"),
                      ("builtin:", "names no prompt set; write builtin:<set>/<split>"),
                      (str(tmp_path / "none.txt"), "does not exist")):
        with pytest.raises(ConfigError, match=why):
            load_prompts(spec)


def test_a_huge_prompt_file_fails_in_one_line_without_reading_it(tmp_path, monkeypatch):
    from diffgrpo import data_sources
    from diffgrpo.errors import ConfigError

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 6 GB on paper, nothing on disk
        f.truncate(6 * 10 ** 9)
    monkeypatch.setattr(data_sources, "read_utf8", lambda *a: pytest.fail("the file was read"))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        data_sources.load_prompts(str(big))
    assert time.perf_counter() - t0 < 1 and "5.6 GiB; a prompt file may hold at most 1024 MiB" in str(err.value)
