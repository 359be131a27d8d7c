"""Policy adapter for masked diffusion LMs through ``transformers``, and the built-in tiny dLLM.

:class:`MaskedLMPolicy` wraps any transformers model that maps ``input_ids`` (with a mask token) to
per-position logits under bidirectional attention:
  * standard masked-LM classes (``BertForMaskedLM``, ``RobertaForMaskedLM``, ``ModernBertForMaskedLM``, …);
  * LLaDA / Dream checkpoints through ``trust_remote_code`` (off unless the user sets it).
  * block-diffusion LMs (SDAR, TraDo; the built-in ``tiny_block``): a config with ``block_size`` marks the model
    block-causal; it loads through ``AutoModelForCausalLM`` (as the released checkpoints do), the policy's
    ``block_size`` is the config's, every forward gets the 4-D block-causal mask
    (:func:`~.block_cache.block_keep`) and the family decodes block by block with the exact cache of
    :mod:`.block_cache`.
Logit conventions are explicit: ``logits_shift=False`` (BERT, LLaDA): position j scores token j;
``logits_shift=True`` (Dream, initialised from an autoregressive LM): position j scores token j+1, so the
adapter returns ``cat([logits[:, :1], logits[:, :-1]])`` and every caller sees "position j scores token j".

At scale (:mod:`.masked_lm_scale`, ``dllm.*`` keys): weights at ``dllm.dtype`` (bf16: half the memory of float32;
logits always scored in float32), activation checkpointing of the blocks (transformers' switch), and a peft LoRA
adapter (:func:`add_lora`; the adapter trains in float32, the base is frozen, the KL reference is the adapter
disabled: no weight copy), all set by :func:`configure_model`. Prompts go through the tokenizer's chat template
when it has one (:class:`HFTokenizerVocab`). Under FSDP2 :func:`shard_blocks` shards every transformer block found
below the root (LLaDA's ``transformer.blocks``, Dream's ``layers``), peft's wrapper included.

Built-in model (``model.name=tiny_mlm``): a real ``transformers.BertForMaskedLM`` at a tiny config with the
character vocabulary of :mod:`diffgrpo.tasks`, pretrained on generated task data (train split) with
the masked-diffusion objective (LLaDA): t ~ U(0, 1), every completion token masked with probability t,
    L = E_t [ (1/t) Σ_j 1[j masked] · −log p_θ(y_j | x_t) ] / L,
the prompt never masked. Weights are cached per task/architecture/recipe under the cache directory.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from pathlib import Path

import torch
import torch.nn as nn

from ..cache import cache_lock, cache_root, save_dir_atomic
from ..config import PretrainConfig, RunConfig
from ..console import Steps
from ..distributed import launched_local_rank, resolve_device
from ..errors import ConfigError
from ..tasks import VOCAB, get_task, pad_right
from ..types import DTYPES
from .block_cache import block_keep, takes_store_kv
from .masked_lm_scale import (
    LORA_TARGETS,
    add_lora,
    configure_model,
    default_lora_targets,
    is_lora,
    shard_blocks,
    transformer_blocks,
)
from .pretraining import pretrain_step
from .reference import frozen_reference


class MaskedLMPolicy:
    """Adapter: ``logits(input_ids) -> (B, N, V)`` float32, position j scoring token j.

    Attention: positions holding ``pad_id`` (prompt left-padding) are excluded through ``attention_mask``
    when ``use_attention_mask``. ``block_size`` > 0: a block-causal model, given the 4-D block-causal mask (B, 1, N,
    N) bool instead of the 2-D padding mask. Reference policy: a frozen copy made on construction when
    ``keep_reference``.
    """

    def __init__(self, model: nn.Module, *, vocab, logits_shift: bool = False, device="cpu",
                 keep_reference: bool = False, use_attention_mask: bool = True, block_size: int = 0):
        self.device = torch.device(device)
        self.model = model.to(self.device).train(False)
        self.vocab = vocab  # encode/decode, mask_id, pad_id, eos_id
        self.mask_id, self.pad_id, self.eos_id = vocab.mask_id, vocab.pad_id, vocab.eos_id
        self.logits_shift = logits_shift
        self.use_attention_mask = use_attention_mask
        self.block_size = block_size  # > 0: block-causal (exact block cache, block rollouts)
        self.store_kv = bool(block_size) and takes_store_kv(self.model)  # the block cache asks it to store its keys
        self.lora = is_lora(self.model)  # a peft model: the reference is the adapter disabled, no copy
        if any(getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules()):
            # transformers checkpoints only in train mode: train mode with every dropout off (the likelihood
            # ratios need the deterministic forward the sampler used)
            for m in self.model.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
            self.model.train(True)
        self._ref = None
        if keep_reference and not self.lora:
            self._ref = copy.deepcopy(self.model).requires_grad_(False)
        self._use_ref = False
        self.counters = {"forwards_grad": 0, "forwards_nograd": 0}
        self.uses_cfg = False
        self.forward_module = None  # the DDP wrapper of ``model`` under data parallelism (weights stay on .model)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, N) long → logits (B, N, V) float32 (position j scores token j)."""
        net = self._ref if self._use_ref else (self.model if self.forward_module is None else self.forward_module)
        self.counters["forwards_grad" if torch.is_grad_enabled() else "forwards_nograd"] += input_ids.shape[0]
        kw = {}
        keep = input_ids != self.pad_id if self.use_attention_mask else None  # (B, N)
        if self.block_size:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # (1, N)
            kw["attention_mask"] = block_keep(pos, pos, self.block_size, keep)  # (B|1, 1, N, N)
        elif keep is not None:
            kw["attention_mask"] = keep.long()
        out = net(input_ids=input_ids, **kw).logits.float()
        return shift_logits(out) if self.logits_shift else out

    __call__ = logits

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def export(self, run_dir, weights: dict[str, torch.Tensor] | None = None) -> Path:
        """Save the trained model into ``run_dir``: a LoRA as a peft adapter directory ``<run_dir>/lora``
        (``PeftModel.from_pretrained(base, <run_dir>/lora)``), a full fine-tune as a ``from_pretrained`` directory
        ``<run_dir>/model``; with the tokenizer when it has a transformers one. ``weights``: the trainable weights
        as full tensors (``state_dict(full)``, an FSDP2 run's gathered state) instead of the live module's."""
        from safetensors.torch import save_file

        def write(d: Path) -> None:
            if self.lora:
                self.model.peft_config["default"].save_pretrained(str(d))  # adapter_config.json
                save_file(weights if weights is not None else self.state_dict(), str(d / "adapter_model.safetensors"))
            elif weights is not None:
                with own_class(self.model):
                    self.model.save_pretrained(str(d), state_dict=weights)
            else:
                self.model.save_pretrained(str(d))
            if isinstance(self.vocab, HFTokenizerVocab):
                self.vocab.tok.save_pretrained(str(d))

        # a temporary directory renamed into place
        return save_dir_atomic(Path(run_dir) / ("lora" if self.lora else "model"), write)

    def save_checkpoint_files(self, directory, trainable) -> None:
        """Nothing beside the trainable weights (``trainable.safetensors``: the whole model, or the adapter)."""

    def reference(self):
        """Inside the block ``logits`` uses the reference: the adapter disabled (LoRA) or the frozen initial
        weights."""
        return self.model.disable_adapter() if self.lora else frozen_reference(self)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def state_dict(self, full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The trainable weights: the whole model, or the LoRA adapter under peft's saved names. ``full``: take
        them from the model's full state dict gathered from FSDP2 shards (``distributed.full_model_state``)
        instead of the live (sharded) module."""
        if self.lora:
            from peft.utils import get_peft_model_state_dict

            layers = get_peft_model_state_dict(self.model, state_dict=full)
            return {k: v.detach().contiguous() for k, v in layers.items()}
        return untied_state_dict(self.model) if full is None else {k: v.contiguous() for k, v in full.items()}

    def load_state_dict(self, sd):
        if self.lora:
            from peft.utils import set_peft_model_state_dict

            res = set_peft_model_state_dict(self.model, sd)
            if getattr(res, "unexpected_keys", None):
                raise KeyError(f"unexpected LoRA keys: {res.unexpected_keys[:5]}")
            return
        self.model.load_state_dict(sd)


@contextlib.contextmanager
def own_class(module: nn.Module):
    """Inside the block an FSDP2-sharded ``module`` has its own class again. ``fully_shard`` gives it the class
    ``FSDP<Cls>(FSDPModule, Cls)``, defined in torch; ``save_pretrained`` copies a remote-code model's source files
    by its class's module, so saving under the FSDP class would copy torch's files instead of the model's."""
    cls = type(module)
    index = getattr(cls, "_orig_cls_mro_index", None)  # FSDPModule: where the original class sits in the MRO
    if index is None:
        yield
        return
    module.__class__ = cls.__mro__[index]
    try:
        yield
    finally:
        module.__class__ = cls


def untied_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with tied tensors (MLM decoder = word embeddings) copied apart, as safetensors requires."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def shift_logits(logits: torch.Tensor) -> torch.Tensor:
    """Dream convention (position j scores token j+1) → position j scores token j. (B, N, V) → (B, N, V).

    Position 0 has no scorer and reuses position 0's logits (it is always a prompt token)."""
    return torch.cat([logits[:, :1], logits[:, :-1]], 1)


# ---------------------------------------------------------------------------------------------- tiny model
TINY_ARCH = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, intermediate_size=192)


