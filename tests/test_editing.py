"""Image editing (Qwen-Image-Edit, Qwen-Image-Edit-Plus, FLUX.1 Kontext): source images from prompt metadata,
checked at data load; the editing adapters' rollouts against the untouched pipelines' own sampling with the same
source, noise and steps; rewards that receive the source (both calling conventions) and the clip_direction reward
against a hand computation on a tiny CLIP; command-line runs (full and LoRA) whose exports diffusers reloads and
samples to the trained latents, with sample tables and grids showing source and result. Tiny random-weight
pipelines from the pipelines' own classes (``tests/helpers/pipelines.py``)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from diffgrpo import RunConfig, sources
from diffgrpo.data_sources import load_prompts
from diffgrpo.errors import ConfigError, RewardError
from diffgrpo.models.diffusers_adapter import (
    DiffusersFlowPolicy,
    PolicyOptions,
    pack_2x2,
    unpack_2x2,
)
from diffgrpo.rewards import compute_rewards
from diffgrpo.samplers.rollout import sample_trajectories
from tests.helpers.pipelines import (
    INSTRUCTIONS,
    RES,
    T,
    image_only_processor,
    kontext_pipeline,
    qwen_edit_pipeline,
    write_edit_jsonl,
    write_sources,
)

LATENT = (4, RES // 8, RES // 8)
KINDS = {"edit": ("QwenImageEditPipeline", 1), "plus": ("QwenImageEditPlusPipeline", 2),
         "kontext": ("FluxKontextPipeline", 1)}


@pytest.fixture
def _processor():
    with image_only_processor():
        yield


# ------------------------------------------------------------------------------------------- source images


def test_sources_resolve_relative_to_the_prompt_file_and_refuse_bad_files(tmp_path):
    d = tmp_path / "data"
    f = write_edit_jsonl(d)
    recs = load_prompts(str(f))
    assert [r["prompt"] for r in recs] == INSTRUCTIONS
    assert recs[0]["image"] == str(d / "images" / "src0.png") and sources.of_record(recs[1]) == (str(d / "images/src1.png"),)
    t = sources.as_tensor(recs[0]["image"])
    assert t.shape == (3, RES, RES) and 0 <= float(t.min()) and float(t.max()) <= 1

    def refused(row: dict, match: str, setup=None):
        g = d / "bad.jsonl"
        g.write_text(json.dumps({"prompt": "x", **row}) + "\n")
        with pytest.raises(ConfigError, match=match) as e:
            load_prompts(str(g))
        assert "\n" not in str(e.value) and "train.prompts_file" in str(e.value) and "record 1" in str(e.value)

    refused({"image": "images/missing.png"}, "does not exist")
    refused({"image": "../outside.png"}, "outside the prompt file's folder")
    (d / "images" / "notes.png").write_text("not an image")
    refused({"image": "images/notes.png"}, "not an image Pillow can read")
    os.symlink(d / "images" / "src0.png", d / "images" / "link.png")
    refused({"image": "images/link.png"}, "symbolic link")
    os.symlink(d / "images", d / "linked")
    refused({"image": "linked/src0.png"}, "symbolic link")
    refused({"images": []}, "non-empty list")
    refused({"image": "images/src0.png", "images": ["images/src1.png"]}, "not both")
    old = sources.MAX_PIXELS
    try:
        sources.MAX_PIXELS = RES * RES - 1
        refused({"image": "images/src0.png"}, "the limit is")
    finally:
        sources.MAX_PIXELS = old


def test_hf_image_columns_become_sources(tmp_path):
    """An hf: dataset's image column (datasets.Image) gives each record its source, held in memory under a key, so
    the metadata stays JSON; a non-image value in the column is a one-line error naming the row."""
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    paths = write_sources(tmp_path, 2)
    ims = [Image.open(tmp_path / p).convert("RGB") for p in paths]
    ds = datasets.Dataset.from_dict({"prompt": INSTRUCTIONS[:2], "image": ims},
                                    features=datasets.Features({"prompt": datasets.Value("string"),
                                                                "image": datasets.Image()}))
    ds.to_parquet(str(tmp_path / "edits.parquet"))
    recs = load_prompts(f"hf:parquet:{tmp_path / 'edits.parquet'}")
    assert [r["prompt"] for r in recs] == INSTRUCTIONS[:2] and all(isinstance(r["image"], str) for r in recs)
    json.dumps(recs)  # JSON-friendly metadata
    for r, im in zip(recs, ims):
        assert np.array_equal(np.asarray(sources.load_rgb(r["image"])), np.asarray(im))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "image": 3}) + "\n")
    with pytest.raises(ConfigError, match="record 1 field 'image'"):
        load_prompts(str(tmp_path / "bad.jsonl"))


def test_an_editing_model_without_sources_is_refused_before_it_loads(tmp_path):
    """model_index.json names an editing pipeline: prompts without an image field are a one-line ConfigError naming
    the key (nothing loads: the directory holds no weights)."""
    d = tmp_path / "pipe"
    d.mkdir()
    (d / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPipeline"}))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "make it red"}) + "\n")
    edits = write_edit_jsonl(tmp_path / "e")
    base = ["model.name=diffusers", f"model.pretrained={d}", f"eval.prompts_file={edits}",
            "reward.weights={jpeg_incompressibility: 1.0}"]
    for prompts, match in ((tmp_path / "p.jsonl", "record 1 .* has no source image"), ("", "needs a source image")):
        with pytest.raises(ConfigError, match=match) as e:
            RunConfig.from_overrides([*base, f"train.prompts_file={prompts}"])
        assert str(e.value).startswith("train.prompts_file: ") and "\n" not in str(e.value)
    plus = write_edit_jsonl(tmp_path / "p2", n_sources=2)  # two sources: for Edit-Plus only
    with pytest.raises(ConfigError, match="takes one"):
        RunConfig.from_overrides([*base, f"train.prompts_file={plus}"])
    RunConfig.from_overrides([*base, f"train.prompts_file={edits}"])  # valid
    from diffgrpo.models.pipelines import editing

    with pytest.raises(ConfigError, match="the prompt 'b' has none"):  # a batch without sources reaching the policy
        editing.keys(["a", "b"], [("x.png",), ()], "qwenimage_edit")
    assert editing.keys(["a"], [("x.png",)], "flux_kontext") == [("a", ("x.png",))]


# ------------------------------------------------------------------------------------------- rewards


def test_rewards_receive_the_source_in_both_conventions(tmp_path):
    recs = load_prompts(str(write_edit_jsonl(tmp_path)))
    meta = [{k: v for k, v in r.items() if k != "prompt"} for r in recs]
    images = torch.rand(len(recs), 3, RES, RES, generator=torch.Generator().manual_seed(1))
    src = torch.stack([sources.as_tensor(r["image"]) for r in recs])
    got = {}

    def positional(images, prompts, metadata):
        got["pos"] = torch.stack([m["source_images"][0] for m in metadata])
        return (images - got["pos"]).abs().mean((1, 2, 3))

    def trl(prompts, completions, source_images, **kwargs):
        got["trl"] = torch.stack([s[0] for s in source_images])
        return [float(x) for x in (completions - got["trl"]).abs().mean((1, 2, 3))]

    fns = {"a": positional, "b": __import__("diffgrpo").rewards.calling.bind(trl)}
    with pytest.raises(RewardError, match="reward 'a' raised KeyError"):  # the generic call attaches nothing
        compute_rewards({"a": 1.0}, images, [r["prompt"] for r in recs], meta, rewards=fns, log=lambda *a: None)
    # the flow family scores its decoded images with the sources attached
    _, comps = compute_rewards({"a": 1.0, "b": 1.0}, images, [r["prompt"] for r in recs], sources.attach(meta),
                               rewards=fns)
    torch.testing.assert_close(got["pos"], src)
    torch.testing.assert_close(got["trl"], src)
    torch.testing.assert_close(comps["a"], (images - src).abs().mean((1, 2, 3)))
    assert "source_images" not in meta[0]  # the run's metadata (tables, logs) stays JSON


def test_clip_direction_is_the_cosine_of_the_embedding_differences(tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    from diffgrpo.rewards import make_rewards
    from diffgrpo.rewards.loading import clear_cache, to_uint8_hwc
    from tests.helpers.rewards import save_tiny_clip

    clip = save_tiny_clip(tmp_path / "clip")
    recs = load_prompts(str(write_edit_jsonl(tmp_path / "d")))
    meta = [{k: v for k, v in r.items() if k != "prompt"} for r in recs] + [{}]  # the last sample has no source
    prompts = [r["prompt"] for r in recs] + ["a cat"]
    images = torch.rand(len(prompts), 3, RES, RES, generator=torch.Generator().manual_seed(2))
    clear_cache()
    fns = make_rewards({"clip_direction": 1.0}, {"clip_direction": {"model": str(clip), "batch_size": 2}}, "cpu")
    score, _ = compute_rewards({"clip_direction": 1.0}, images, prompts, sources.attach(meta), rewards=fns)
    clear_cache()
    model, proc = CLIPModel.from_pretrained(str(clip)).eval(), CLIPProcessor.from_pretrained(str(clip))
    with torch.no_grad():
        def img(x):
            e = model.get_image_features(pixel_values=proc(images=to_uint8_hwc(x), return_tensors="pt")["pixel_values"])
            e = e if torch.is_tensor(e) else e.pooler_output
            return e / e.norm(dim=-1, keepdim=True)

        def txt(p):
            e = model.get_text_features(**proc(text=p, padding=True, return_tensors="pt"))
            e = e if torch.is_tensor(e) else e.pooler_output
            return e / e.norm(dim=-1, keepdim=True)

        src = torch.stack([sources.as_tensor(r["image"]) for r in recs])
        d_img = img(images[:3]) - img(src)
        d_txt = txt(prompts[:3]) - txt([""])
    expected = (d_img * d_txt).sum(-1) / (d_img.norm(dim=-1) * d_txt.norm(dim=-1))
    torch.testing.assert_close(score[:3], expected, rtol=1e-4, atol=1e-5)
    assert torch.isnan(score[3])  # no source: invalid sample
    assert float(expected.abs().max()) > 0.01  # a non-degenerate comparison


# ------------------------------------------------------------------------------------------- the adapters


def _pipeline(kind):
    return kontext_pipeline() if kind == "kontext" else qwen_edit_pipeline(plus=kind == "plus")


@pytest.fixture(scope="module")
def pipe_dirs(tmp_path_factory):
    """Each kind's tiny pipeline saved with save_pretrained, beside its JSONL of (sources, instruction) pairs."""
    out = {}
    with image_only_processor():
        for kind in KINDS:
            d = tmp_path_factory.mktemp(f"tiny-{kind}")
            _pipeline(kind).save_pretrained(str(d))
            write_edit_jsonl(d, n_sources=KINDS[kind][1])
            out[kind] = d
    return out


