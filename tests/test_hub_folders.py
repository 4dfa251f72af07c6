"""A folder cmhsa shares, as transformers users take it and hand it back: it runs in a Python
where cmhsa, timm and torchvision cannot be imported; what transformers' ``save_pretrained`` writes
(model and processor) comes back to cmhsa (``predict`` and ``eval`` as on the original, ``export``,
``train --init``); the fine-tuning example of docs/sharing.md runs; a config.json that does not
describe its weights is refused before the size it claims is allocated; a folder whose model code is
not the file cmhsa ships is said to be so."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import FIXTURE, ROOT, invoke, randomize
from convit_convert.api import save_checkpoint
from convit_convert.api.predict import predict_files
from convit_convert.config import ViTConfig
from convit_convert.io.report import sha256_file
from convit_convert.io.timm_folder import MODELING, SHIPPED
from convit_convert.labels import KEY
from convit_convert.model import VisionTransformer
from convit_convert.options.operations import PredictOptions

pytest.importorskip("transformers")  # the dev extra installs it
from convit_convert.shipped import modeling_cmhsa as hub

DIGITS = sorted((FIXTURE.parent / "digits").glob("*.png"))
# the gates the issue measured on: outside [0, 1] on both sides, its ends, and inside
GATES = (-0.05, 0.3, 1.1, 0.0, 1.0, 0.7, -0.2, 0.5, 1.3)


def gated_folder(tmp_path: Path) -> Path:
    """The shipped digits model converted with gated pinning, its gates set to GATES, exported."""
    vit = tmp_path / "vit.safetensors"
    assert invoke("convert", FIXTURE, "--pinning", "gated", "-o", vit).exit_code == 0
    from convit_convert.api import load_checkpoint

    ckpt = load_checkpoint(vit)
    tensors = dict(ckpt.tensors)
    for name in tensors:
        if name.endswith(".attn.gate"):
            tensors[name] = torch.tensor(GATES, dtype=tensors[name].dtype)
    save_checkpoint(vit, ckpt.config, tensors, ckpt.metadata)
    assert invoke("export", vit, "--format", "timm", "-o", tmp_path / "share").exit_code == 0
    return tmp_path / "share"


def eval_rows(output: str) -> list[str]:
    """eval's table rows (kind, top-1, loss), without the header naming the file."""
    return [line for line in output.splitlines() if line.startswith("│")]


@pytest.mark.slow  # the full tier's: the default tier's time (3 minutes on 2 cores)
def test_what_transformers_saves_cmhsa_reads(tmp_path: Path) -> None:
    """The shipped classes' save_pretrained (model and processor) on a cmhsa folder: predict and
    eval give the original folder's numbers, export makes ONNX of it, train --init continues it
    and the new card names it as the start."""
    share = gated_folder(tmp_path)
    saved = tmp_path / "saved"
    hub.CmhsaForImageClassification.from_pretrained(share).save_pretrained(saved)
    hub.CmhsaImageProcessor.from_pretrained(share).save_pretrained(saved)
    doc = json.loads((saved / "config.json").read_text())
    assert doc["architectures"] == ["CmhsaForImageClassification"] and doc["model_type"] == "cmhsa"
    assert (saved / "preprocessor_config.json").exists()
    options = PredictOptions(top_k=3, device="cpu")
    want = [p.top for p in predict_files(share, DIGITS, options).predictions]
    got = [p.top for p in predict_files(saved, DIGITS, options).predictions]
    assert got == want
    before, after = (invoke("eval", folder, "--data", "digits") for folder in (share, saved))
    assert before.exit_code == after.exit_code == 0, after.output
    assert eval_rows(after.output) == eval_rows(before.output) and eval_rows(after.output)
    r = invoke("export", saved, "-o", tmp_path / "saved.onnx")
    assert r.exit_code == 0, r.output
    flags = ["--data", "digits", "--epochs", "1", "--batch-size", "64", "--device", "cpu"]
    r = invoke("train", "phase2", "--init", saved, *flags, "-o", tmp_path / "again")
    assert r.exit_code == 0, r.output
    r = invoke("export", tmp_path / "again" / "vit.safetensors", "--format", "timm", "-o", tmp_path / "t")
    assert r.exit_code == 0, r.output
    made = (tmp_path / "t" / "README.md").read_text().split("## How it was made", 1)[1].split("##")[0]
    assert f"- Start: `saved` (sha256 `{sha256_file(saved / 'model.safetensors')}`)" in made