def tiny_bert(vocab_size: int, *, max_positions: int = 64, **arch) -> nn.Module:
    """A real ``transformers.BertForMaskedLM`` at a tiny size (bidirectional encoder, no dropout)."""
    from transformers import BertConfig, BertForMaskedLM

    a = {**TINY_ARCH, **arch}
    cfg = BertConfig(vocab_size=vocab_size, max_position_embeddings=max_positions, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, type_vocab_size=1, pad_token_id=0, **a)
    return BertForMaskedLM(cfg)


def masked_diffusion_loss(logits_fn, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, mask_id: int,
                          generator: torch.Generator | None = None, t_min: float = 1e-3) -> torch.Tensor:
    """LLaDA pretraining loss. prompt_ids (B, P), completion_ids (B, L) → scalar.

    t ~ U(t_min, 1) per sequence; completion tokens masked with probability t; cross-entropy on masked
    tokens weighted by 1/t, summed and divided by B·L."""
    B, L = completion_ids.shape
    t = t_min + (1 - t_min) * torch.rand(B, 1, generator=generator)  # (B, 1)
    m = torch.rand(B, L, generator=generator) < t  # (B, L)
    x = torch.cat([prompt_ids, torch.where(m, torch.full_like(completion_ids, mask_id), completion_ids)], 1)
    logits = logits_fn(x)[:, -L:]  # (B, L, V)
    ce = torch.nn.functional.cross_entropy(logits.reshape(B * L, -1), completion_ids.reshape(-1),
                                           reduction="none").view(B, L)
    return (ce * m / t).sum() / (B * L)


