"""The model card (README.md) of ``diffgrpo export``, built with ``huggingface_hub.ModelCard``.

Front matter (``ModelCardData``): ``library_name`` (diffusers or transformers), ``base_model`` (``model.pretrained``;
none for a built-in model), ``tags`` (diffgrpo, grpo, the method, the family, lora for an adapter), ``license``
(the base model's own card's, when it is a local folder that has one; apache-2.0 for the built-in models, which
diffgrpo trains from scratch). Body: the training summary and how to load the folder, judged from the files it
holds; the built-in image model's transformer loads with diffusers alone, but its prompt encoder and pixel decoder
are diffgrpo's own, and the card says so.
"""
from __future__ import annotations

from pathlib import Path

from ..validation import family_of

LIBRARY = {"flow": "diffusers", "dllm": "transformers"}  # what loads each family's export (a model card's library_name)
FAMILY_TAGS = {"flow": "flow-matching", "dllm": "masked-diffusion-lm"}
METHOD_KEYS = {"flow": ("engine", "name", "recompute"), "dllm": ("dllm", "method", "diffu_grpo")}  # (section, key, default)
PLACEHOLDER = "path/to/this/folder"  # the snippets' folder: the export's own directory
BUILT_IN_LICENSE = "apache-2.0"  # the built-in models: trained by diffgrpo (Apache-2.0) on built-in data

TINY_NOTE = ("This is the transformer of diffgrpo's built-in digits model, not a diffusers pipeline: diffusers loads "
             "it alone (above), but sampling also needs what this folder does not hold: the prompt encoder, "
             "diffgrpo's own word-level encoder (`diffgrpo.models.tiny.PromptEncoder` over "
             "`diffgrpo.models.tiny.VOCAB`, pretrained with the transformer and frozen in training), and the pixel "
             "decoder `diffgrpo.models.tiny.decode_pixels` (the model works on pixels, no VAE). Sample the "
             "trained model with diffgrpo: `diffgrpo sample --weights <run directory>`.")
CLEAN_NOTE = ("Unlike a diffusers flow model, this transformer predicts the clean sample x̂₀ (pixels in [−1, 1]): the "
              "velocity is v = (x − x̂₀) / max(σ, 0.02) (`diffgrpo.models.{module}.velocity_from_clean`), and the "
              "prompt encoder is the one in `diffgrpo.models.{module}` (over the task's own vocabulary), not the "
              "digits model's.")
CLEAN_PREDICTING = {"shapes": "tiny_shapes", "shapes_video": "tiny_shapes_video"}  # train.task → its model module


def method_of(config: dict) -> str:
    """The training method a tag names: the engine (flow) or ``dllm.method`` (masked LMs)."""
    section, key, default = METHOD_KEYS[family_of(config.get("model", {}).get("name", "tiny"))]
    return str(config.get(section, {}).get(key, default))


def base_license(pretrained: str | None) -> str | None:
    """The license in the base model's own card (a local folder's README.md), the built-in models' when there is
    no base, else None (unknown)."""
    if not pretrained:
        return BUILT_IN_LICENSE
    card = Path(pretrained) / "README.md"
    if not card.is_file() or card.is_symlink():
        return None
    from huggingface_hub import ModelCard

    try:
        return ModelCard.load(card).data.license
    except Exception:  # noqa: BLE001 - an unreadable card only costs the license line
        return None


