"""A small block-diffusion LM shipped as remote code in the layout of the released SDAR / TraDo checkpoints
(:mod:`.modeling_blockdlm`, :mod:`.configuration_blockdlm`), and :func:`write_block_model`, which writes a model
directory of it (weights, config with ``auto_map`` / ``model_type`` / ``block_size``, both source files, optionally a
tokenizer) that ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads, as the released
checkpoints load. Built locally with seeded random weights; nothing is downloaded."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

SOURCES = ("configuration_blockdlm.py", "modeling_blockdlm.py")
AUTO_MAP = {"AutoConfig": "configuration_blockdlm.BlockDLMConfig", "AutoModel": "modeling_blockdlm.BlockDLMModel",
            "AutoModelForCausalLM": "modeling_blockdlm.BlockDLMForCausalLM"}


def write_block_model(directory, *, tokenizer=None, seed: int = 0, **config) -> Path:
    """Write a seeded random block-diffusion LM (``config``: :class:`BlockDLMConfig` fields, e.g. ``vocab_size``,
    ``block_size``, ``mask_token_id``) and ``tokenizer`` (if given) into ``directory`` → its path. The weights are
    made by the directory's own code, loaded through ``auto_map`` as a user loads it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        shutil.copyfile(Path(__file__).with_name(name), d / name)
    (d / "config.json").write_text(json.dumps({"model_type": "blockdlm", "auto_map": AUTO_MAP, **config}, indent=2))
    cfg = AutoConfig.from_pretrained(str(d), trust_remote_code=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, trust_remote_code=True).eval().save_pretrained(str(d))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(d))
    return d


__all__ = ["AUTO_MAP", "SOURCES", "write_block_model"]
