"""Checkpoint files in the format of docs/FORMAT.md: safetensors with cmhsa metadata, or a bare
state dict (safetensors, or a PyTorch pickle read with ``weights_only=True``); every input checked.

The tensors a checkpoint must hold are the model's own (:class:`~convit_convert.model.
VisionTransformer` built on the meta device). Every problem with an input file raises
:class:`CmhsaError` naming the file, before any output is written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import KINDS, ViTConfig
from ..errors import CmhsaError, article
from ..labels import from_metadata
from ..model import VisionTransformer
from ..options.operations import Geometry
from ..resources import check_fits
from ..version import __version__
from .atomic import atomic_names
from .journal import check_settled
from .outputs import Target
from .paths import check_input_file, open_regular, parse_json
from .safetensors_writer import HEADER_BYTES, write_safetensors

KIND_KEY = "cmhsa.kind"
JSON_KEYS = ("cmhsa.result", "cmhsa.init")  # metadata cmhsa train writes as JSON objects (the model card's)
CONFIG_KEY = "cmhsa.config"
FORMAT_KEY, FORMAT_VERSION = "cmhsa.format_version", 2  # docs/FORMAT.md; files without the key are version 1
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


@dataclass
class Checkpoint:
    """A validated model: its config (kind included) and tensors."""

    path: Path
    config: ViTConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)
    # "cmhsa" (metadata present), "transformers" (a timm folder's config.json describes it), "state
    # dict" (config inferred) or "onnx"
    source: str = "cmhsa"
    import_report: dict[str, Any] | None = None  # ONNX input: how the graph was read and checked

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def classes(self) -> tuple[str, ...] | None:
        """The names of the model's outputs, where the file records them (labels.py)."""
        return from_metadata(self.metadata, self.config.num_classes, self.path)

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.tensors.values())).dtype

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in self.tensors.values())

    def model(self, dtype: torch.dtype | None = None, drop_path_rate: float = 0.0) -> VisionTransformer:
        """The model this checkpoint describes, in eval mode, with its weights (a conv saved without
        bias gets a zero bias: the same function)."""
        model = VisionTransformer(self.config, drop_path_rate)
        tensors = dict(self.tensors)
        for i, block in enumerate(model.blocks):
            name = f"blocks.{i}.conv.bias"
            if self.kind == "conv" and name not in tensors:
                tensors[name] = torch.zeros_like(block.conv.bias, dtype=self.dtype)
        model.to(self.dtype if dtype is None else dtype)
        model.load_state_dict(tensors, strict=True)
        return model.eval()


