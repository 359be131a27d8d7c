"""The export's model card: huggingface_hub's ModelCard parses it, its front matter names the base model, library,
tags and license, and its load snippet, run as written, loads the exported folder with the trained weights; the
built-in image model's card says what else sampling needs, and that names real diffgrpo objects."""
from __future__ import annotations

import re

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.cli.app import main


def _card(folder):
    from huggingface_hub import ModelCard

    return ModelCard.load(folder / "README.md")


def _run_snippet(card, folder) -> dict:
    """The card's python block, run with its folder placeholder set to ``folder``: → its variables."""
    from diffgrpo.cli.model_card import PLACEHOLDER

    blocks = re.findall(r"```python\n(.*?)```", card.text, flags=re.S)
    assert len(blocks) == 1, card.text
    assert PLACEHOLDER in blocks[0]
    scope: dict = {}
    exec(blocks[0].replace(PLACEHOLDER, str(folder)), scope)  # noqa: S102 - the card's own code, on a local folder
    return scope


def test_the_builtin_image_model_card_loads_its_transformer_and_names_what_else_it_needs(make_trainer, tmp_path):
    tr = make_trainer(f"log.output_dir={tmp_path / 'run'}", "engine.name=recompute")
    tr.step()
    tr.save_checkpoint()
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    card = _card(out)
    assert card.data.library_name == "diffusers" and card.data.base_model is None
    assert card.data.tags == ["diffgrpo", "grpo", "recompute", "flow-matching"]
    assert card.data.license == "apache-2.0"
    assert "| iterations | 1 " in card.text
    transformer = _run_snippet(card, out)["transformer"]  # diffusers alone loads the transformer
    live = dict(tr.policy.transformer.named_parameters())
    for n, p in transformer.named_parameters():
        assert torch.equal(p, live[n].detach()), n
    # what the card says sampling needs besides: diffgrpo's own prompt encoder and pixel decoder
    import diffgrpo.models.tiny as tiny

    for name in re.findall(r"`diffgrpo\.models\.tiny\.(\w+)`", card.text):
        assert hasattr(tiny, name), name
    assert {"PromptEncoder", "VOCAB", "decode_pixels"} <= set(re.findall(r"`diffgrpo\.models\.tiny\.(\w+)`", card.text))
    assert "not a diffusers pipeline" in card.text and "diffgrpo sample --weights" in card.text


def test_the_masked_lm_card_loads_the_trained_model(tmp_path):
    from diffgrpo import Trainer
    from diffgrpo.models.hf_masked_lm import build_tiny_mlm_policy

    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "dllm.method=spg", "log.progress=false",
                                    f"log.output_dir={tmp_path / 'run'}"])
    torch.manual_seed(0)
    tr = Trainer(cfg, policy=build_tiny_mlm_policy(cfg, progress=False, pretrained=False), log=lambda *a: None)
    with torch.no_grad():
        for p in tr.params:  # trained weights, not the ones a fresh build would draw
            p.add_(0.5)
    tr.save_checkpoint()
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    card = _card(out)
    assert card.data.library_name == "transformers" and card.data.base_model is None
    assert card.data.tags == ["diffgrpo", "grpo", "spg", "masked-diffusion-lm"]
    scope = _run_snippet(card, out)
    sd = scope["model"].state_dict()
    for k, v in tr.policy.state_dict().items():
        assert torch.equal(sd[k], v), k
    assert scope["tokenizer"]("a b").input_ids


def test_a_lora_card_names_its_base_model_and_license(tmp_path):
    from huggingface_hub import ModelCard

    from diffgrpo.cli.model_card import model_card

    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: openrail++\n---\n# base\n")
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "pytorch_lora_weights.safetensors").write_bytes(b"")
    config = {"model": {"name": "diffusers", "pretrained": str(base), "lora_rank": 4}, "engine": {"name": "nft"},
              "train": {"num_iterations": 3}, "reward": {"weights": {"pickscore": 1.0}}}
    text = model_card(config, 3, None, "LoRA adapter, diffusers format (load_lora_weights)", folder)
    (folder / "README.md").write_text(text)
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == str(base) and card.data.license == "openrail++"
    assert card.data.tags == ["diffgrpo", "grpo", "nft", "flow-matching", "lora"]
    assert f'DiffusionPipeline.from_pretrained("{base}")' in text and "pipe.load_lora_weights(model_dir)" in text
    assert "pickscore (weight 1.0)" in text and "| iterations | 3 " in text


@pytest.mark.parametrize("pretrained", ["org/model-without-a-local-card", None])
def test_the_license_is_left_out_when_unknown(pretrained):
    from diffgrpo.cli.model_card import base_license

    assert base_license(pretrained) == (None if pretrained else "apache-2.0")
