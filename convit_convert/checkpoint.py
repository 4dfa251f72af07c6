"""Reading and writing checkpoints in the format of docs/FORMAT.md, and checking every input.

Every problem with an input file raises :class:`CmhsaError` naming the file, before any output
is written.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from . import __version__
from .atomic import atomic_path
from .config import KINDS, ViTConfig
from .errors import CmhsaError, article

KIND_KEY = "cmhsa.kind"
CONFIG_KEY = "cmhsa.config"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


@dataclass
class Checkpoint:
    """A validated model: its kind ('conv' or 'attn'), config and tensors."""

    path: Path
    kind: str
    config: ViTConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)
    source: str = "cmhsa"  # "cmhsa" (metadata present), "state dict" (config inferred) or "onnx"
    import_report: dict[str, Any] | None = None  # ONNX input: how the graph was read and checked

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.tensors.values())).dtype

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


def expected_shapes(kind: str, cfg: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``kind`` holds, with its shape (docs/FORMAT.md)."""
    d, p = cfg.embed_dim, cfg.patch_size
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.patch_embed == "linear":
        shapes["patch_embed.weight"] = (d, p * p * cfg.in_chans)
        shapes["patch_embed.bias"] = (d,)
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        for norm in ("norm1", "norm2"):
            shapes[b + norm + ".weight"] = shapes[b + norm + ".bias"] = (d,)
        if kind == "conv":
            c, k = cfg.hidden_chans, cfg.kernel_size
            shapes[b + "conv.weight"] = (c, c, k, k)
            shapes[b + "conv.bias"] = (c,)
        else:
            h, qk, vd = cfg.num_heads, cfg.qk_dim, cfg.v_dim
            gh, gw = cfg.grid_size
            for name in ("q", "k"):
                shapes[f"{b}attn.{name}.weight"] = (h * qk, d)
                shapes[f"{b}attn.{name}.bias"] = (h * qk,)
            shapes[b + "attn.v.weight"] = (h * vd, d)
            shapes[b + "attn.v.bias"] = (h * vd,)
            shapes[b + "attn.proj.weight"] = (d, h * vd)
            shapes[b + "attn.proj.bias"] = (d,)
            shapes[b + "attn.rel_pos_bias"] = (h, 2 * gh - 1, 2 * gw - 1)
            if cfg.sink:
                shapes[b + "attn.sink"] = (h,)
        shapes[b + "mlp.fc1.weight"] = (cfg.mlp_hidden_dim, d)
        shapes[b + "mlp.fc1.bias"] = (cfg.mlp_hidden_dim,)
        shapes[b + "mlp.fc2.weight"] = (d, cfg.mlp_hidden_dim)
        shapes[b + "mlp.fc2.bias"] = (d,)
    shapes["norm.weight"] = shapes["norm.bias"] = (d,)
    shapes["head.weight"] = (cfg.num_classes, d)
    shapes["head.bias"] = (cfg.num_classes,)
    return shapes


def _optional(kind: str, name: str) -> bool:
    """Tensors a checkpoint may leave out: a conv without bias."""
    return kind == "conv" and name.endswith(".conv.bias")


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def validate_tensors(kind: str, cfg: ViTConfig, tensors: dict[str, torch.Tensor], path: object) -> None:
    """Exactly the expected names and shapes, floating point, finite."""
    expected = expected_shapes(kind, cfg)
    missing = [n for n in expected if n not in tensors and not _optional(kind, n)]
    if missing:
        raise CmhsaError(f"missing tensor(s) for {article(kind)} model: {_names(missing)}", path)
    extra = sorted(n for n in tensors if n not in expected)
    if extra:
        raise CmhsaError(f"unexpected tensor(s) for {article(kind)} model: {_names(extra)}", path)
    for name, t in tensors.items():
        if tuple(t.shape) != expected[name]:
            raise CmhsaError(
                f"tensor {name} has shape {list(t.shape)}, the config implies {list(expected[name])}", path
            )
        if t.dtype not in FLOAT_DTYPES:
            raise CmhsaError(f"tensor {name} has dtype {t.dtype}, expected floating point", path)
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        raise CmhsaError(f"tensors mix dtypes {sorted(map(str, dtypes))}", path)
    for name, t in tensors.items():
        # a NaN/Inf anywhere makes the sum non-finite; only then (or on overflow) look closer
        if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            raise CmhsaError(f"tensor {name} holds NaN or Inf values", path)


def check_input_file(path: Path) -> None:
    """An existing, non-empty regular file, or CmhsaError."""
    if not path.exists():
        raise CmhsaError("no such file", path)
    if path.is_dir():
        raise CmhsaError("is a directory, expected a model file", path)
    if path.stat().st_size == 0:
        raise CmhsaError("file is empty", path)