def load_snippet(folder: Path | None, config: dict) -> str:
    """Python that loads the export in ``folder`` (judged from its files; None: none yet) from ``PLACEHOLDER``."""
    files = {p.name for p in folder.iterdir()} if folder is not None else set()
    model = config.get("model", {})
    base = model.get("pretrained") or ""
    d = f'model_dir = "{PLACEHOLDER}"\n'
    if "model_index.json" in files:
        return d + "from diffusers import DiffusionPipeline\n\npipe = DiffusionPipeline.from_pretrained(model_dir)\n"
    if "pytorch_lora_weights.safetensors" in files:
        if base:
            return (d + f'from diffusers import DiffusionPipeline\n\npipe = DiffusionPipeline.from_pretrained("{base}")\n'
                    "pipe.load_lora_weights(model_dir)\n")
        return (d + "from safetensors.torch import load_file\n\n# LoRA weights of the built-in transformer "
                "(its load_lora_adapter), on the run's base weights\n"
                'adapter = load_file(f"{model_dir}/pytorch_lora_weights.safetensors")\n')
    if "adapter_config.json" in files:
        return (d + f'from peft import PeftModel\nfrom transformers import AutoModelForMaskedLM\n\n'
                f'model = PeftModel.from_pretrained(AutoModelForMaskedLM.from_pretrained("{base}"), model_dir)\n')
    if LIBRARY[family_of(model.get("name", "tiny"))] == "diffusers":
        cls = _class_name(folder) or "SD3Transformer2DModel"
        return d + f"from diffusers import {cls}\n\ntransformer = {cls}.from_pretrained(model_dir)\n"
    remote = ", trust_remote_code=True" if model.get("trust_remote_code") else ""
    return (d + "from transformers import AutoModelForMaskedLM, AutoTokenizer\n\n"
            f"model = AutoModelForMaskedLM.from_pretrained(model_dir{remote})\n"
            f"tokenizer = AutoTokenizer.from_pretrained(model_dir{remote})\n")


def _class_name(folder: Path | None) -> str | None:
    """The diffusers class a ``save_pretrained`` folder's config.json names."""
    import json

    try:
        name = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return name if isinstance(name, str) and name.isidentifier() else None


def _imports_first(code: str) -> str:
    """``code`` with its import lines on top (the snippets are written folder line first)."""
    lines = code.rstrip("\n").split("\n")
    imports = [x for x in lines if x.startswith(("from ", "import "))]
    rest = [x for x in lines if x not in imports and x]
    return "\n".join(imports + [""] + rest)


def _score(held_out: dict | None) -> str:
    if held_out is None:
        return "n/a (no held-out evaluation logged)"
    parts = [f"{held_out['eval/reward']:.4f} at iteration {held_out.get('iteration')}"]
    parts += [f"{k[len('eval/rewards/'):]} {v:.4f}" for k, v in held_out.items()
              if k.startswith("eval/rewards/") and isinstance(v, (int, float)) and not isinstance(v, bool)]
    return "; ".join(parts)


def model_card(config: dict, iteration: int, held_out: dict | None, kind: str, folder: Path | None = None) -> str:
    """README.md of an export: front matter, what was trained from what, how, for how long, how it scored held
    out, and how to load the export written in ``folder``."""
    from huggingface_hub import ModelCard, ModelCardData

    model, train = config.get("model", {}), config.get("train", {})
    family = family_of(model.get("name", "tiny"))
    weights = config.get("reward", {}).get("weights", {})
    rewards = ", ".join(f"{k} (weight {v})" for k, v in weights.items()) if isinstance(weights, dict) else str(weights)
    lora = int(model.get("lora_rank", 0) or 0)
    tags = ["diffgrpo", "grpo", method_of(config), FAMILY_TAGS[family], *(["lora"] if lora and "adapter" in kind else [])]
    data = ModelCardData(library_name=LIBRARY[family], base_model=model.get("pretrained") or None, tags=tags,
                         license=base_license(model.get("pretrained")))
    rows = [("base model", model.get("pretrained") or f"the built-in model (model.name={model.get('name')})"),
            ("what this is", kind), ("rewards", rewards or "n/a"),
            ("engine", config.get("engine", {}).get("name", "n/a")), ("method", method_of(config)),
            ("iterations", f"{iteration} (of train.num_iterations={train.get('num_iterations')})"),
            ("trained weights", f"LoRA rank {lora}" if lora else "full fine-tune"),
            ("held-out reward (eval/reward)", _score(held_out))]
    body = ["# GRPO post-trained with diffgrpo", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], "",
            "## Load", "", "```python", _imports_first(load_snippet(folder, config)), "```", ""]
    if model.get("name") == "tiny":
        task = train.get("task", "digits")
        body += [TINY_NOTE.replace("built-in digits model", f"built-in {task} model"), ""]
        if task in CLEAN_PREDICTING:
            body += [CLEAN_NOTE.format(module=CLEAN_PREDICTING[task]), ""]
    return ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n" + "\n".join(body)).content


__all__ = ["FAMILY_TAGS", "LIBRARY", "PLACEHOLDER", "base_license", "load_snippet", "method_of", "model_card"]