@pytest.fixture
def source_area(monkeypatch):
    """The pipelines resize sources to their target area (1024² pixels); the tiny ones work at RES² (the adapter
    resizes to the output's side, which is the published pair at 1024)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    calc = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: calc(RES * RES, ratio))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", RES * RES)


def _noise(n):
    return torch.randn(n, *LATENT, generator=torch.Generator().manual_seed(0))


def _records(d):
    return load_prompts(str(d / "edits.jsonl"))


def _pipeline_latents(kind, pipe, recs, x, guidance):
    """The untouched pipeline's sampling, one record at a time (its batch shares one source), → (N, *LATENT)."""
    from PIL import Image

    outs = []
    for r, xi in zip(recs, x):
        ims = [Image.open(p).convert("RGB") for p in sources.of_record(r)]
        kw = {"prompt": r["prompt"], "num_inference_steps": T, "height": RES, "width": RES, "latents": pack_2x2(xi[None]),
                  "output_type": "latent"}
        if kind == "kontext":
            kw.update(image=ims[0], guidance_scale=guidance, _auto_resize=False, max_sequence_length=16,
                      max_area=RES * RES)  # its default 1024² rescales the output
        else:
            kw.update(image=ims if kind == "plus" else ims[0], negative_prompt="", true_cfg_scale=guidance)
        with torch.no_grad():
            outs.append(unpack_2x2(pipe(**kw).images, *LATENT))
    return torch.cat(outs)