def read_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and string metadata of a .safetensors file, or of a .pt/.pth/.bin state dict
    (read with ``weights_only=True``; never an unsafe fallback). Raises CmhsaError."""
    path = Path(path)
    check_input_file(path)
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise CmhsaError(f"cannot read ({e.strerror})", path) from None
    if path.suffix.lower() == ".onnx":
        raise CmhsaError("is an ONNX model, not a tensor file; read it with load_checkpoint", path)
    if head.startswith(b"PK") or path.suffix in (".pt", ".pth", ".bin"):
        return _read_torch(path), {}
    return _read_safetensors(path)


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except Exception as e:  # safetensors raises its own error types for every kind of damage
        raise CmhsaError(f"not a readable safetensors file ({type(e).__name__}: {e})", path) from None
    return tensors, metadata


def _blocked(message: str) -> str:
    """What PyTorch's weights_only unpickler blocked, without its advice to load unsafely."""
    import re

    glob = re.search(r"GLOBAL ([\w.]+)", message)
    if glob:
        return f"it needs the global {glob.group(1)}, which is not allowed"
    detail = re.search(r"WeightsUnpickler error:\s*([^\n]+)", message)
    return detail.group(1).strip().rstrip(".") if detail else "it holds objects other than tensors"


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    import pickle
    import zipfile

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CmhsaError(
            f"refused by weights_only=True loading: {_blocked(str(e))}; cmhsa never unpickles arbitrary objects "
            "(save the model's state_dict, or use .safetensors)",
            path,
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as e:
        raise CmhsaError(f"not a readable PyTorch file ({type(e).__name__}: {e})", path) from None
    if isinstance(obj, dict):  # training checkpoints often nest the weights
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CmhsaError("expected a state dict (a dict of tensors)", path)
    keys = list(obj)
    if all(k.startswith("module.") for k in keys):  # saved from DistributedDataParallel
        obj = {k[len("module.") :]: v for k, v in obj.items()}
    return dict(obj)


def infer_conv_config(
    tensors: dict[str, torch.Tensor],
    img_size: tuple[int, int],
    patch_size: int,
    dilation: int = 1,
    norm_eps: float = 1e-6,
    path: object = None,
) -> ViTConfig:
    """The config of a bare conv-phase state dict, from its tensor shapes and the image geometry
    (which shapes cannot tell)."""

    def need(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CmhsaError(f"missing tensor {name} (needed to infer the config)", path)
        return tensors[name]

    blocks = sorted({int(m.group(1)) for n in tensors if (m := _BLOCK.match(n))})
    if not blocks:
        raise CmhsaError("no blocks.{i}.* tensors: not a conv-phase ViT state dict", path)
    conv = need("blocks.0.conv.weight")
    if conv.ndim != 4:
        raise CmhsaError(
            f"tensor blocks.0.conv.weight has shape {list(conv.shape)}, expected (C, C, K, K)", path
        )
    c_out, c_in, kh, kw = conv.shape
    if kh != kw:
        raise CmhsaError(f"unsupported convolution: non-square kernel {kh}x{kw}", path)
    if c_in != c_out:
        raise CmhsaError(
            f"unsupported convolution: weight {list(conv.shape)} is not (C, C, K, K) "
            "(grouped or channel-changing convolutions are not supported)",
            path,
        )
    embed_dim = need("norm.weight").shape[0]
    p = patch_size
    if embed_dim != p * p * c_out:
        raise CmhsaError(
            f"embed_dim {embed_dim} != patch_size² · conv channels = {p}²·{c_out}: wrong --patch-size?", path
        )
    if "patch_embed.weight" in tensors:
        pe = tensors["patch_embed.weight"]
        if pe.ndim != 2 or pe.shape[1] % (p * p):
            raise CmhsaError(
                f"tensor patch_embed.weight has shape {list(pe.shape)}, expected (d, P²·in_chans)", path
            )
        in_chans, patch_embed = pe.shape[1] // (p * p), "linear"
    else:
        in_chans, patch_embed = c_out, "identity"
    cfg = ViTConfig(
        img_size=img_size,
        patch_size=p,
        in_chans=int(in_chans),
        hidden_chans=int(c_out),
        embed_dim=int(embed_dim),
        patch_embed=patch_embed,
        depth=blocks[-1] + 1,
        mlp_hidden_dim=int(need("blocks.0.mlp.fc1.weight").shape[0]),
        num_classes=int(need("head.weight").shape[0]),
        norm_eps=float(norm_eps),
        kernel_size=int(kh),
        dilation=dilation,
    )
    cfg.validate("conv", path)
    return cfg


def _check_geometry(
    cfg: ViTConfig, img_size: tuple[int, int] | None, patch_size: int | None, path: Path, where: str
) -> None:
    """--img-size / --patch-size given for a file that states its own must agree with it."""
    if img_size is not None and tuple(img_size) != cfg.img_size:
        raise CmhsaError(
            f"--img-size {list(img_size)} disagrees with the {where}'s img_size {list(cfg.img_size)}", path
        )
    if patch_size is not None and patch_size != cfg.patch_size:
        raise CmhsaError(
            f"--patch-size {patch_size} disagrees with the {where}'s patch_size {cfg.patch_size}", path
        )


def load_checkpoint(
    path: str | Path,
    *,
    img_size: tuple[int, int] | None = None,
    patch_size: int | None = None,
    dilation: int = 1,
    norm_eps: float = 1e-6,
    onnx_tol: float = 1e-5,
) -> Checkpoint:
    """Load and validate a checkpoint. Files with cmhsa metadata describe themselves; a bare
    conv-phase state dict needs ``img_size`` and ``patch_size`` (the rest is inferred); an ONNX
    file (``.onnx``) is read by its graph's structure and checked against onnxruntime within
    ``onnx_tol`` (:mod:`convit_convert.onnx_import`)."""
    path = Path(path)
    if path.suffix.lower() == ".onnx":
        from .onnx_import import import_onnx

        ckpt = import_onnx(path, tol=onnx_tol)
        _check_geometry(ckpt.config, img_size, patch_size, path, "graph")
        return ckpt
    tensors, metadata = read_tensors(path)
    if not tensors:
        raise CmhsaError("holds no tensors", path)
    kind = metadata.get(KIND_KEY)
    if kind is None and CONFIG_KEY in metadata:
        raise CmhsaError(f"metadata has {CONFIG_KEY} but no {KIND_KEY}", path)
    if kind is not None:
        if kind not in KINDS:
            raise CmhsaError(f"metadata {KIND_KEY} must be 'conv' or 'attn', got {kind!r}", path)
        if CONFIG_KEY not in metadata:
            raise CmhsaError(f"metadata has {KIND_KEY} but no {CONFIG_KEY}", path)
        cfg = ViTConfig.from_json(metadata[CONFIG_KEY], kind, path)
        _check_geometry(cfg, img_size, patch_size, path, "file")
        source = "cmhsa"
    else:
        if img_size is None or patch_size is None:
            raise CmhsaError(
                "has no cmhsa metadata; to read it as a bare conv-phase state dict give --img-size and --patch-size",
                path,
            )
        kind, source = "conv", "state dict"
        cfg = infer_conv_config(tensors, tuple(img_size), patch_size, dilation, norm_eps, path)
    validate_tensors(kind, cfg, tensors, path)
    return Checkpoint(path, kind, cfg, tensors, metadata, source)


# safetensors' dtype names (https://github.com/huggingface/safetensors, format section)
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_CHUNK_BYTES = 1 << 24


def _tensor_chunks(t: torch.Tensor) -> Iterator[memoryview]:
    """Row-major bytes of ``t`` in pieces of at most ~16 MB. Non-contiguous tensors (such as the
    broadcast zero W_Q / W_K the conversion returns) are made contiguous one piece at a time."""
    if t.numel() == 0:
        return
    if t.dim() == 0:
        t = t.reshape(1)
    rows = max(1, _CHUNK_BYTES // max(1, t[0].numel() * t.element_size()))
    for i in range(0, t.shape[0], rows):
        piece = t[i : i + rows].contiguous()
        yield memoryview(piece.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(
    file: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> str:
    """Write ``tensors`` to ``file`` in the safetensors format, in one streaming pass, and return
    the sha256 of the bytes written.

    The layout is safetensors' own (8-byte little-endian header length, JSON header padded with
    spaces to 8 bytes, then the tensors back to back in header order), read back by
    ``safetensors.safe_open`` in the tests. Why not ``safetensors.torch.save_file``: it copies
    every tensor into a bytes object before writing (twice the output's size in memory) and cannot
    hash while it writes, which costs a second read of a 600 MB file.
    """
    if sys.byteorder != "little":
        raise RuntimeError(
            "safetensors files are little-endian; writing them on this machine is not supported"
        )
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    for block in (struct.pack("<Q", len(head)), head):
        file.write(block)
        digest.update(block)
    for name in names:
        for block in _tensor_chunks(tensors[name]):
            file.write(block)
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(
    path: str | Path,
    kind: str,
    cfg: ViTConfig,
    tensors: Mapping[str, torch.Tensor],
    extra_metadata: dict[str, str] | None = None,
) -> str:
    """Write a checkpoint atomically (temp file in the target folder, then rename); return its sha256."""
    cfg.validate(kind, path)
    metadata = {"format": "pt", KIND_KEY: kind, CONFIG_KEY: cfg.to_json(kind), "cmhsa.version": __version__}
    metadata.update(extra_metadata or {})
    tensors = {k: v.detach().to("cpu") for k, v in tensors.items()}
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        return write_safetensors(f, tensors, metadata)