def test_a_folder_whose_model_code_is_not_cmhsas_is_said_so(tmp_path: Path, monkeypatch) -> None:
    """inspect, predict, eval and train --init each say, in one note, that the folder's
    modeling_cmhsa.py is not the file this cmhsa ships (which release shipped it, where one did):
    transformers runs it; cmhsa never does."""
    from convit_convert.io import timm_folder

    share = tmp_path / "share"
    assert invoke("export", FIXTURE, "--format", "timm", "-o", share).exit_code == 0
    code = share / MODELING
    code.write_text(SHIPPED.read_text() + "\nimport os; os.system('echo pwned')\n")
    flags = ["--data", "digits", "--epochs", "1", "--device", "cpu"]
    for args in (
        ("inspect", share),
        ("predict", share, DIGITS[0]),
        ("eval", share, "--data", "digits"),
        ("train", "phase1", "--init", share, *flags, "-o", tmp_path / "run"),
    ):
        r = invoke(*args)
        assert r.exit_code == 0, r.output
        notes = [line for line in r.output.splitlines() if "is not the file this cmhsa" in line]
        assert len(notes) == 1, (args[0], r.output)
        assert notes[0].startswith("note: ") and "no cmhsa release shipped this file" in notes[0]
        assert "cmhsa never runs it" in notes[0]
    import hashlib

    old = {hashlib.sha256(code.read_bytes()).hexdigest(): "0.1.0"}
    monkeypatch.setattr(timm_folder, "SHIPPED_BEFORE", old)
    r = invoke("inspect", share)
    assert "it is the file cmhsa 0.1.0 shipped" in r.output
    shutil.copyfile(SHIPPED, code)
    assert "is not the file" not in invoke("inspect", share).output


# In the child: neither cmhsa nor timm nor torchvision can be imported (None in sys.modules: what
# an absent package looks like to `import` and to transformers' find_spec checks), so a Hub user
# with torch, transformers and Pillow alone. It loads each folder as they load it, saves one back
# with save_pretrained, builds the default config's model, and refuses an option value; it writes
# what it found as JSON.
CHILD = r"""
import json, resource, sys
for absent in ("convit_convert", "timm", "torchvision"):
    sys.modules[absent] = None
try:
    import convit_convert
    sys.exit("convit_convert imported")
except ImportError:
    pass
import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageClassification, pipeline
job = json.load(open(sys.argv[1]))
out = {"folders": {}}
for name, folder in job["folders"].items():
    model, info = AutoModelForImageClassification.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True
    )
    x = torch.load(job["inputs"][name])
    with torch.no_grad():
        logits = model.eval()(pixel_values=x).logits
    classify = pipeline("image-classification", model=folder, trust_remote_code=True, device="cpu")
    said = [[(o["label"], o["score"]) for o in classify(Image.open(p), top_k=3)] for p in job["images"]]
    info = {k: list(v) for k, v in info.items()}
    out["folders"][name] = {"info": info, "logits": logits.tolist(), "said": said}
    if name == job["save"]:
        model.save_pretrained(job["saved"])
        AutoImageProcessor.from_pretrained(folder, trust_remote_code=True).save_pretrained(job["saved"])
config = AutoConfig.from_pretrained(job["save_from"], trust_remote_code=True)
out["default"] = type(config)().to_dict()["model_args"]["cmhsa_config"]
try:
    type(config)(pinning="soft")
except ValueError as e:
    out["refused"] = str(e)
json.dump(out, open(sys.argv[2], "w"))
"""


