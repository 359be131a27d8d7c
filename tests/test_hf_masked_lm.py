"""Hugging Face masked LMs (``diffgrpo.models.hf_masked_lm``) as users point at them: a short pretraining of the
built-in one, remote code that needs ``dllm.trust_remote_code``, a system prompt without a chat template, and
``diffgrpo sample`` of a file task without prompts."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffgrpo.cli.app import main
from tests.helpers.remote_models import build_remote_model


# -------------------------------------------------------- issue 25, found by the user-path matrix: a short pretraining
def test_short_masked_lm_pretraining_runs():  # found by the user-path matrix: pretrain.steps=20 divided by zero
    from diffgrpo import RunConfig
    from diffgrpo.models.hf_masked_lm import pretrain_tiny_mlm
    from diffgrpo.tasks import get_task

    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "pretrain.steps=20", "pretrain.batch_size=8"])
    net = pretrain_tiny_mlm(get_task(cfg.dllm.task), cfg.pretrain, progress=False)
    assert all(torch.isfinite(p).all() for p in net.parameters())


# ----------------------------------------------------------------- issue 25 M-12, M-13: remote code and chat templates
@pytest.fixture(scope="module")
def remote_llada(tmp_path_factory):
    return build_remote_model(tmp_path_factory.mktemp("remote") / "llada", "llada")


def _llada_args(path: Path) -> list[str]:
    return ["model.name=hf_masked_lm", f"dllm.model_path={path}", "dllm.mask_token_id=2", "dllm.task=arithmetic",
            "dllm.prompt_length=16", "dllm.gen_length=8", "dllm.diffusion_steps=8"]


def test_remote_code_without_trust_remote_code_is_one_line_before_loading(remote_llada, monkeypatch):  # M-12
    import transformers

    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model's config was loaded"))
    with pytest.raises(ConfigError) as err:
        RunConfig.from_overrides(_llada_args(remote_llada))
    msg = str(err.value)
    assert msg.startswith("dllm.trust_remote_code: the model in ") and "config.json auto_map" in msg
    assert "set dllm.trust_remote_code=true" in msg and "\n" not in msg
    RunConfig.from_overrides([*_llada_args(remote_llada), "dllm.trust_remote_code=true"])  # accepted with the key


def test_system_prompt_without_a_chat_template_is_refused(remote_llada, tmp_path):  # M-13: refused, not ignored
    import json
    import shutil

    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    plain = tmp_path / "plain"
    shutil.copytree(remote_llada, plain)
    tok = json.loads((plain / "tokenizer_config.json").read_text())
    tok.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tok))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    args = [*_llada_args(plain), "dllm.trust_remote_code=true", "dllm.system_prompt=answer briefly."]
    with pytest.raises(ConfigError, match=r"^dllm\.system_prompt: set, but the tokenizer in .* has no chat template"):
        RunConfig.from_overrides(args)
    with pytest.raises(ConfigError, match=r"^dllm\.system_prompt: set, but dllm\.chat_template=false"):
        RunConfig.from_overrides([*_llada_args(remote_llada), "dllm.trust_remote_code=true",
                                  "dllm.system_prompt=answer briefly.", "dllm.chat_template=false"])
    cfg = RunConfig.from_overrides([*_llada_args(remote_llada), "dllm.trust_remote_code=true",
                                    "dllm.system_prompt=answer briefly."])  # with a template: used
    from diffgrpo.models.hf_masked_lm import load_hf_masked_lm

    policy = load_hf_masked_lm(str(remote_llada), trust_remote_code=True, mask_token_id=2,
                               system_prompt=cfg.dllm.system_prompt)
    assert "answer briefly." in policy.vocab.tok.decode(policy.vocab.prompt_ids("1+2=?"))
    with pytest.raises(ConfigError, match=r"^dllm\.system_prompt: set, but the tokenizer of .* no chat template"):
        load_hf_masked_lm(str(plain), trust_remote_code=True, mask_token_id=2, system_prompt="answer briefly.")


# ----------------------------------------------------------- issue 25, a low one: sampling a file task without prompts
def test_sample_of_a_file_task_without_prompts_is_refused(remote_llada, tmp_path, capsys):
    import json

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}=?", "answer": f"#### {2 * a}"}) + "\n" for a in range(4)))
    args = [*_llada_args(remote_llada), "dllm.trust_remote_code=true", "dllm.task=gsm8k", f"dllm.data_file={data}",
            "dllm.prompt_field=question"]
    assert main(["sample", "--out", str(tmp_path / "s.txt"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --prompt: dllm.task=gsm8k has no built-in test prompts"), err
    assert not (tmp_path / "s.txt").exists()