def _recipe_key(task: str, arch: dict, pcfg: PretrainConfig) -> str:
    recipe = {"task": task, "arch": arch, "steps": pcfg.steps, "bs": pcfg.batch_size, "lr": pcfg.lr,
              "seed": pcfg.seed, "kind": "mdm", "v": 1}
    if pcfg.answer_noise > 0:  # absent when 0, so clean bases keep their cache key
        recipe["answer_noise"] = pcfg.answer_noise
        recipe["noise_kind"] = "slip"
    blob = json.dumps(recipe, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def pretrain_tiny_mlm(task, pcfg: PretrainConfig, *, progress: bool = True, arch: dict | None = None) -> nn.Module:
    """Masked-diffusion pretraining of the tiny BERT on the task's train split. Returns the model (eval mode).

    With ``pcfg.answer_noise`` = ρ > 0 each drawn example keeps its prompt but, with probability ρ, its answer
    is replaced by the task's systematic slip (:meth:`Task.slip`: off by one in arithmetic, digits 1/2 swapped
    in sudoku; another example's answer for tasks without one). The base then answers in the right format but
    wrongly about ρ of the time when sampled: one habit shared by all prompts, which GRPO with a verifiable
    reward can train away and which therefore shows on held-out prompts too."""
    g = torch.Generator().manual_seed(pcfg.seed)
    torch.manual_seed(pcfg.seed)
    net = tiny_bert(len(VOCAB), max_positions=task.prompt_length + task.gen_length, **(arch or {}))

    def fn(x):
        return net(input_ids=x, attention_mask=(x != VOCAB.pad_id).long()).logits

    return pretrain_on_task(net, task, pcfg, task.prompt_length, g, f"pretraining tiny dLLM ({task.name})", progress,
                            lambda prompts, target: masked_diffusion_loss(fn, prompts, target, VOCAB.mask_id,
                                                                          generator=g))


def pretrain_on_task(net: nn.Module, task, pcfg: PretrainConfig, P: int, g: torch.Generator, desc: str,
                     progress: bool, loss_fn) -> nn.Module:
    """The built-in LMs' pretraining loop on ``task``'s train split: prompts left-padded to ``P``, completions the
    answers (with probability ``pcfg.answer_noise`` the task's slip, or another answer), AdamW with a one-cycle
    schedule, ``loss_fn(prompts (b, P), targets (b, L))`` per step, draws from ``g``. → ``net`` in eval mode."""
    pool = task.instances("train")
    prompts = VOCAB.encode_prompts([e.prompt for e in pool], P)  # (n, P)
    comps = VOCAB.encode_completions([e.answer for e in pool], task.gen_length)  # (n, L)
    slips = [task.slip(e) for e in pool]
    slips = None if slips[0] is None else VOCAB.encode_completions(slips, task.gen_length)  # (n, L)
    opt = torch.optim.AdamW(net.parameters(), lr=pcfg.lr, weight_decay=0.01)
    # a warmup of >= 2 steps: OneCycleLR divides by (warmup steps − 1), so pretrain.steps=20 (0.05 × 20 = 1) crashed
    warmup = min(max(0.05, 2.0 / pcfg.steps), 0.5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=pcfg.lr, total_steps=pcfg.steps, pct_start=warmup)
    net.train()
    bar = Steps(pcfg.steps, desc, enabled=progress)  # a bar only on a terminal
    ema = None
    for _ in bar:
        idx = torch.randint(len(pool), (pcfg.batch_size,), generator=g)  # (b,)
        target = comps[idx]  # (b, L)
        if pcfg.answer_noise > 0:
            noisy = (torch.rand(idx.shape, generator=g) < pcfg.answer_noise).unsqueeze(1)  # (b, 1)
            wrong = comps[torch.randint(len(pool), idx.shape, generator=g)] if slips is None else slips[idx]
            target = torch.where(noisy, wrong, target)
        ema = pretrain_step(loss_fn(prompts[idx], target), net, opt, sched, bar, ema)
    return net.eval()


def load_or_pretrain_mlm(task, pcfg: PretrainConfig, *, cache_dir: str = "", progress: bool = True, log=print,
                         arch: dict | None = None) -> nn.Module:
    """The cached pretrained tiny dLLM for this task and recipe; pretrains (and caches) it if absent.

    Checked, pretrained and saved under the entry's lock: concurrent runs and torchrun ranks pretrain once, the
    others wait and then load the same weights."""

    a = {**TINY_ARCH, **(arch or {})}
    path = cache_root(cache_dir) / f"tiny-mlm-{task.name}-{_recipe_key(task.name, a, pcfg)}"
    net = tiny_bert(len(VOCAB), max_positions=task.prompt_length + task.gen_length, **a)
    return cached_pretrained(net, path, lambda: pretrain_tiny_mlm(task, pcfg, progress=progress, arch=a),
                             {"task": task.name, "arch": a, "pretrain": vars(pcfg)},
                             f"no cached tiny dLLM at {path}; pretraining it ({pcfg.steps} steps, runs once)", log)


def cached_pretrained(net: nn.Module, path, pretrain, meta: dict, message: str, log) -> nn.Module:
    """``net`` with the weights cached at ``path`` (model.safetensors + config.json ``meta``), made by
    ``pretrain()`` and saved atomically when absent, under the entry's lock: concurrent runs and torchrun ranks
    pretrain once, the others wait and then load the same weights. → ``net`` in eval mode."""
    from safetensors.torch import load_file, save_file

    with cache_lock(path):
        if not (path / "model.safetensors").is_file():
            log(message)
            trained = pretrain()

            def write(tmp):
                save_file(untied_state_dict(trained), str(tmp / "model.safetensors"))
                (tmp / "config.json").write_text(json.dumps(meta, indent=2))

            save_dir_atomic(path, write)
    net.load_state_dict(load_file(str(path / "model.safetensors")))
    return net.eval()


class HFTokenizerVocab:
    """A transformers tokenizer behind the vocabulary interface the dLLM code uses (encode/decode, ids)."""

    def __init__(self, tok, mask_id: int | None = None, *, chat_template: bool = False, system_prompt: str = ""):
        self.tok = tok
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.mask_id = mask_id if mask_id is not None else tok.mask_token_id
        if self.mask_id is None:
            raise ConfigError("dllm.mask_token_id: the tokenizer has no mask token; set the id of the model's mask "
                              "token (LLaDA: 126336)")
        self.eos_id = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id

    def __len__(self):
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tok.decode([i for i in ids if i not in (self.pad_id, self.eos_id)])

    def prompt_ids(self, prompt: str) -> list[int]:
        """A prompt's ids: with a chat template, the system message (if any), the prompt as the user's turn and
        the generation prompt (the template's own special tokens included); else the plain encoding."""
        if not self.chat_template:
            return self.encode(prompt)
        msgs = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        text = self.tok.apply_chat_template(msgs + [{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False)

    def encode_prompts(self, prompts, length):
        """Left-padded prompt ids (B, length) long; a longer prompt keeps its last ``length`` tokens."""
        out = torch.full((len(prompts), length), self.pad_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids = self.prompt_ids(p)[-length:]
            out[b, length - len(ids):] = torch.tensor(ids)
        return out

    def encode_completions(self, completions, length):
        return pad_right([self.encode(c) for c in completions], length, self.eos_id)


def _dtype_kwarg() -> str:
    """``from_pretrained``'s dtype argument: ``dtype`` since transformers 4.56, ``torch_dtype`` before."""
    import transformers

    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_hf_masked_lm(path: str, *, trust_remote_code: bool = False, logits_shift: bool | None = None,
                      device="cpu", keep_reference=False, mask_token_id: int | None = None, dtype: str = "float32",
                      gradient_checkpointing: bool = False, lora_rank: int = 0, lora_alpha: float = 0.0,
                      lora_targets: str = "", chat_template: str = "auto", system_prompt: str = "") -> MaskedLMPolicy:
    """A local/hub checkpoint → policy. ``logits_shift`` defaults to True for Dream-type configs, else False.

    LLaDA/Dream ship custom code: it only runs with ``trust_remote_code=True`` set by the user. Loaded at ``dtype``
    (``from_pretrained(dtype=...)``: no float32 copy of a bf16 checkpoint is made), then :func:`configure_model`.
    ``chat_template``: "auto" (when the tokenizer has one), "true", "false"."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as e:  # a hub model whose config needs its own code
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise ConfigError(f"dllm.trust_remote_code: the model {path!r} ships its own code; set "
                          "dllm.trust_remote_code=true if you trust that code") from None
    mtype = getattr(cfg, "model_type", "").lower()
    if logits_shift is None:
        logits_shift = "dream" in mtype
    kw = {"trust_remote_code": trust_remote_code, _dtype_kwarg(): DTYPES[dtype]}
    block_size = int(getattr(cfg, "block_size", 0) or 0)  # block-diffusion LMs: their LM head is the causal-LM class
    try:
        model = (AutoModelForCausalLM if block_size else AutoModelForMaskedLM).from_pretrained(path, **kw)
    except ValueError:
        model = AutoModel.from_pretrained(path, **kw)
    model = configure_model(model, dtype=dtype, gradient_checkpointing=gradient_checkpointing, lora_rank=lora_rank,
                            lora_alpha=lora_alpha, lora_targets=lora_targets)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if mask_token_id is None and tok.mask_token_id is None and "llada" in mtype:
        mask_token_id = 126336  # LLaDA's [MASK]
    has_template = bool(getattr(tok, "chat_template", None))
    if chat_template == "true" and not has_template:
        raise ConfigError(f"dllm.chat_template: value 'true' but the tokenizer of {path!r} has no chat template; "
                          f"use auto or false")
    use_template = chat_template == "true" or (chat_template == "auto" and has_template)
    if system_prompt and not use_template:  # a hub model (a local one is refused before it loads)
        raise ConfigError(f"dllm.system_prompt: set, but the tokenizer of {path!r} has no chat template in use "
                          f"(dllm.chat_template={chat_template}), so it would be unused; clear dllm.system_prompt")
    vocab = HFTokenizerVocab(tok, mask_token_id, chat_template=use_template, system_prompt=system_prompt)
    size = getattr(cfg, "vocab_size", None) or len(tok)
    if not 0 <= vocab.mask_id < size:
        raise ConfigError(f"dllm.mask_token_id: the mask id {vocab.mask_id} is outside the vocabulary of {path!r} "
                          f"({size} tokens); set the id of the model's mask token")
    return MaskedLMPolicy(model, vocab=vocab, logits_shift=logits_shift, device=device,
                          keep_reference=keep_reference, block_size=block_size)


def build_tiny_mlm_policy(cfg: RunConfig, *, progress=True, log=print, pretrained=True) -> MaskedLMPolicy:
    """Factory for ``model.name=tiny_mlm``: the cached pretrained tiny dLLM for ``dllm.task``."""

    task = get_task(cfg.dllm.task)
    if pretrained:
        net = load_or_pretrain_mlm(task, cfg.pretrain, cache_dir=cfg.model.cache_dir, progress=progress, log=log)
    else:
        net = tiny_bert(len(VOCAB), max_positions=task.prompt_length + task.gen_length)
    d = cfg.dllm
    net = configure_model(net, dtype=d.dtype, gradient_checkpointing=d.gradient_checkpointing, lora_rank=d.lora_rank,
                          lora_alpha=d.lora_alpha, lora_targets=d.lora_target_modules)
    device = resolve_device(cfg.model.device, launched_local_rank())  # the Trainer passes it resolved already
    return MaskedLMPolicy(net, vocab=VOCAB, device=device, keep_reference=cfg.loss.beta > 0)


def build_hf_masked_lm_policy(cfg: RunConfig, *, progress=True, log=print) -> MaskedLMPolicy:
    """Factory for ``model.name=hf_masked_lm``: ``dllm.model_path`` (local directory or hub id)."""
    d = cfg.dllm
    if not d.model_path:
        raise ConfigError("dllm.model_path: required for model.name=hf_masked_lm (a local model directory or hub id)")
    shift = {"auto": None, "true": True, "false": False}[str(d.logits_shift).lower()]
    device = resolve_device(cfg.model.device, launched_local_rank())  # the Trainer passes it resolved already
    return load_hf_masked_lm(d.model_path, trust_remote_code=d.trust_remote_code, logits_shift=shift,
                             device=device, keep_reference=cfg.loss.beta > 0,
                             mask_token_id=d.mask_token_id if d.mask_token_id >= 0 else None, dtype=d.dtype,
                             gradient_checkpointing=d.gradient_checkpointing, lora_rank=d.lora_rank,
                             lora_alpha=d.lora_alpha, lora_targets=d.lora_target_modules,
                             chat_template=d.chat_template, system_prompt=d.system_prompt)


__all__ = ["MaskedLMPolicy", "shift_logits", "untied_state_dict", "tiny_bert", "masked_diffusion_loss",
           "pretrain_tiny_mlm", "load_or_pretrain_mlm", "load_hf_masked_lm", "build_tiny_mlm_policy",
           "build_hf_masked_lm_policy", "HFTokenizerVocab", "DTYPES", "LORA_TARGETS", "add_lora", "configure_model",
           "default_lora_targets", "is_lora", "own_class", "shard_blocks", "transformer_blocks"]