def in_transformers_alone(tmp_path: Path, job: dict, script: str = CHILD) -> subprocess.CompletedProcess:
    """``script`` in a Python where cmhsa, timm and torchvision cannot be imported, transformers'
    caches in ``tmp_path``, offline, outside the repository (its convit_convert/ is not on the path)."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "job.json"), str(tmp_path / "out.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_a_folder_runs_in_transformers_without_cmhsa_and_comes_back(tmp_path: Path) -> None:
    """Both phases' folders (a conv one; attention with sink and hard pinning, without sink and
    gated; class names or none): AutoModelForImageClassification loads every tensor (no missing or
    unexpected key) and gives cmhsa's logits to 1e-5; the pipeline gives ``cmhsa predict``'s
    labels and probabilities to 1e-5. A folder saved there with save_pretrained gives cmhsa the
    same predictions; the default config is the paper's model; a value it lacks is refused."""
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
        torch.manual_seed(i)
        model = randomize(VisionTransformer(cfg), i).eval()
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
    job = {
        "folders": folders,
        "inputs": inputs,
        "images": [str(p) for p in images],
        "save": "attn-nosink-gated",
        "saved": str(tmp_path / "saved"),
        "save_from": folders["conv"],
    }
    r = in_transformers_alone(tmp_path, job)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    for name, (logits, said) in expected.items():
        info = out["folders"][name]["info"]
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        got = torch.tensor(out["folders"][name]["logits"])
        assert ((got - logits).abs().max() / logits.abs().max()).item() <= 1e-5, name
        for theirs, ours in zip(out["folders"][name]["said"], said, strict=True):
            assert [n for n, _ in theirs] == [n for n, _ in ours], name
            assert [q for _, q in theirs] == pytest.approx([q for _, q in ours], abs=1e-5), name
    back = predict_files(tmp_path / "saved", images, PredictOptions(top_k=3, device="cpu")).predictions
    assert [[(n, q) for n, _, q in p.top] for p in back] == expected["attn-nosink-gated"][1]
    paper = ViTConfig.build().with_attention(9).to_dict()
    assert out["default"] == {**paper, "num_classes": 100}
    assert "pinning 'soft' is not one of hard, gated" in out["refused"]


@pytest.mark.slow
def test_the_fine_tuning_example_runs_and_comes_back(tmp_path: Path) -> None:
    """docs/sharing.md's example, run as a Hub user runs it (no cmhsa, timm or torchvision), then
    `cmhsa eval` on the folder it saved."""
    text = (ROOT / "docs" / "sharing.md").read_text(encoding="utf-8")
    code = re.search(r"<!-- snippet: fine-tune -->\n```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
    assert invoke("export", FIXTURE, "--format", "timm", "-o", tmp_path / "runs" / "share").exit_code == 0
    shutil.copytree(FIXTURE.parent / "digits", tmp_path / "fixtures" / "digits")
    script = (
        "import sys\nfor m in ('convit_convert', 'timm', 'torchvision'):\n    sys.modules[m] = None\n" + code
    )
    r = in_transformers_alone(tmp_path, {}, script)
    assert r.returncode == 0, r.stderr[-3000:]
    r = invoke("eval", tmp_path / "runs" / "tuned", "--data", "digits")
    assert r.exit_code == 0 and eval_rows(r.output), r.output


MEMORY_CHILD = r"""
import json, resource, sys
from transformers import AutoModelForImageClassification
job = json.load(open(sys.argv[1]))
AutoModelForImageClassification.from_pretrained(job["good"], trust_remote_code=True)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    AutoModelForImageClassification.from_pretrained(job["bad"], trust_remote_code=True)
    said = None
except Exception as e:
    said = f"{type(e).__name__}: {e}"
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
json.dump({"said": said, "grew_kib": grew}, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_a_config_that_does_not_describe_the_weights_fails_before_allocating(tmp_path: Path) -> None:
    """mlp_hidden_dim 4,000,000 in the config.json of a 2-block model: 3 GB of MLP weights the file
    does not hold. from_pretrained refuses it before filling any of it: the process grows by less
    than 100 MiB (transformers alone initialises the 3 GB, then refuses)."""
    cfg = ViTConfig.build(img_size=16, patch_size=4, in_chans=1, depth=2, num_classes=3).with_attention(9)
    model = VisionTransformer(cfg)
    save_checkpoint(tmp_path / "m.safetensors", cfg, model.state_dict())
    assert (
        invoke("export", tmp_path / "m.safetensors", "--format", "timm", "-o", tmp_path / "good").exit_code
        == 0
    )
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    doc = json.loads((tmp_path / "bad" / "config.json").read_text())
    doc["model_args"]["cmhsa_config"]["mlp_hidden_dim"] = 4_000_000
    (tmp_path / "bad" / "config.json").write_text(json.dumps(doc))
    r = in_transformers_alone(
        tmp_path, {"good": str(tmp_path / "good"), "bad": str(tmp_path / "bad")}, MEMORY_CHILD
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert (out["said"] is not None and "mismatch" in out["said"].lower()) or "does not describe" in out[
        "said"
    ]
    assert out["grew_kib"] < 100 * 1024, out