def _policy(kind, pipe, guidance, **kw):
    fam = {"edit": "qwenimage_edit", "plus": "qwenimage_edit_plus", "kontext": "flux_kontext"}[kind]
    options = PolicyOptions(guidance_scale=guidance, max_sequence_length=16 if kind == "kontext" else 0, **kw)
    return DiffusersFlowPolicy(pipe.transformer, fam, options, latent_shape=LATENT, pipeline=pipe)


def _our_latents(pol, pipe, kind, recs, x, guidance):
    _pipeline_latents(kind, pipe, recs[:1], x[:1], guidance)  # the scheduler's grid, as the pipeline sets it
    sigmas = pipe.scheduler.sigmas.float()
    cond = pol.encode([r["prompt"] for r in recs], sources.of_batch(recs))
    with torch.no_grad():
        return sample_trajectories(pol, cond, x, sigmas, kernel={"sde_type": "ode"})["xs"][:, -1]


GUIDANCE = {"edit": 4.0, "plus": 4.0, "kontext": 2.5}


def test_kontext_rollout_reproduces_the_pipeline_sampling(tmp_path):
    """The fast cell of the editing path: a tiny FluxKontextPipeline in memory, a JSONL of (source, instruction)
    pairs; the adapter's ODE rollout with each record's source equals the pipeline's own sampling."""
    write_edit_jsonl(tmp_path)
    recs = _records(tmp_path)
    pipe = kontext_pipeline()
    pipe.set_progress_bar_config(disable=True)
    x = _noise(len(recs))
    pol = _policy("kontext", pipe, 2.5)
    err = float((_our_latents(pol, pipe, "kontext", recs, x, 2.5) - _pipeline_latents("kontext", pipe, recs, x, 2.5))
                .abs().max())
    assert err < 1e-5, err


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_rollout_reproduces_the_pipeline_sampling(pipe_dirs, source_area, _processor, kind):
    """Same source, noise and steps: the library's ODE rollout equals the pipeline's own sampling (Qwen: true CFG
    with norm rescale, the negative prompt encoded with the source; Kontext: its guidance embedding)."""
    import diffusers

    cls = getattr(diffusers, KINDS[kind][0])
    pipe = cls.from_pretrained(str(pipe_dirs[kind]))
    recs = _records(pipe_dirs[kind])
    x = _noise(len(recs))
    pol = _policy(kind, pipe, GUIDANCE[kind])
    ours = _our_latents(pol, pipe, kind, recs, x, GUIDANCE[kind])
    theirs = _pipeline_latents(kind, pipe, recs, x, GUIDANCE[kind])
    err = float((ours - theirs).abs().max())
    print(f"{kind}: max |rollout − pipeline| = {err:.2e} (latents up to {float(theirs.abs().max()):.2f})")
    assert err < 1e-5, err
    # the source matters: another source gives other latents
    other = [(s[-1],) * len(s) for s in sources.of_batch(recs)[::-1]]
    with torch.no_grad():
        v1 = pol.velocity(x, torch.full((len(recs),), 0.7), pol.encode([r["prompt"] for r in recs], sources.of_batch(recs)))
        v2 = pol.velocity(x, torch.full((len(recs),), 0.7), pol.encode([r["prompt"] for r in recs], other))
    assert float((v1 - v2).abs().max()) > 1e-4


