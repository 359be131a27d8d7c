"""Block-diffusion LMs on every verifiable task: ``diffgrpo train`` of the built-in block model (``model.name=tiny_block``)
on each built-in task, and of the remote-code block model (``hf_masked_lm``, ``dllm.trust_remote_code``) on MATH
through math-verify, runs to the end from the command line; every rollout and evaluation is a block rollout (the
completion starts at a block boundary, the exact cache of finished blocks decodes it: an uncached replay from the same
random state gives the same tokens) and the task's own verifier scored exactly those completions."""
from __future__ import annotations

import json
import math

import pytest
import torch

from diffgrpo.models.block_cache import BlockKVCache
from diffgrpo.models.tiny_block import TINY_BLOCK_SIZE, block_prompt_length
from diffgrpo.samplers import block
from diffgrpo.tasks import get_task

SMALL_RUN = ["train.num_iterations=1", "train.prompts_per_batch=2", "train.group_size=2", "dllm.eval_size=2",
             "dllm.temperature=1.0", "log.progress=false", "log.save_images=false", "model.device=cpu"]
# the components each verifier reports besides reward / correct (pinned: a task scored by another verifier fails)
TASK_COMPONENTS = {"arithmetic": {"format"}, "sudoku": {"cell_accuracy"}, "countdown": {"format"},
                   "json_schema": {"errors"}, "code_toy": {"format", "sandbox_infra_failures"}, "math": set()}


class Spy:
    """Records every block rollout (its arguments, the decoded completions) and replays the first sampled one
    (temperature > 0) without the cache from the same random state; records every call of the task's verifier."""

    def __init__(self, monkeypatch, task_cls):
        self.calls, self.decoded, self.scored, self.replays = [], [], [], []
        orig, orig_rewards = block.sample_blocks, task_cls.rewards

        def sample_blocks(policy, ids, **kw):
            g = kw.get("generator")
            state = None if g is None else g.get_state()
            out = orig(policy, ids, **kw)
            if not self.replays and kw["temperature"] > 0:  # the same draws without the cache of finished blocks
                g2 = None if g is None else torch.Generator(device=g.device).set_state(state)
                self.replays.append((out, orig(policy, ids, **{**kw, "cache": None, "generator": g2})))
            self.calls.append((policy.block_size, ids.shape[1], kw))
            self.decoded.append([policy.vocab.decode(c) for c in out.completions])
            return out

        def rewards(task, texts, examples):
            got = orig_rewards(task, texts, examples)
            self.scored.append((list(texts), dict(got)))  # the caller pops from its dict
            return got

        monkeypatch.setattr(block, "sample_blocks", sample_blocks)
        monkeypatch.setattr(task_cls, "rewards", rewards)

    def check(self, task, prompt_length: int, gen_length: int, block_size: int = TINY_BLOCK_SIZE):
        assert len(self.calls) >= 3  # the evaluation at the start, one rollout, the evaluation at the end
        for b, P, kw in self.calls:
            assert b == block_size and kw["block_length"] == block_size
            assert P == prompt_length and P % block_size == 0  # the completion starts at a block boundary
            assert kw["gen_length"] == gen_length and gen_length % block_size == 0
            assert isinstance(kw["cache"], BlockKVCache)
        cached, plain = self.replays[0]
        assert torch.equal(cached.sequences, plain.sequences) and torch.equal(cached.commit_step, plain.commit_step)
        assert cached.query_tokens < plain.query_tokens  # the cache computed only the open blocks
        assert len(self.scored) == len(self.calls)  # every rollout and evaluation scored
        for texts, got in self.scored:
            assert texts in self.decoded  # the verifier saw the block completions themselves
            assert {"reward", "correct"} | TASK_COMPONENTS[task] <= set(got)
            for k, v in got.items():
                assert v.shape == (len(texts),) and bool(torch.isfinite(v).all()), (k, v)


def metrics(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["iteration"] for r in trained] == [1] and [r["iteration"] for r in evals] == [0, 1]
    return trained[0], evals


