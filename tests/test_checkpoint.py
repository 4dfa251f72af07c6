"""The file format of docs/FORMAT.md, written here independently with plain safetensors/torch."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import conv_model
from convit_convert.api import load_checkpoint, save_checkpoint
from convit_convert.errors import CmhsaError
from convit_convert.options.operations import Geometry

DOC_CONFIG = {  # exactly the keys docs/FORMAT.md requires of a conv checkpoint
    "img_size": [12, 8],
    "patch_size": 4,
    "in_chans": 3,
    "hidden_chans": 3,
    "embed_dim": 48,
    "patch_embed": "identity",
    "depth": 2,
    "mlp_hidden_dim": 192,
    "num_classes": 5,
    "norm_eps": 1e-6,
    "kernel_size": 5,
    "dilation": 1,
}


def doc_tensors(
    depth: int = 2, d: int = 48, c: int = 3, k: int = 5, mlp: int = 192, classes: int = 5
) -> dict:
    """The tensor list of docs/FORMAT.md, spelled out by hand."""
    t = {}
    for i in range(depth):
        for n in ("norm1", "norm2"):
            t[f"blocks.{i}.{n}.weight"] = torch.ones(d)
            t[f"blocks.{i}.{n}.bias"] = torch.zeros(d)
        t[f"blocks.{i}.conv.weight"] = torch.randn(c, c, k, k)
        t[f"blocks.{i}.conv.bias"] = torch.randn(c)
        t[f"blocks.{i}.mlp.fc1.weight"] = torch.randn(mlp, d)
        t[f"blocks.{i}.mlp.fc1.bias"] = torch.randn(mlp)
        t[f"blocks.{i}.mlp.fc2.weight"] = torch.randn(d, mlp)
        t[f"blocks.{i}.mlp.fc2.bias"] = torch.randn(d)
    t["norm.weight"], t["norm.bias"] = torch.ones(d), torch.zeros(d)
    t["head.weight"], t["head.bias"] = torch.randn(classes, d), torch.randn(classes)
    return t


def test_file_written_by_another_tool_loads(tmp_path: Path) -> None:
    path = tmp_path / "other.safetensors"
    meta = {"format": "pt", "cmhsa.kind": "conv", "cmhsa.config": json.dumps({**DOC_CONFIG, "their_key": 1})}
    written = doc_tensors()
    save_file(written, str(path), metadata={**meta, "their.meta": "x"})
    ckpt = load_checkpoint(path)
    assert ckpt.kind == "conv" and ckpt.config.img_size == (12, 8) and ckpt.config.depth == 2
    assert set(ckpt.tensors) == set(written) and all(
        torch.equal(ckpt.tensors[k], v) for k, v in written.items()
    )


def test_roundtrip_attn(tmp_path: Path) -> None:
    from convit_convert.construct import convert_state_dict
    from convit_convert.options.conversion import ConversionSpec

    conv = conv_model()
    plan = ConversionSpec(qk_dim=8).plan(conv.cfg)
    sd, acfg = convert_state_dict(conv.state_dict(), plan), plan.config
    save_checkpoint(tmp_path / "a.safetensors", acfg, sd)
    back = load_checkpoint(tmp_path / "a.safetensors")
    assert back.kind == "attn" and back.config == acfg
    assert all(torch.equal(back.tensors[k], sd[k]) for k in sd)
    assert not list(tmp_path.glob("*.tmp"))


def test_bare_state_dicts_infer_the_config(tmp_path: Path) -> None:
    conv = conv_model(hidden_chans=2, in_chans=3, kernel_size=3)  # linear patch embedding
    sd = conv.state_dict()
    save_file(sd, str(tmp_path / "bare.safetensors"))
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in sd.items()}}, tmp_path / "ddp.pth")
    for name in ("bare.safetensors", "ddp.pth"):
        ckpt = load_checkpoint(tmp_path / name, Geometry((12, 8), 4))
        assert ckpt.source == "state dict"
        assert ckpt.config == conv.cfg, name


def test_conv_without_bias_loads(tmp_path: Path) -> None:
    t = {k: v for k, v in doc_tensors().items() if not k.endswith("conv.bias")}
    save_file(
        t,
        str(tmp_path / "nb.safetensors"),
        metadata={"cmhsa.kind": "conv", "cmhsa.config": json.dumps(DOC_CONFIG)},
    )
    from conftest import reference_conv, tokens_to_pixels

    ckpt = load_checkpoint(tmp_path / "nb.safetensors")
    mixer = ckpt.model().blocks[0].conv  # the missing bias must act as zero
    x = torch.randn(2, 6, 48)
    pixels = tokens_to_pixels(x, (3, 2), 4)
    ref = reference_conv(pixels, t["blocks.0.conv.weight"], None, 1)
    with torch.no_grad():
        assert torch.allclose(tokens_to_pixels(mixer(x), (3, 2), 4), ref, atol=1e-5)


class Evil:
    def __reduce__(self):  # would run code if unpickled unsafely
        return (print, ("pwned",))


# torch's safe unpickler warns of pickle.dump's protocol 4 on its way to refusing the file:
# the refusal is under test
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_pickles_are_never_loaded_unsafely(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"x": Evil()}, f)
    with pytest.raises(CmhsaError, match="weights_only=True") as info:
        load_checkpoint(path, Geometry((12, 8), 4))
    assert "weights_only=False" not in str(info.value)


def test_streaming_writer_is_read_back_by_safetensors(tmp_path: Path, monkeypatch) -> None:
    """Our one-pass writer against safetensors' own reader: every dtype, layout and edge case,
    with pieces small enough that tensors span several of them."""
    import hashlib

    from safetensors import safe_open

    from convit_convert.io import safetensors_writer as checkpoint

    monkeypatch.setattr(checkpoint, "_CHUNK_BYTES", 64)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f64": torch.randn(7, 5, generator=g, dtype=torch.float64),
        "f32.t": torch.randn(6, 9, generator=g).t(),  # non-contiguous
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "f16": torch.randn(3, 4, 2, generator=g).half(),
        "zeros.view": torch.zeros(()).expand(40, 3),  # broadcast, as the conversion returns W_Q
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "i64": torch.arange(10),
        "mask": torch.tensor([True, False, True]),
    }
    meta = {"format": "pt", "note": 'quotes " and unicode ü'}
    path = tmp_path / "w.safetensors"
    with open(path, "wb") as f:
        digest = checkpoint.write_safetensors(f, tensors, meta)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == meta
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            back = f.get_tensor(name)
            assert back.dtype == t.dtype and back.shape == t.shape, name
            assert torch.equal(back, t), name
