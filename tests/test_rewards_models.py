"""The CLIP-class registry rewards (pickscore, clip_score, aesthetic) loaded through their real ``from_pretrained``
path from tiny models saved here, checked against scores computed directly with the transformers model; the
process-wide cache (one load per key, also from threads); options, dtype and device; config errors."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from diffgrpo import RunConfig
from diffgrpo.errors import ConfigError
from diffgrpo.rewards import MODEL_REWARDS, ModelReward, compute_rewards, make_rewards
from diffgrpo.rewards.loading import LOADS, clear_cache, to_uint8_hwc
from tests.helpers.rewards import aesthetic_state, save_tiny_clip

PROMPTS = ["a red cat", "a blue dog", "the sun", "two birds", "a tree"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("tiny-clip"))


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cache()
    yield
    clear_cache()


def _images(n: int = 5, seed: int = 0, shape=(3, 20, 24)) -> torch.Tensor:
    return torch.rand(n, *shape, generator=torch.Generator().manual_seed(seed))  # (n, C, H, W) in [0, 1]


def _reference(clip_dir, images, prompts):
    """(model, unit image embeddings, unit text embeddings, logits_per_image) from one CLIPModel forward (its own
    normalisation and logit scale), with inputs from CLIPProcessor."""
    from transformers import CLIPModel, CLIPProcessor

    model, proc = CLIPModel.from_pretrained(str(clip_dir)).eval(), CLIPProcessor.from_pretrained(str(clip_dir))
    with torch.no_grad():
        pix = proc(images=to_uint8_hwc(images), return_tensors="pt")["pixel_values"]
        tok = proc(text=prompts, padding=True, return_tensors="pt")
        out = model(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"], pixel_values=pix)
    return model, out.image_embeds, out.text_embeds, out.logits_per_image


def test_clip_score_is_the_cosine_of_clip_embeddings_and_batch_size_free(clip_dir):
    images = _images()
    model, img, txt, logits = _reference(clip_dir, images, PROMPTS)
    want = F.cosine_similarity(img, txt, dim=-1)  # (5,)
    torch.testing.assert_close(want, logits.diagonal() / model.logit_scale.exp().detach())
    for bs in (1, 2, 16):
        fn = make_rewards({"clip_score": 1.0}, {"clip_score": {"model": str(clip_dir), "batch_size": bs}}, "cpu")
        got = fn["clip_score"](images, PROMPTS, [{}] * 5)
        assert got.shape == (5,) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert want.std() > 0  # distinct prompts and images give distinct scores


def test_pickscore_is_logit_scale_times_cosine_over_divide_by(clip_dir, tmp_path):
    images = _images(seed=1)
    _, _, _, logits = _reference(clip_dir, images, PROMPTS)
    want = logits.diagonal() / 4.0  # logit_scale · cos(image_i, prompt_i) / divide_by
    opts = {"model": str(clip_dir), "processor": str(clip_dir), "divide_by": 4.0, "batch_size": 3}
    got = make_rewards({"pickscore": 1.0}, {"pickscore": opts}, "cpu")["pickscore"](images, PROMPTS, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_video_scores_are_the_mean_over_frames(clip_dir):
    video = torch.rand(2, 3, 3, 20, 24, generator=torch.Generator().manual_seed(2))  # (B, C, F, H, W)
    fn = make_rewards({"clip_score": 1.0}, {"clip_score": {"model": str(clip_dir)}}, "cpu")["clip_score"]
    per_frame = torch.stack([fn(video[:, :, f], PROMPTS[:2], None) for f in range(3)], 1)  # (B, F)
    torch.testing.assert_close(fn(video, PROMPTS[:2], None), per_frame.mean(1), rtol=1e-5, atol=1e-6)
    assert (per_frame.std(1) > 0).all()  # the frames differ, so the mean is not any one frame


def test_one_channel_images_score_as_grey_rgb(clip_dir):
    grey = _images(3, seed=3, shape=(1, 16, 16))
    fn = make_rewards({"clip_score": 1.0}, {"clip_score": {"model": str(clip_dir)}}, "cpu")["clip_score"]
    torch.testing.assert_close(fn(grey, PROMPTS[:3], None), fn(grey.expand(-1, 3, -1, -1), PROMPTS[:3], None))


def test_aesthetic_is_the_mlp_on_the_normalised_image_embedding(clip_dir, tmp_path):
    from safetensors.torch import save_file

    state = aesthetic_state(16)
    torch.save(state, tmp_path / "head.pth")
    save_file(state, str(tmp_path / "head.safetensors"))
    images = _images(4, seed=4)
    _, img, _, _ = _reference(clip_dir, images, PROMPTS[:4])
    x = img  # (4, 16): the MLP by hand, layer by layer (dropout is inactive when scoring)
    for i in (0, 2, 4, 6, 7):
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    for head in ("head.pth", "head.safetensors"):
        opts = {"aesthetic": {"model": str(clip_dir), "head": str(tmp_path / head), "batch_size": 3}}
        got = make_rewards({"aesthetic": 1.0}, opts, "cpu")["aesthetic"](images, PROMPTS[:4], None)
        torch.testing.assert_close(got, x[:, 0], rtol=1e-5, atol=1e-6)


class _NotATensor:
    pass


def test_aesthetic_head_is_never_unpickled(tmp_path):
    from diffgrpo.rewards.clip_models import read_state_dict

    torch.save({**aesthetic_state(16), "extra": _NotATensor()}, tmp_path / "evil.pth")
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|global"):
        read_state_dict(str(tmp_path / "evil.pth"))


def test_models_load_once_per_process_and_key_even_from_threads(clip_dir):
    images = _images(2, seed=5)
    opts = {"clip_score": {"model": str(clip_dir)}, "pickscore": {"model": str(clip_dir), "processor": str(clip_dir)}}
    fns = make_rewards({"clip_score": 1.0, "pickscore": 1.0}, opts, "cpu")
    errors = []

    def score():
        try:
            compute_rewards({"clip_score": 1.0, "pickscore": 0.5}, images, PROMPTS[:2], [{}, {}], rewards=fns)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=score) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    key = ("clip", str(clip_dir), str(clip_dir), "cpu", "float32")
    assert LOADS == {key: 1}  # both rewards and four threads share one load of the same model/processor/device/dtype
    make_rewards({"clip_score": 1.0}, {"clip_score": {"model": str(clip_dir), "dtype": "bfloat16"}}, "cpu"
                 )["clip_score"](images, PROMPTS[:2], None)
    assert LOADS[key] == 1 and LOADS[key[:-1] + ("bfloat16",)] == 1 and len(LOADS) == 2


def test_dtype_and_device_options_reach_the_model(clip_dir):
    from diffgrpo.rewards.loading import _CACHE

    images = _images(3, seed=6)
    full = make_rewards({"clip_score": 1.0}, {"clip_score": {"model": str(clip_dir)}}, "cpu")["clip_score"]
    half = make_rewards({"clip_score": 1.0}, {"clip_score": {"model": str(clip_dir), "dtype": "bfloat16",
                                                             "device": "cpu"}}, "meta")["clip_score"]
    a, b = full(images, PROMPTS[:3], None), half(images, PROMPTS[:3], None)  # the option's device beats the trainer's
    (_, m32), (_, m16) = (_CACHE[("clip", str(clip_dir), str(clip_dir), "cpu", d)] for d in ("float32", "bfloat16"))
    assert next(m32.parameters()).dtype == torch.float32 and next(m16.parameters()).dtype == torch.bfloat16
    assert {p.device.type for p in m16.parameters()} == {"cpu"}
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, rtol=0, atol=0.02)  # bfloat16 keeps 8 significant bits per layer
    assert not torch.equal(a, b)


def test_the_defaults_are_the_hub_ids_users_use(monkeypatch):
    from diffgrpo.rewards import clip_models

    calls = []
    monkeypatch.setattr(clip_models, "load_clip", lambda *a: calls.append(a) or (_ for _ in ()).throw(RuntimeError))
    for name, model, proc in [("pickscore", "yuvalkirstain/PickScore_v1", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"),
                              ("clip_score", "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14"),
                              ("aesthetic", "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14")]:
        with pytest.raises(RuntimeError):
            make_rewards({name: 1.0}, {}, "cpu")[name](_images(1), ["x"], None)
        assert calls.pop() == (model, proc, "cpu", "float32")
    assert clip_models.AESTHETIC_HEAD == "camenduru/improved-aesthetic-predictor:sac+logos+ava1-l14-linearMSE.pth"


def test_a_flow_run_scores_with_a_clip_reward_on_the_policy_device(make_trainer, clip_dir, tmp_path):
    import json

    pytest.importorskip("rapidocr_onnxruntime")  # the 'rewards' extra
    rows = [{"prompt": f"a sign {i}", "text": word} for i, word in enumerate(["open", "stop"])]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tr = make_trainer("reward.weights={clip_score: 1.0, ocr: 0.5}", f"train.prompts_file={tmp_path / 'p.jsonl'}",
                      f"reward.options={{clip_score: {{model: '{clip_dir}', batch_size: 4}}, "
                      f"ocr: {{det_limit_side_len: 32}}}}")
    ro = tr.rollout()
    got = ro.reward_components["clip_score"]
    assert got.shape == (6,) and torch.isfinite(got).all() and got.std() > 0
    clip_keys = [k for k in LOADS if k[0] == "clip"]
    assert len(clip_keys) == 1 and clip_keys[0][3] == str(tr.policy.device)
    want = make_rewards({"clip_score": 1.0}, {"clip_score": {"model": str(clip_dir)}}, "cpu")["clip_score"](
        ro.traj.images, ro.prompts, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the records' "text" reached the OCR reward (without it every sample would be NaN); an untrained 8-pixel
    # model draws nothing legible: measured 0 for every sample
    assert ro.reward_components["ocr"].tolist() == [0.0] * 6
    torch.testing.assert_close(ro.rewards, got)


# ----------------------------------------------------------------------------------------------- config errors
def _err(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        RunConfig.from_overrides(list(overrides))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_reward_options_are_checked_at_validation():
    ok = RunConfig.from_overrides(["reward.weights={pickscore: 1.0}",
                                   "reward.options={pickscore: {dtype: bfloat16, batch_size: 4, model: my/model}}"])
    assert ok.reward.options == {"pickscore": {"dtype": "bfloat16", "batch_size": 4, "model": "my/model"}}
    assert _err("reward.weights={pickscore: 1.0}", "reward.options={pickscore: {dtype: bf16}}").startswith(
        "reward.options.pickscore.dtype: value 'bf16' is not allowed; choose one of ['float32', 'bfloat16', 'float16']")
    assert _err("reward.weights={pickscore: 1.0}", "reward.options={pickscore: {batch_size: 0}}").startswith(
        "reward.options.pickscore.batch_size: value 0 is out of range; must be >= 1")
    assert "did you mean 'batch_size'" in _err("reward.weights={pickscore: 1.0}",
                                               "reward.options={pickscore: {batchsize: 4}}")
    assert _err("reward.weights={pickscore: 1.0}", "reward.options={clip_score: {batch_size: 4}}").startswith(
        "reward.options.clip_score: reward 'clip_score' is not in reward.weights")
    assert _err("reward.weights={pickscore: 1.0}", "reward.options={pickscore: 3}").startswith(
        "reward.options.pickscore: value 3 must be a mapping of options")
    assert _err("reward.weights={jpeg_compressibility: 1.0}", "reward.options={jpeg_compressibility: {a: 1}}"
                ).startswith("reward.options.jpeg_compressibility: 'jpeg_compressibility' takes no options")
    assert _err("reward.weights={geneval: 1.0}", "reward.options={geneval: {threshold: 1.5}}").startswith(
        "reward.options.geneval.threshold: value 1.5 is out of range; must be in [0, 1]")
    assert _err("reward.weights={clip_score: 1.0}", "reward.options={clip_score: {device: gpu0}}").startswith(
        "reward.options.clip_score.device: value 'gpu0' is not a torch device")


def test_rewards_that_cannot_apply_fail_before_loading(monkeypatch):
    msg = _err("model.name=diffusers", "model.pretrained=org/sd35")  # default reward: digit_alignment
    assert msg.startswith("reward.weights: 'digit_alignment' scores the built-in one-channel digit images "
                          "(model.name=tiny) and cannot apply to model.name=diffusers")
    assert _err("model.name=tiny_mlm", "reward.weights={pickscore: 1.0}").startswith(
        "reward.weights: 'pickscore' scores images and cannot score a masked diffusion LM's completions")
    assert _err("model.name=tiny_mlm", "reward.options={pickscore: {batch_size: 2}}").startswith(
        "reward.options.pickscore: reward 'pickscore' is not in reward.weights []")
    spec = MODEL_REWARDS["ocr"]
    monkeypatch.setitem(MODEL_REWARDS, "ocr", ModelReward(spec.build, spec.options,
                                                          {"no_such_module_xyz": "rapidocr-onnxruntime"}))
    assert _err("reward.weights={ocr: 1.0}") == ("reward.weights: reward 'ocr' needs rapidocr-onnxruntime, which is "
                                                 "not installed; pip install 'diffgrpo[rewards]'")


def test_text_verifiers_are_refused_on_image_models():
    """A text verifier would read image tensors as completions and score 0: refused before any model loads."""
    msg = _err("reward.weights={verify_gsm8k: 1.0}")
    assert msg.startswith("reward.weights: 'verify_gsm8k' verifies text completions and cannot score model.name=tiny")