# ------------------------------------------------------------------------------------------- tables and grids


def test_tables_and_grids_show_source_and_result(tmp_path):
    from diffgrpo.media import SampleTable, table_columns, to_uint8, with_source

    src, out = torch.zeros(3, 4, 6), torch.ones(3, 4, 6)
    tile = with_source(out, src)
    assert tile.shape == (3, 4, 14) and float(tile[:, :, :6].max()) == 0 and float(tile[:, :, 8:].min()) == 1
    assert with_source(out, None) is out
    table = SampleTable(tmp_path, 3)
    table.add_sample(0, "make it red", {"image": "x.png"}, {"r": 1.0}, 1.0, to_uint8(out), source=to_uint8(src))
    rows = table.close()
    assert rows[0]["source_image"] == "samples/eval_000003/00000_source.png"
    assert (tmp_path / rows[0]["source_image"]).is_file() and (tmp_path / rows[0]["image"]).is_file()
    cols, data = table_columns(rows)
    assert cols[-2:] == ["image", "source_image"] and data[0][-1] == rows[0]["source_image"]


# ------------------------------------------------------------------------------------------- command-line runs


def _cli_args(kind, d, clip, run, lora):
    g = GUIDANCE[kind]
    return ["train", "log.progress=false", "log.save_images=true", "model.name=diffusers", f"model.pretrained={d}",
            f"model.resolution={RES}", f"sampler.num_steps={T}", "train.prompts_per_batch=2", "train.group_size=2",
            "train.num_iterations=2", f"train.prompts_file={d / 'edits.jsonl'}", f"eval.prompts_file={d / 'edits.jsonl'}",
            "eval.seeds_per_prompt=1", f"model.guidance_scale={g}", f"model.lora_rank={lora}",
            "train.lr=0.05" if lora else "train.lr=0.002", f"log.output_dir={run}",
            "reward.weights={clip_direction: 1.0}", f"reward.options={{clip_direction: {{model: {clip}}}}}",
            *(["model.max_sequence_length=16"] if kind == "kontext" else [])]


