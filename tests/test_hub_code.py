"""The model a timm folder carries for transformers (convit_convert/shipped/modeling_cmhsa.py), held
to cmhsa's own model: the same parameter names and logits to float32 rounding for both kinds and
every option (sink on and off, hard and gated pinning, grey and colour, linear and identity patch
embedding, non-square images), its image processor the same pixels as ``cmhsa predict``'s, its
imports torch and transformers alone; and, in a Python where cmhsa, timm and torchvision cannot
be imported, the folder runs in transformers (``trust_remote_code=True``) as cmhsa runs it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import FIXTURE, ROOT, invoke, randomize
from convit_convert.api import save_checkpoint
from convit_convert.api.predict import predict_files
from convit_convert.config import ViTConfig
from convit_convert.io.timm_folder import AUTO_MAP, MODELING, SHIPPED, timm_config
from convit_convert.labels import KEY
from convit_convert.model import VisionTransformer
from convit_convert.options.operations import PredictOptions

pytest.importorskip("transformers")  # the dev extra installs it
from convit_convert.shipped import modeling_cmhsa as hub

DIGITS = sorted((FIXTURE.parent / "digits").glob("*.png"))

# (name, config): every option the shipped model has a branch for
CASES = {
    "conv, grey, linear embedding": ViTConfig.build(
        img_size=(12, 8), patch_size=4, in_chans=1, hidden_chans=2, depth=2, num_classes=5, kernel_size=5
    ),
    "conv, colour, identity, dilated": ViTConfig.build(
        img_size=8, patch_size=2, in_chans=3, depth=1, num_classes=7, kernel_size=3, dilation=2
    ),
    "attn, sink, hard": ViTConfig.build(
        img_size=(12, 8), patch_size=4, in_chans=3, depth=2, num_classes=5
    ).with_attention(9, qk_dim=8, v_dim=12, sink=True, pinning="hard"),
    "attn, no sink, gated": ViTConfig.build(
        img_size=8, patch_size=4, in_chans=1, hidden_chans=3, depth=2
    ).with_attention(4, qk_dim=6, v_dim=48, sink=False, pinning="gated"),
    "attn, sink, gated": ViTConfig.build(
        img_size=8, patch_size=4, in_chans=3, depth=1, num_classes=3
    ).with_attention(9, sink=True, pinning="gated"),
}


def cmhsa_model(cfg: ViTConfig, seed: int = 0) -> VisionTransformer:
    """cmhsa's model of ``cfg``, every parameter non-trivial (gates inside (0, 1), sinks nonzero)."""
    torch.manual_seed(seed)
    model = randomize(VisionTransformer(cfg), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.8 + 0.1)
            elif name.endswith((".sink", "rel_pos_bias", "content_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 2)
    return model.eval()


def shipped_model(cfg: ViTConfig, state: dict[str, torch.Tensor]) -> hub.CmhsaForImageClassification:
    """The shipped model from config.json as cmhsa writes it, the weights loaded strictly."""
    config = hub.CmhsaConfig(**json.loads(json.dumps(timm_config(cfg))))
    model = hub.CmhsaForImageClassification(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_the_shipped_model_computes_cmhsas_function(case: str) -> None:
    """Logits within 1e-5 of the largest (float32 rounding: the shipped attention gathers its bias
    and sums its heads in another order), on images of the model's channels and, for a grey
    model, on RGB (its luma)."""
    cfg = CASES[case]
    ours = cmhsa_model(cfg)
    theirs = shipped_model(cfg, ours.state_dict())
    g = torch.Generator().manual_seed(3)
    for chans in {cfg.in_chans, 3}:
        x = torch.randn(4, chans, *cfg.img_size, generator=g)
        with torch.no_grad():
            want, got = ours(x), theirs(pixel_values=x).logits
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, case


def test_a_change_to_cmhsas_model_fails_here() -> None:
    """The check above can fail: a model whose sink the shipped file ignores differs."""
    cfg = CASES["attn, sink, hard"]
    ours = cmhsa_model(cfg)
    theirs = shipped_model(cfg, ours.state_dict())
    theirs.blocks[0].attn.sink = None  # as if cmhsa had added a term the file does not know
    x = torch.randn(2, 3, *cfg.img_size)
    with torch.no_grad():
        assert (theirs(pixel_values=x).logits - ours(x)).abs().max() > 1e-3


def test_the_shipped_processor_gives_cmhsa_predicts_pixels(tmp_path: Path) -> None:
    """timm's evaluation transform (what ``cmhsa predict`` runs), pixel for pixel, on grey and
    colour images smaller, larger and of other shapes than the model's, for square and non-square
    models."""
    from convit_convert.data import build_transform

    shapes = [(5, 9), (40, 17), (8, 8), (31, 64), (100, 100)]
    for size, chans in (((28, 28), 1), ((12, 8), 3), ((32, 32), 3)):
        cfg = ViTConfig.build(img_size=size, patch_size=4, in_chans=chans)
        processor = hub.CmhsaImageProcessor(pretrained_cfg=timm_config(cfg)["pretrained_cfg"])
        transform = build_transform(cfg.img_size, False, None, chans)
        g = torch.Generator().manual_seed(0)
        for w, h in shapes:
            pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
            image = Image.fromarray(pixels, "RGB")
            want = transform(image.convert("L" if chans == 1 else "RGB"))
            got = processor(image)["pixel_values"][0]
            assert torch.equal(got, want), (size, chans, (w, h))


def test_the_shipped_file_imports_torch_and_transformers_alone() -> None:
    """Code others run: no import beyond torch and transformers, no file, process or network call,
    nothing evaluated."""
    tree = ast.parse(SHIPPED.read_text(encoding="utf-8"))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots <= {"__future__", "torch", "transformers"}, roots
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"open", "exec", "eval", "compile", "__import__", "input", "breakpoint"}, called
    assert SHIPPED.name == MODELING and set(AUTO_MAP.values()) <= {
        f"modeling_cmhsa.{c}" for c in ("CmhsaConfig", "CmhsaForImageClassification", "CmhsaImageProcessor")
    }
    assert hub.CmhsaConfig.model_type == "cmhsa"


# In the child: neither cmhsa nor timm nor torchvision can be imported (None in sys.modules: what
# an absent package looks like to `import` and to transformers' find_spec checks), so a Hub user
# with torch, transformers and Pillow alone; each folder is loaded as they load it. It writes what
# it found as JSON.
CHILD = r"""
import json, sys
for absent in ("convit_convert", "timm", "torchvision"):
    sys.modules[absent] = None
try:
    import convit_convert
    sys.exit("convit_convert imported")
except ImportError:
    pass
import torch
from PIL import Image
from transformers import AutoModelForImageClassification, pipeline
job = json.load(open(sys.argv[1]))
out = {}
for name, folder in job["folders"].items():
    model, info = AutoModelForImageClassification.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True
    )
    x = torch.load(job["inputs"][name])
    with torch.no_grad():
        logits = model.eval()(pixel_values=x).logits
    classify = pipeline("image-classification", model=folder, trust_remote_code=True, device="cpu")
    said = [[(o["label"], o["score"]) for o in classify(Image.open(p), top_k=3)] for p in job["images"]]
    out[name] = {"info": {k: list(v) for k, v in info.items()}, "logits": logits.tolist(), "said": said}
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_a_folder_runs_in_transformers_without_cmhsa(tmp_path: Path) -> None:
    """Both phases' folders (a conv one; attention with sink and hard pinning, without sink and
    gated; class names or none): AutoModelForImageClassification loads every tensor (no missing or
    unexpected key) and gives cmhsa's logits to 1e-5; the pipeline gives ``cmhsa predict``'s
    labels and probabilities to 1e-5."""
    folders, inputs, expected = {}, {}, {}
    images = DIGITS[:3]
    for i, (name, cfg) in enumerate(
        {
            "conv": ViTConfig.build(
                img_size=32, patch_size=4, in_chans=1, hidden_chans=3, depth=2, num_classes=10
            ),
            "attn-sink-hard": ViTConfig.build(
                img_size=32, patch_size=4, in_chans=3, depth=1, num_classes=10
            ).with_attention(9, qk_dim=8, v_dim=48, sink=True, pinning="hard"),
            "attn-nosink-gated": ViTConfig.build(
                img_size=(32, 16), patch_size=8, in_chans=1, hidden_chans=1, depth=2
            ).with_attention(9, sink=False, pinning="gated"),
        }.items()
    ):
        model = cmhsa_model(cfg, seed=i).float()
        names = {KEY: json.dumps([f"class {c}" for c in range(cfg.num_classes)])} if i != 1 else {}
        save_checkpoint(tmp_path / f"{name}.safetensors", cfg, model.state_dict(), names)
        r = invoke("export", tmp_path / f"{name}.safetensors", "--format", "timm", "-o", tmp_path / name)
        assert r.exit_code == 0, r.output
        assert (tmp_path / name / MODELING).read_bytes() == SHIPPED.read_bytes()
        x = torch.randn(2, cfg.in_chans, *cfg.img_size, generator=torch.Generator().manual_seed(i))
        torch.save(x, tmp_path / f"{name}.pt")
        with torch.no_grad():
            logits = model(x)
        predicted = predict_files(
            tmp_path / f"{name}.safetensors", images, PredictOptions(top_k=3, device="cpu")
        )
        folders[name], inputs[name] = str(tmp_path / name), str(tmp_path / f"{name}.pt")
        expected[name] = (logits, [[(n, q) for n, _, q in p.top] for p in predicted.predictions])
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"folders": folders, "inputs": inputs, "images": [str(p) for p in images]}))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(job), str(tmp_path / "out.json")],
        cwd=tmp_path,  # not the repository: its convit_convert/ is not on the path
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    for name, (logits, said) in expected.items():
        info = out[name]["info"]
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        got = torch.tensor(out[name]["logits"])
        assert ((got - logits).abs().max() / logits.abs().max()).item() <= 1e-5, name
        for theirs, ours in zip(out[name]["said"], said, strict=True):
            assert [n for n, _ in theirs] == [n for n, _ in ours], name
            assert [q for _, q in theirs] == pytest.approx([q for _, q in ours], abs=1e-5), name


def test_the_timm_route_still_reads_the_folder(tmp_path: Path) -> None:
    """What worked before the shipped file keeps working from the same folder: timm's local-dir:
    (after ``import convit_convert.timm``), ``cmhsa predict`` and ``cmhsa eval``."""
    import timm

    import convit_convert.timm  # noqa: F401

    assert invoke("export", FIXTURE, "--format", "timm", "-o", tmp_path / "t").exit_code == 0
    model = timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True)
    assert model.num_classes == 10
    assert invoke("predict", tmp_path / "t", DIGITS[0]).exit_code == 0
    assert invoke("eval", tmp_path / "t", "--data", "digits").exit_code == 0
    assert ROOT.exists()