@pytest.mark.parametrize("task", ["arithmetic", "sudoku", "countdown", "json_schema", "code_toy"])
def test_tiny_block_trains_on_each_built_in_task_from_the_command_line(task, tmp_path, monkeypatch):
    from diffgrpo.cli.app import main
    from diffgrpo.sandbox import SandboxPool

    code = task == "code_toy"
    ran = []
    if code:  # the programs the sandbox ran
        run_many = SandboxPool.run_many
        monkeypatch.setattr(SandboxPool, "run_many", lambda pool, programs: ran.extend(programs)
                            or run_many(pool, programs))
    spy = Spy(monkeypatch, type(get_task(task)))
    run = tmp_path / "run"
    # code_toy: pretrained long enough that completions are well formed, so their programs reach the sandbox
    pre = ["pretrain.steps=60", "pretrain.batch_size=16", "dllm.sandbox=local", "dllm.sandbox_workers=2"] if code \
        else ["pretrain.steps=4", "pretrain.batch_size=4"]
    assert main(["train", "model.name=tiny_block", f"dllm.task={task}", *pre, *SMALL_RUN,
                 f"model.cache_dir={tmp_path / 'c'}", f"log.output_dir={run}"]) == 0
    t = get_task(task)
    spy.check(task, block_prompt_length(t.prompt_length, TINY_BLOCK_SIZE), t.gen_length)
    row, evals = metrics(run)
    keys = {"reward", "rewards/task/mean", "rewards/correct/mean"} | {f"rewards/{k}/mean" for k in TASK_COMPONENTS[task]}
    for r, prefix in [(row, "")] + [(e, "eval/") for e in evals]:
        for k in keys:
            assert math.isfinite(r[prefix + k]), (prefix + k, r)
    if code:
        assert ran and row["rewards/format/mean"] > 0  # well-formed answers were run, none failed to run
        assert row["rewards/sandbox_infra_failures/mean"] == 0.0


def test_remote_block_model_trains_on_math_through_math_verify(tmp_path, monkeypatch):
    """dllm.task=math on the remote-code block model: the task's verifier and the ``verify_math`` reward (both
    math-verify) score the block completions; the verifier passes the file's reference answers."""
    from diffgrpo.cli.app import main
    from diffgrpo.models.remote_block import write_block_model
    from diffgrpo.tasks.competition_math import MathTask
    from diffgrpo.tasks.registry import examples_from_file
    from tests.helpers.remote_models import char_tokenizer

    tok = char_tokenizer(mask_token=True)
    model = write_block_model(tmp_path / "model", tokenizer=tok, seed=0, vocab_size=len(tok), block_size=4,
                              initializer_range=0.3, mask_token_id=tok.mask_token_id, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id)
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"problem": "what is 1+2?", "answer": "\\boxed{3}"},
        {"problem": "what is 12-5?", "solution": "so $x = \\boxed{7}$.", "answer": "7"},
        {"problem": "solve x+x=1 for x.", "answer": "\\frac{1}{2}"}]))
    exs = examples_from_file(str(data), MathTask(), prompt_field="problem")
    assert MathTask().rewards([e.answer for e in exs], exs)["correct"].tolist() == [1.0] * 3
    spy = Spy(monkeypatch, MathTask)
    run = tmp_path / "run"
    assert main(["train", "model.name=hf_masked_lm", f"dllm.model_path={model}", "dllm.trust_remote_code=true",
                 "dllm.task=math", f"dllm.data_file={data}", "dllm.prompt_field=problem", "dllm.prompt_length=14",
                 "dllm.gen_length=8", "reward.weights={task: 1.0, verify_math: 1.0}", *SMALL_RUN,
                 f"log.output_dir={run}"]) == 0
    spy.check("math", 16, 8)  # the prompt rounded up to the model's block
    row, evals = metrics(run)
    for r, prefix in [(row, "")] + [(e, "eval/") for e in evals]:
        for k in ("reward", "rewards/task/mean", "rewards/correct/mean", "rewards/verify_math/mean"):
            assert math.isfinite(r[prefix + k]), (prefix + k, r)