@pytest.mark.slow
@pytest.mark.parametrize("kind,lora", [("edit", 4), ("edit", 0), ("plus", 4), ("plus", 0), ("kontext", 4),
                                       ("kontext", 0)],
                         ids=["edit-lora", "edit-full", "plus-lora", "plus-full", "kontext-lora", "kontext-full"])
def test_cli_edit_run_exports_what_diffusers_reloads_and_samples(pipe_dirs, source_area, _processor, tmp_path,
                                                                  kind, lora):
    """``diffgrpo train`` on a JSONL of (source, instruction) pairs with the clip_direction reward (the source
    beside each sample) → ``diffgrpo export`` → the untouched pipeline with the exported LoRA / transformer samples
    the trained policy's latents; the sample table and the grids hold source and result side by side."""
    import diffusers
    from PIL import Image
    from safetensors.torch import load_file

    from diffgrpo.cli.app import main
    from diffgrpo.models.diffusers_adapter import build_diffusers_policy
    from tests.helpers.rewards import save_tiny_clip

    d, run = pipe_dirs[kind], tmp_path / "run"
    clip = save_tiny_clip(tmp_path / "clip")
    assert main(_cli_args(kind, d, clip, run, lora)) == 0
    rows = [json.loads(x) for x in (run / "samples").glob("eval_*.jsonl").__next__().read_text().splitlines()]
    recs = _records(d)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in recs]
    for r, rec in zip(rows, recs):  # the table: the source as the model saw it, beside the result
        src = np.asarray(Image.open(run / r["source_image"]).convert("RGB"))
        assert np.array_equal(src, np.asarray(Image.open(sources.of_record(rec)[0]).convert("RGB")))
        assert Image.open(run / r["image"]).size == (RES, RES) and r["rewards"]["clip_direction"] is not None
    grid = Image.open(run / "samples_end.png")
    th = round(128 * RES / (2 * RES + 2))  # a tile: source | result, 128 px wide
    assert grid.size == (2 * (128 + 4) + 4, 2 * (th + 28 + 4) + 4), grid.size  # 2 × 2 pair tiles (square: 128 high)
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    cfg = RunConfig.from_yaml(str(run / "config.yaml"), [])
    trained = build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    assert trained.row.name == {"edit": "qwenimage_edit", "plus": "qwenimage_edit_plus",
                                "kontext": "flux_kontext"}[kind]
    trained.load_state_dict(load_file(str(run / "weights.safetensors")))
    x = _noise(len(recs))
    g = GUIDANCE[kind]
    reference = _our_latents(trained, trained.pipeline, kind, recs, x, g)
    cls = getattr(diffusers, KINDS[kind][0])
    pipe = cls.from_pretrained(str(d))
    moved = float((_pipeline_latents(kind, pipe, recs, x, g) - reference).abs().max())
    if lora:
        pipe.load_lora_weights(str(out))
    else:
        pipe.transformer = type(pipe.transformer).from_pretrained(str(out))
    err = float((_pipeline_latents(kind, pipe, recs, x, g) - reference).abs().max())
    print(f"{kind} {'lora' if lora else 'full'}: training moved the latents by {moved:.2e}; "
          f"max |reloaded pipeline − trained| = {err:.2e}")
    assert moved > 1e-4 and err < 1e-4, (moved, err)


