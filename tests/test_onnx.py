"""ONNX in and out.

Import: models written without cmhsa (tests/third_party_vit.py: other names, channel-first
patches) are exported by both of torch's exporters and read back by structure; the references are
that independent PyTorch model and onnxruntime, never cmhsa's own models. Export: onnxruntime runs
the file and is compared with the PyTorch model as trained (the export path swaps in its own
written-out attention with the bias as a constant).

Tolerances: the same function in float32 computed in another order (another runtime, another
token layout, the exact conversion) differs by about 1e-7 relative to the largest logit; 1e-5
leaves a hundredfold margin and still catches any misplaced weight (errors of order 1).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from conftest import FIXTURE, conv_model, invoke, one_error_line
from convit_convert.api import load_checkpoint, save_checkpoint
from convit_convert.construct import convert_state_dict
from convit_convert.model import VisionTransformer
from convit_convert.options.conversion import ConversionSpec
from third_party_vit import TheirConvViT, export

TOL = 1e-5

VARIANTS = {
    "identity": {},  # in_chans = hidden_chans: identity patch embedding, K = 3
    "linear_even_k": {"hidden": 2, "k": 4},  # linear embedding; even K: F.pad / asymmetric pads
    "dilated_no_bias": {"dil": 2, "conv_bias": False, "depth": 3},
    "gemm_small_patch": {"flat_mlp": True, "hidden": 2, "p": 2, "img": (8, 12), "k": 5},
}


def rel(out: np.ndarray | torch.Tensor, ref: np.ndarray | torch.Tensor) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def their_logits(model: TheirConvViT, batch: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, model.chans, *model.img, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return x, model(x)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """exported(variant, exporter, opset=None) -> (their model, path), cached for the module."""
    folder = tmp_path_factory.mktemp("theirs")
    cache: dict[tuple, tuple[TheirConvViT, Path]] = {}

    def get(variant: str, exporter: str, opset: int | None = None, **extra: object):
        key = (variant, exporter, opset, tuple(sorted(extra.items())))
        if key not in cache:
            model = TheirConvViT(**{**VARIANTS[variant], **extra})
            path = folder / f"{variant}-{exporter}-{opset}-{len(cache)}.onnx"
            cache[key] = (model, export(model, path, exporter, opset))
        return cache[key]

    return get


# ---- import -------------------------------------------------------------------------------------


# the dynamo exporter takes seconds a graph: the default tier runs it on one variant, the full
# tier on every one (the legacy exporter, a tenth of a second, on every one in both)
def dynamo_in_full(combos: list[tuple], quick: tuple) -> list:
    return [
        pytest.param(*c, marks=pytest.mark.slow) if "dynamo" in c and c != quick else pytest.param(*c)
        for c in combos
    ]


@pytest.mark.parametrize(
    "variant, exporter",
    dynamo_in_full([(v, e) for v in VARIANTS for e in ("dynamo", "legacy")], ("identity", "dynamo")),
)
def test_import_reads_third_party_exports(exported, variant: str, exporter: str) -> None:
    their, path = exported(variant, exporter)
    ckpt = load_checkpoint(path)
    cfg, spec = ckpt.config, VARIANTS[variant]
    assert ckpt.kind == "conv" and ckpt.source == "onnx"
    assert cfg.img_size == spec.get("img", (16, 24)) and cfg.patch_size == spec.get("p", 4)
    assert (cfg.in_chans, cfg.hidden_chans) == (3, spec.get("hidden", 3))
    assert cfg.patch_embed == ("linear" if "hidden" in spec else "identity")
    assert (cfg.depth, cfg.kernel_size, cfg.dilation) == (
        spec.get("depth", 2),
        spec.get("k", 3),
        spec.get("dil", 1),
    )
    assert (cfg.mlp_hidden_dim, cfg.num_classes, cfg.norm_eps) == (40, 5, 1e-6)
    report = ckpt.import_report
    assert report["read"]["token layout"] == ["permuted"]  # channel-first patches, reordered
    assert report["onnxruntime_check"]["passed"] and report["onnxruntime_check"]["rel"] <= TOL
    assert report["onnxruntime_check"]["providers"] == ["CPUExecutionProvider"]
    if spec.get("flat_mlp"):
        assert "Gemm" in report["read"]["linear"]

    x, ref = their_logits(their, 3)
    with torch.no_grad():
        assert rel(ckpt.model()(x), ref) <= TOL
        plan = ConversionSpec().plan(cfg)
        state, attn_cfg = convert_state_dict(ckpt.tensors, plan), plan.config
        attn = VisionTransformer(attn_cfg)
        attn.load_state_dict(state)
        assert rel(attn.eval()(x), ref) <= TOL  # the attention model computes their conv model


def test_import_erf_gelu_from_opset_17(exported) -> None:
    their, path = exported("identity", "legacy", 17)
    ckpt = load_checkpoint(path)
    assert ckpt.import_report["read"]["gelu"] == ["Erf form"]
    assert ckpt.import_report["opsets"]["ai.onnx"] == 17
    x, ref = their_logits(their, 2)
    with torch.no_grad():
        assert rel(ckpt.model()(x), ref) <= TOL


@pytest.mark.parametrize("exporter", ["dynamo", "legacy"])
def test_round_trip_of_a_cmhsa_conv_model_is_bit_exact(tmp_path: Path, exporter: str) -> None:
    """cmhsa conv -> ONNX (cmhsa export) -> cmhsa conv: the same float32 numbers, same layout."""
    model = conv_model(dtype=torch.float32, img_size=(8, 12), in_chans=1, hidden_chans=3, kernel_size=4)
    src = tmp_path / "conv.safetensors"
    save_checkpoint(src, model.cfg, model.state_dict())
    r = invoke("export", src, "-o", tmp_path / "conv.onnx", "--exporter", exporter)
    assert r.exit_code == 0, r.output
    back = load_checkpoint(tmp_path / "conv.onnx")
    assert back.config == model.cfg
    assert back.import_report["read"]["token layout"] == ["cmhsa"]
    for name, t in model.state_dict().items():
        assert torch.equal(back.tensors[name], t), name


def test_cli_convert_verify_inspect_export_an_onnx_conv_model(exported, tmp_path: Path) -> None:
    their, path = exported("linear_even_k", "dynamo")
    vit = tmp_path / "vit.safetensors"
    r = invoke("convert", path, "-o", vit)
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())  # rich wraps lines at the terminal width
    assert "by its graph" in said and "onnxruntime vs the rebuilt PyTorch model" in said
    report = json.loads((tmp_path / "vit.report.json").read_text())
    assert report["input"]["read_as"] == "onnx"
    check = report["input"]["onnx_import"]["onnxruntime_check"]
    assert check["passed"] and check["providers"] == ["CPUExecutionProvider"]
    assert invoke("verify", path, vit).exit_code == 0
    r = invoke("inspect", path)
    assert r.exit_code == 0 and re.search(r"read as\W+onnx\b", r.output), r.output
    # and out again: onnxruntime on cmhsa's attention export vs their PyTorch conv model
    r = invoke("export", vit, "-o", tmp_path / "vit.onnx", "--exporter", "legacy")
    assert r.exit_code == 0, r.output
    session = ort.InferenceSession(str(tmp_path / "vit.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_providers() == ["CPUExecutionProvider"]
    for batch in (1, 3):
        x, ref = their_logits(their, batch)
        (out,) = session.run(["logits"], {"pixel_values": x.numpy()})
        assert rel(out, ref) <= TOL


def test_gemm_forms_and_a_fixed_batch(tmp_path: Path) -> None:
    """Gemm without transB, with alpha and beta; a graph exported for a fixed batch size."""
    their = TheirConvViT()
    path = export(their, tmp_path / "fixed.onnx", "legacy", dynamic=False)
    model = onnx.load(path)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2
    gemm = _first(model, "Gemm")
    inits = {t.name: t for t in model.graph.initializer}
    w, c = (onnx.numpy_helper.to_array(inits[gemm.input[i]]) for i in (1, 2))
    assert next(a.i for a in gemm.attribute if a.name == "transB") == 1
    inits[gemm.input[1]].CopyFrom(onnx.numpy_helper.from_array((w.T * 0.5).copy(), gemm.input[1]))
    inits[gemm.input[2]].CopyFrom(onnx.numpy_helper.from_array(c * 4, gemm.input[2]))
    for name, value in (("transB", 0), ("alpha", 2.0), ("beta", 0.25)):
        _set_attr(gemm, name, value)
    onnx.save(model, path)
    ckpt = load_checkpoint(path)
    assert ckpt.import_report["onnxruntime_check"]["batch"] == 2
    x, ref = their_logits(their, 3)
    with torch.no_grad():
        assert rel(ckpt.model()(x), ref) <= TOL


def test_phase2_starts_from_a_third_party_onnx_model(tmp_path: Path) -> None:
    their = TheirConvViT(img=(16, 16), depth=1, classes=10, mlp=192)
    path = export(their, tmp_path / "their.onnx", "legacy")
    r = invoke(
        "train",
        "phase2",
        "--init",
        path,
        *"--data synthetic --batch-size 32 --workers 0 --epochs 1 --warmup-epochs 0 --device cpu -o".split(),
        tmp_path / "p2",
    )
    assert r.exit_code == 0, r.output
    assert "verified: worst relative error" in r.output
    cfg = json.loads((tmp_path / "p2" / "config.json").read_text())
    assert cfg["init_info"]["init_kind"] == "conv" and cfg["model"]["num_heads"] == 9


def test_external_data_inside_the_folder_is_read(exported, tmp_path: Path) -> None:
    their, path = exported("identity", "legacy")
    model = onnx.load(path)
    ext = tmp_path / "model.onnx"
    onnx.save_model(model, ext, save_as_external_data=True, location="weights.bin", size_threshold=0)
    assert (tmp_path / "weights.bin").exists()
    x, ref = their_logits(their, 2)
    with torch.no_grad():
        assert rel(load_checkpoint(ext).model()(x), ref) <= TOL


# ---- bad ONNX input -----------------------------------------------------------------------------


def _set_attr(node: onnx.NodeProto, name: str, value: object) -> None:
    for a in list(node.attribute):
        if a.name == name:
            node.attribute.remove(a)
    node.attribute.append(onnx.helper.make_attribute(name, value))


def _first(model: onnx.ModelProto, op: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.op_type == op)


def _external(model: onnx.ModelProto, folder: Path, location: str) -> onnx.ModelProto:
    """The model with its largest initializer moved out to ``location``."""
    from onnx.external_data_helper import set_external_data

    t = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    data = t.raw_data
    (folder / "w.bin").write_bytes(data)
    set_external_data(t, location=location, length=len(data))
    t.ClearField("raw_data")
    t.data_location = onnx.TensorProto.EXTERNAL
    return model


def make_bad(kind: str, src: Path, folder: Path, outside: Path) -> Path:
    data = src.read_bytes()
    model = onnx.load(src)
    path = folder / "bad.onnx"
    if kind == "empty":
        data = b""
    elif kind == "garbage":
        data = b"not an onnx file\x00\xff" * 20
    elif kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "ir_version":
        model.ir_version = 99
    elif kind == "opset":
        model.opset_import[0].version = 999
    elif kind == "checker":
        model.graph.node[3].input[0] = "undefined_tensor"
    elif kind == "dynamic_hw":
        model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "height"
    elif kind == "ext_parent":
        _external(model, folder, "../w.bin")
        (outside / "w.bin").write_bytes((folder / "w.bin").read_bytes())
    elif kind == "ext_absolute":
        _external(model, folder, str(folder / "w.bin"))
    elif kind == "ext_link":
        _external(model, folder, "w.bin")
        (outside / "w.bin").write_bytes((folder / "w.bin").read_bytes())
        (folder / "w.bin").unlink()
        os.symlink(outside / "w.bin", folder / "w.bin")
    elif kind == "ext_missing":
        _external(model, folder, "w.bin")
        (folder / "w.bin").unlink()
    elif kind == "ext_short":
        _external(model, folder, "w.bin")
        (folder / "w.bin").write_bytes(b"\x00" * 8)
    elif kind == "stride":  # stride 2 with pads that keep the shape, so the checker passes
        conv = _first(model, "Conv")
        _set_attr(conv, "strides", [2, 2])
        _set_attr(conv, "pads", [9, 13, 8, 12])
    elif kind == "pads":  # same total padding, wrong side: not 'same'
        _set_attr(_first(model, "Conv"), "pads", [2, 2, 0, 0])
    elif kind == "groups":
        conv = _first(model, "Conv")
        w = next(t for t in model.graph.initializer if t.name == conv.input[1])
        half = onnx.numpy_helper.to_array(w)[:, :1].copy()
        w.CopyFrom(onnx.numpy_helper.from_array(half, w.name))
        _set_attr(conv, "group", 3)
    if kind.startswith(("ext_", "ir_", "opset", "checker", "dynamic", "stride", "pads", "groups")):
        data = model.SerializeToString()
    path.write_bytes(data)
    return path


BAD = {
    "empty": "file is empty",
    "garbage": "not a readable ONNX file",
    "truncated": "not a readable ONNX file",
    "ir_version": "ir_version 99",
    "opset": "cannot run it",
    "checker": "onnx.checker",
    "dynamic_hw": "static C, H and W",
    "ext_parent": "leaves the model's folder",
    "ext_absolute": "absolute path",
    "ext_link": "links outside",
    "ext_missing": "does not exist",
    "ext_short": "past the end",
    "stride": "strides [2, 2]",
    "pads": "pads [2, 2, 0, 0]",
    "groups": "groups 3",
}


def assert_bad(result, path: Path, expect: str, out_dir: Path) -> None:
    one_error_line(result, 2, str(path), expect)
    assert not list(out_dir.iterdir()), "nothing may be written"


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_onnx_files(exported, kind: str, tmp_path: Path) -> None:
    _, src = exported("identity", "legacy")
    folder, outside, out_dir = tmp_path / "model", tmp_path / "elsewhere", tmp_path / "out"
    for f in (folder, outside, out_dir):
        f.mkdir()
    bad = make_bad(kind, src, folder, outside)
    assert_bad(invoke("convert", bad, "-o", out_dir / "vit.safetensors"), bad, BAD[kind], out_dir)
    if kind in ("stride", "pads", "groups"):
        assert "node '" in invoke("inspect", bad).stderr  # names the Conv node


@pytest.mark.parametrize(
    ("variant", "exporter", "opset", "extra", "expect"),
    [
        ("identity", "legacy", 16, {}, "decomposed"),  # LayerNorm as ReduceMean/Sub/Pow/...
        ("identity", "dynamo", None, {"act": "relu"}, "(Relu): unexpected here; expected GELU"),
        ("identity", "legacy", None, {"act": "tanh"}, "tanh-approximate"),
    ],
)
def test_graphs_that_are_not_conv_phase_vits(
    exported, tmp_path, variant, exporter, opset, extra, expect
) -> None:
    _, path = exported(variant, exporter, opset, **extra)
    assert_bad(invoke("convert", path, "-o", tmp_path / "vit.safetensors"), path, expect, tmp_path)


def test_attention_onnx_is_refused(fixture_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert invoke("convert", fixture_path, "-o", tmp_path / "vit.safetensors").exit_code == 0
    assert (
        invoke(
            "export", tmp_path / "vit.safetensors", "-o", tmp_path / "vit.onnx", "--exporter", "legacy"
        ).exit_code
        == 0
    )
    assert_bad(
        invoke("convert", tmp_path / "vit.onnx", "-o", out / "x.safetensors"),
        tmp_path / "vit.onnx",
        "this is an attention model (its token mixers are Softmax attention, not Conv)",
        out,
    )
    # eval runs a file cmhsa exported as shipped (tests/test_eval_models.py); without the metadata
    # that says so, it is an ONNX graph to import, and an attention graph cannot be
    import onnx

    bare = onnx.load(str(tmp_path / "vit.onnx"))
    del bare.metadata_props[:]
    onnx.save(bare, str(tmp_path / "bare.onnx"))
    for args in (
        ["eval", tmp_path / "bare.onnx", "--data", "digits"],
        ["verify", FIXTURE, tmp_path / "vit.onnx"],
    ):
        r = invoke(*args)  # the fix named is the same whatever the command: never "convert takes ..."
        assert r.exit_code == 2 and "the .safetensors this graph was exported from" in r.stderr, r.stderr


def test_import_that_disagrees_with_onnxruntime_is_refused(exported, tmp_path: Path, monkeypatch) -> None:
    import convit_convert.onnx.importer as oi

    real = oi.to_checkpoint

    def off_by_a_little(structure, path):
        cfg, tensors, layout = real(structure, path)
        tensors["head.bias"] = tensors["head.bias"] + 1e-3
        return cfg, tensors, layout

    monkeypatch.setattr(oi, "to_checkpoint", off_by_a_little)
    _, path = exported("identity", "legacy")
    assert_bad(
        invoke("convert", path, "-o", tmp_path / "v.safetensors"),
        path,
        "disagrees with onnxruntime",
        tmp_path,
    )


# ---- export -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def attn_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """Converted attention checkpoints of a non-square model, with and without sinks, with
    non-zero W_Q, W_K (so the export's q·k path is exercised)."""
    folder = tmp_path_factory.mktemp("attn")
    conv = conv_model(dtype=torch.float32, img_size=(8, 12), kernel_size=3)
    paths = {}
    for sink in (True, False):
        plan = ConversionSpec(sink=sink, qk_init_std=0.05).plan(conv.cfg)
        state, cfg = convert_state_dict(conv.state_dict(), plan), plan.config
        paths[sink] = folder / f"vit-{sink}.safetensors"
        save_checkpoint(paths[sink], cfg, state)
    return paths


@pytest.mark.parametrize(
    "sink, exporter, form",
    dynamo_in_full(
        [(s, e, f) for s in (True, False) for e in ("dynamo", "legacy") for f in ("fused", "trained")],
        (True, "dynamo", "fused"),
    ),
)
def test_export_attention(attn_checkpoints, tmp_path: Path, sink: bool, exporter: str, form: str) -> None:
    """Both forms against the checkpoint's PyTorch model in onnxruntime; fused is the default."""
    src = attn_checkpoints[sink]
    out = tmp_path / "vit.onnx"
    r = invoke(
        "export", src, "-o", out, "--exporter", exporter, *(["--form", form] if form != "fused" else [])
    )
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vit.onnx", "vit.onnx.report.json"]  # one file
    report = json.loads((tmp_path / "vit.onnx.report.json").read_text())
    assert report["passed"] and report["export"]["exporter"] == exporter and report["export"]["form"] == form
    assert [b["batch"] for b in report["check"]["batches"]] == [1, 3]
    assert report["check"]["providers"] == ["CPUExecutionProvider"]
    assert report["output"]["bytes"] == out.stat().st_size

    model = onnx.load(out)
    onnx.checker.check_model(model, full_check=True)
    assert all(t.data_location == onnx.TensorProto.DEFAULT for t in model.graph.initializer)
    assert [i.name for i in model.graph.input] == ["pixel_values"]
    assert [o.name for o in model.graph.output] == ["logits"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch_size"
    ckpt = load_checkpoint(src)
    h, n = ckpt.config.num_heads, ckpt.config.num_patches
    shapes = {tuple(t.dims) for t in model.graph.initializer}
    if form == "trained":  # the gathered bias (and sink column): a constant
        assert (1, h, n, n + int(sink)) in shapes
    else:  # the same, keys padded to a multiple of 8; W_V·W_O folded: (h · d̃, d), d̃ = d + 1 aligned
        d = ckpt.config.embed_dim
        assert (h, n, -(-(n + int(sink)) // 8) * 8) in shapes and (h * (-(-(d + 1) // 8) * 8), d) in shapes

    torch_model = ckpt.model()
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = torch.randn(2, 3, 8, 12, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = torch_model(x)
    (got,) = session.run(["logits"], {"pixel_values": x.numpy()})
    assert got.shape == (2, 5) and rel(got, ref) <= TOL


def test_export_outside_tolerance_exits_1_and_writes_no_model(
    attn_checkpoints, tmp_path, monkeypatch
) -> None:
    import convit_convert.onnx.export as oe

    real = oe.prepare_for_export

    def broken(model):
        model = real(model)
        with torch.no_grad():
            model.head.bias += 0.5
        return model

    monkeypatch.setattr(oe, "prepare_for_export", broken)
    out = tmp_path / "vit.onnx"
    r = invoke("export", attn_checkpoints[True], "-o", out, "--exporter", "legacy", "--form", "trained")
    assert r.exit_code == 1 and "FAIL" in r.output
    assert not out.exists()
    report = json.loads((tmp_path / "vit.onnx.report.json").read_text())
    assert report["passed"] is False and report["output"] is None
    assert all(not b["passed"] for b in report["check"]["batches"])


def test_export_bad_input(attn_checkpoints, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    src = attn_checkpoints[True]
    out = tmp_path / "out"
    out.mkdir()
    capfd.readouterr()
    r = invoke("export", src, "-o", out / "v.onnx", "--exporter", "legacy", "--opset", "99")
    one_error_line(r, 2, "failed: Unsupported onnx_opset_version: 99")
    assert capfd.readouterr() == ("", ""), "the exporter's own dump must not reach the terminal"
    for args, expect in (
        (["--opset", "16"], "--opset must be 17 ≤ x ≤ 99, got 16"),
        (["--exporter", "jit"], "--exporter"),
        (["--form", "onnx"], "--form must be one of fused, trained, got 'onnx'"),
        (["--device", "tpu"], "--device"),
    ):
        r = invoke("export", src, "-o", out / "v.onnx", *args)
        one_error_line(r, 2, expect)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        r = invoke("export", src, "-o", out / "v.onnx", "--device", "cuda")
        assert r.exit_code == 2 and "CUDAExecutionProvider" in r.stderr
    r = invoke("export", tmp_path / "missing.safetensors", "-o", out / "v.onnx")
    assert r.exit_code == 2 and "no such file" in r.stderr
    r = invoke("export", src, "-o", tmp_path / "nowhere" / "v.onnx")
    assert r.exit_code == 2 and "does not exist" in r.stderr
    assert not list(out.iterdir())