def expected_shapes(cfg: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` holds, with its shape: the model's own state dict."""
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _optional(kind: str, name: str) -> bool:
    """Tensors a checkpoint may leave out: a conv without bias."""
    return kind == "conv" and name.endswith(".conv.bias")


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def validate_tensors(cfg: ViTConfig, tensors: dict[str, torch.Tensor], path: object) -> None:
    """Exactly the expected names and shapes, floating point, finite."""
    kind = cfg.kind
    expected = expected_shapes(cfg)
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


def read_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and string metadata of a .safetensors file, or of a .pt/.pth/.bin state dict
    (read with ``weights_only=True``; never an unsafe fallback). Raises CmhsaError."""
    path = Path(path)
    check_input_file(path, "model file")
    check_settled(path)
    if path.suffix.lower() == ".onnx":
        raise CmhsaError(
            "is an ONNX model, not a tensor file; read it with convit_convert.api.load_checkpoint", path
        )
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            # by content, not by name: a renamed file is read as what it is
            pickled = head.startswith(b"PK") or (path.suffix in (".pt", ".pth", ".bin") and head[8:9] != b"{")
            if not pickled:  # a PyTorch file is held to memory by its one reader, load_pickled
                check_tensor_bytes(f, path)
    except OSError as e:
        raise CmhsaError(f"cannot read ({e.strerror})", path) from None
    if pickled:
        return _read_torch(path), {}
    _check_header_size(head, path)
    return _read_safetensors(path)


def load_pickled(f: Any, path: object) -> Any:
    """A PyTorch file (torch.save's zip or a legacy pickle) from ``f``, the one reader of them (a
    model's state dict, a run's ``checkpoint-last.pt``): held to memory by what it holds
    (:func:`check_tensor_bytes`), then read with ``weights_only=True`` (tensors and plain values,
    never an object that runs code). torch's errors are the caller's to word."""
    check_tensor_bytes(f, path)
    return torch.load(f, map_location="cpu", weights_only=True)


def check_tensor_bytes(f: Any, path: object) -> None:
    """A tensor file's bytes (``f``, open at any offset), held twice (its tensors and the model built
    from them) to the memory available before any is read: a safetensors file or a legacy pickle
    holds what its size says; torch.save's zip, what its entries say they hold, each stored, as
    torch.save writes them (a compressed entry could expand without bound, so none is read)."""
    import zipfile

    size = f.seek(0, 2)
    f.seek(0)
    if zipfile.is_zipfile(f):
        try:
            entries = zipfile.ZipFile(f).infolist()
        except (zipfile.BadZipFile, ValueError, OSError) as e:
            raise CmhsaError(f"not a readable PyTorch file ({e})", path) from None
        packed = [e.filename for e in entries if e.compress_type != zipfile.ZIP_STORED]
        if packed:
            raise CmhsaError(
                f"holds compressed entries ({packed[0][:60]!r}); torch.save writes none, and a "
                "compressed entry can expand without bound, so cmhsa reads none",
                path,
            )
        size = sum(e.file_size for e in entries)
    f.seek(0)
    check_fits(2 * size, f"reading its tensors ({size:,} bytes, held twice: the tensors and the model)", path)


def _check_header_size(head: bytes, path: Path) -> None:
    """The safetensors header's length, from the file's first 8 bytes, within HEADER_BYTES (the
    bound of every reader and of the writer) before anything of it is read."""
    size = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if not 0 < size <= HEADER_BYTES:
        shown = f"claims {size:,} bytes" if size > 0 else "has no length"
        raise CmhsaError(
            f"not a readable safetensors file (its header {shown}; cmhsa reads headers of at most "
            f"{HEADER_BYTES:,} bytes)",
            path,
        )


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except Exception as e:  # safetensors raises its own error types for every kind of damage
        raise CmhsaError(f"not a readable safetensors file ({type(e).__name__}: {e})", path) from None
    return tensors, metadata


def read_metadata(path: str | Path) -> dict[str, str]:
    """A safetensors file's string metadata, from its header alone (bounded, parsed by the one JSON
    reader), without reading a tensor: what a timm folder's check compares its config.json with."""
    path = Path(path)
    with open_regular(path, what="model file") as f:
        head = f.read(8)
        _check_header_size(head, path)
        header = parse_json(f.read(int.from_bytes(head, "little")), path, "the safetensors header")
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CmhsaError("is not a safetensors file (its header's metadata is not text)", path)
    return meta


def _blocked(message: str) -> str:
    """What PyTorch's weights_only unpickler blocked, without its advice to load unsafely."""
    glob = re.search(r"GLOBAL ([\w.]+)", message)
    if glob:
        return f"it needs the global {glob.group(1)}, which is not allowed"
    detail = re.search(r"WeightsUnpickler error:\s*([^\n]+)", message)
    return detail.group(1).strip().rstrip(".") if detail else "it holds objects other than tensors"


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    import pickle
    import zipfile

    try:
        with open(path, "rb") as f:  # a file object: torch.load dispatches a .safetensors *name* elsewhere
            obj = load_pickled(f, path)
    except CmhsaError:  # load_pickled's own refusal, already one line
        raise
    except pickle.UnpicklingError as e:
        raise CmhsaError(
            f"refused by weights_only=True loading: {_blocked(str(e))}; cmhsa never "
            "unpickles arbitrary objects "
            "(save the model's state_dict, or use .safetensors)",
            path,
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as e:
        raise CmhsaError(f"not a readable PyTorch file ({type(e).__name__}: {e})", path) from None
    except Exception as e:  # whatever else a damaged file makes the unpickler raise
        raise CmhsaError(f"not a readable PyTorch file ({type(e).__name__}: {e})", path) from None
    if isinstance(obj, dict) and {"model", "optimizer", "model_config"} <= obj.keys():
        raise CmhsaError(
            "is a cmhsa training checkpoint (a run's state, not a model file): give "
            "the run's conv.safetensors "
            "or vit.safetensors, or continue the run with `cmhsa train PHASE -o RUN --resume`",
            path,
        )
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
    dilation: int,
    norm_eps: float,
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
            f"embed_dim {embed_dim} != patch_size² · conv channels = {p}²·{c_out}: wrong `patch_size`?", path
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
    cfg.validate(path)
    return cfg


def check_geometry(
    cfg: ViTConfig, img_size: tuple[int, int] | None, patch_size: int | None, path: Path, where: str
) -> None:
    """`img_size` / `patch_size` given for a file that states its own must agree with it."""
    if img_size is not None and tuple(img_size) != cfg.img_size:
        raise CmhsaError(
            f"`img_size` {list(img_size)} disagrees with the {where}'s img_size {list(cfg.img_size)}", path
        )
    if patch_size is not None and patch_size != cfg.patch_size:
        raise CmhsaError(
            f"`patch_size` {patch_size} disagrees with the {where}'s patch_size {cfg.patch_size}", path
        )


def load_tensor_checkpoint(
    path: str | Path, geometry: Geometry | None = None, described: ViTConfig | None = None
) -> Checkpoint:
    """Load and validate a tensor file. Files with cmhsa metadata describe themselves; one without,
    in a timm folder whose config.json ``described`` it (transformers' ``save_pretrained``), is
    that model; a bare conv-phase state dict needs ``geometry``'s ``img_size`` and ``patch_size``
    (the rest is inferred)."""
    path = Path(path)
    g = geometry or Geometry()
    img_size, patch_size = g.img_size, g.patch_size
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
        version = metadata.get(FORMAT_KEY, "1")
        if version not in [str(v) for v in range(1, FORMAT_VERSION + 1)]:
            raise CmhsaError(
                f"format version {version!r}: this cmhsa reads versions 1 to "
                f"{FORMAT_VERSION} (upgrade cmhsa)",
                path,
            )
        cfg = ViTConfig.from_json(metadata[CONFIG_KEY], kind, path)
        check_geometry(cfg, img_size, patch_size, path, "file")
        from_metadata(metadata, cfg.num_classes, path)  # foreign names: refused here, not when shown
        for key in JSON_KEYS:  # what cmhsa wrote as JSON objects: refused here, not when a card is made
            if key in metadata and not isinstance(parse_json(metadata[key], path, f"metadata {key}"), dict):
                raise CmhsaError(f"metadata {key} is not a JSON object", path)
        source = "cmhsa"
    elif described is not None:
        cfg, source = described, "transformers"
        check_geometry(cfg, img_size, patch_size, path, "folder's config.json")
    else:
        if img_size is None or patch_size is None:
            raise CmhsaError(
                "has no cmhsa metadata; to read it as a bare conv-phase state dict give "
                "`img_size` and `patch_size` "
                "(cmhsa convert, verify, inspect and export take them; convert it first for eval and train)",
                path,
            )
        source = "state dict"
        cfg = infer_conv_config(tensors, tuple(img_size), patch_size, g.dilation, g.norm_eps, path)
    validate_tensors(cfg, tensors, path)
    return Checkpoint(path, cfg, tensors, metadata, source)


def save_model(
    target: Target,
    cfg: ViTConfig,
    tensors: Mapping[str, torch.Tensor],
    extra_metadata: dict[str, str] | None = None,
) -> str:
    """Write a checkpoint as ``target`` in its held folder, atomically (a temp file beside it, then
    a rename); return its sha256."""
    with atomic_names(target) as (tmp,):
        return write_checkpoint(tmp, cfg, tensors, extra_metadata, target.show())


def write_checkpoint(
    tmp: Path,
    cfg: ViTConfig,
    tensors: Mapping[str, torch.Tensor],
    extra_metadata: dict[str, str] | None = None,
    path: str | Path | None = None,
) -> str:
    """Write a checkpoint to ``tmp``, a temp file of ``atomic_names`` that becomes ``path``;
    return its sha256."""
    cfg.validate(path or tmp)
    metadata = {
        "format": "pt",
        KIND_KEY: cfg.kind,
        CONFIG_KEY: cfg.to_json(),
        FORMAT_KEY: str(FORMAT_VERSION),
        "cmhsa.version": __version__,
    }
    metadata.update(extra_metadata or {})
    tensors = {k: v.detach().to("cpu") for k, v in tensors.items()}
    with open(tmp, "wb") as f:
        return write_safetensors(f, tensors, metadata, path or tmp)