@pytest.mark.slow
def test_cli_sample_edits_the_given_source_image(pipe_dirs, tmp_path, capsys):
    """``diffgrpo sample --prompt TEXT --image SRC`` on an editing pipeline: the source conditions the samples (two
    sources, same prompt and seed → different images; the same source twice → the same image); without
    ``--image`` it is refused in one line naming it, and a link is refused as a prompt file's image is."""
    from PIL import Image

    from diffgrpo.cli.app import main

    d = pipe_dirs["kontext"]
    recs = _records(d)
    a, b = sources.of_record(recs[0])[0], sources.of_record(recs[1])[0]
    base = ["sample", "model.name=diffusers", f"model.pretrained={d}", f"model.resolution={RES}",
            f"sampler.num_steps={T}", f"model.guidance_scale={GUIDANCE['kontext']}", "model.max_sequence_length=16",
            "reward.weights={jpeg_compressibility: 1.0}",
            "--prompt", recs[0]["prompt"], "--num", "1", "--seed", "0", "--sde-type", "ode"]
    outs = []
    for i, src in enumerate((a, b, a)):
        out = tmp_path / f"s{i}.png"
        assert main([*base, "--image", src, "--out", str(out)]) == 0, capsys.readouterr().err
        outs.append(np.asarray(Image.open(out).convert("RGB")).astype(np.int16))
    assert np.array_equal(outs[0], outs[2]) and np.abs(outs[0] - outs[1]).max() > 0
    assert main([*base, "--out", str(tmp_path / "none.png")]) == 2
    assert "diffgrpo sample takes --image" in capsys.readouterr().err
    link = tmp_path / "link.png"
    link.symlink_to(a)
    assert main([*base, "--image", str(link), "--out", str(tmp_path / "l.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --image:") and "symbolic link" in err and err.count("\n") == 1, err  # before loading


@pytest.mark.slow
@pytest.mark.parametrize("engine", [["engine.name=retain"], ["engine.name=nft", "sampler.sde_type=ode"],
                                    ["engine.name=dgpo", "sampler.sde_type=ode"]], ids=["retain", "nft", "dgpo"])
def test_every_engine_trains_an_editing_model(pipe_dirs, tmp_path, engine):
    """The sources held in the conditioning reach every engine's forwards (retained graph, forward-process
    objectives with their reference / old-policy forwards): a LoRA run trains (its adapter leaves zero)."""
    from safetensors.torch import load_file

    from diffgrpo.cli.app import main

    d, run = pipe_dirs["kontext"], tmp_path / "run"
    args = [a for a in _cli_args("kontext", d, None, run, 4) if not a.startswith("reward.")]
    assert main([*args, "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}", *engine]) == 0
    sd = load_file(str(run / "weights.safetensors"))
    assert any("lora_B" in k for k in sd) and max(float(v.abs().max()) for k, v in sd.items() if "lora_B" in k) > 0
