"""cmhsa's models in timm's registry. Importing this module registers them; nothing is downloaded.

    import timm
    import convit_convert.timm  # noqa: F401

    timm.create_model("cmhsa_attn", pretrained=True, pretrained_cfg_overlay=dict(file="vit.safetensors"))
    timm.create_model("cmhsa_conv", pretrained=True, pretrained_cfg_overlay=dict(file="conv.safetensors"))
    timm.create_model("cmhsa5_224", num_classes=10)  # the paper's CMHSA-5 (attention), random init

With ``pretrained=True`` the architecture is the file's (its cmhsa metadata); ``num_classes=`` then
resets the head, as timm users expect. Without a file, the keyword arguments are
:meth:`ViTConfig.build`'s and :meth:`ViTConfig.with_attention`'s (``num_heads``, ``qk_dim``, ``sink``,
``pinning``), defaults the paper's model. timm's factory keywords work as for its own models:
``device``, ``dtype``, ``num_classes=0`` (no head), ``global_pool=""`` (tokens out), and
``features_only=True`` with ``out_indices`` (timm's FeatureGetterNet over ``forward_intermediates``).
``model.pretrained_cfg`` feeds ``timm.data.resolve_data_config(model=model)``.

A model as timm's pretrained folder (``cmhsa export --format timm``; :func:`export_timm_folder`
here), loaded back with ``timm.create_model("local-dir:DIR", pretrained=True)`` or, uploaded, with
``hf-hub:user/name``: :mod:`convit_convert.io.timm_folder` says what the folder holds.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from timm.models import generate_default_cfgs, register_model
from torch import nn

from . import labels
from .api import load_checkpoint
from .config import ViTConfig
from .errors import CmhsaError, article
from .io.checkpoint import Checkpoint
from .io.folder import Folder, make_folder, remove_made
from .io.journal import check_settled
from .io.outputs import Target, check_apart
from .io.timm_folder import (
    CONFIG,
    CONFIG_ARG,
    FILES,
    WEIGHTS,
    config_from_arg,
    folder_config,
    pretrained_cfg,
    write_timm_folder,
)
from .model import VisionTransformer
from .theory import heads_needed

_ATTN_ARGS = ("num_heads", "qk_dim", "sink", "pinning")


# Registered under each model's name, so timm's lookups by name (get_pretrained_cfg_value, the data
# config) work before a model is built. No weights: ``file`` stays None until a user names one.
default_cfgs = generate_default_cfgs(
    {
        name: pretrained_cfg(ViTConfig.build(**size))
        for name, size in {
            "cmhsa_conv": {},
            "cmhsa_attn": {},
            "cmhsa5_224": {"kernel_size": 5},
            "cmhsa3_224": {"kernel_size": 3},
        }.items()
    }
)


def _create(
    kind: str, pretrained: bool = False, pretrained_cfg_overlay: dict | None = None, **kwargs: Any
) -> nn.Module:
    source = _as_dict(kwargs.pop("pretrained_cfg", None))  # timm's, for a folder: its config.json's
    cache_dir = kwargs.pop("cache_dir", None)
    folder_args = kwargs.pop(CONFIG_ARG, None)  # a timm folder's model_args (local-dir:, hf-hub:)
    saved_args = kwargs.pop("pretrained_model_args", None) or {}  # timm's copy of them
    if folder_args is not None and set(saved_args) - {CONFIG_ARG}:  # they reached kwargs too
        extra = sorted(set(saved_args) - {CONFIG_ARG})
        raise CmhsaError(
            f"the folder's config.json has model_args {', '.join(map(repr, extra))[:100]} beside "
            f"{CONFIG_ARG!r}; timm would pass them to the model's factory: not a folder cmhsa wrote",
            source.get("file") or source.get("hf_hub_id"),
        )
    num_classes, drop_path_rate = kwargs.pop("num_classes", None), kwargs.pop("drop_path_rate", 0.0)
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    global_pool = kwargs.pop("global_pool", None)
    features = {
        k: kwargs.pop(k) for k in ("features_only", "out_indices", "feature_cls", "output_fmt") if k in kwargs
    }
    file = (pretrained_cfg_overlay or {}).get("file")
    names = None
    if folder_args is not None:
        file = source.get("file") or source.get("hf_hub_id")
        model = _from_folder(kind, folder_args, source, pretrained, kwargs, drop_path_rate, device, cache_dir)
        if source.get("label_names") is not None:
            names = labels.check_class_names(source["label_names"], model.cfg.num_classes, file)
    elif pretrained:
        if not file:
            raise CmhsaError(
                f"cmhsa_{kind} with pretrained=True needs "
                "pretrained_cfg_overlay=dict(file=...): cmhsa never downloads"
            )
        _architecture_fixed(kwargs, "file", file)
        ckpt = load_checkpoint(file)
        if ckpt.kind != kind:
            raise CmhsaError(
                f"is {article(ckpt.kind)} checkpoint; cmhsa_{kind} loads {article(kind)} one", file
            )
        model = ckpt.model(torch.float32, drop_path_rate).train()
        names = ckpt.classes
    else:
        attn = {k: kwargs.pop(k) for k in _ATTN_ARGS if k in kwargs}
        head = {"num_classes": num_classes} if num_classes else {}  # 0 (no head): reset below
        cfg = ViTConfig.build(**kwargs, **head)
        if kind == "attn":
            heads = attn.pop("num_heads", heads_needed(cfg.kernel_size, cfg.patch_size, cfg.dilation))
            cfg = cfg.with_attention(heads, **attn)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = VisionTransformer(cfg, drop_path_rate)
    model.to(device=device, dtype=dtype)
    if (num_classes is not None and num_classes != model.num_classes) or global_pool is not None:
        model.reset_classifier(model.num_classes if num_classes is None else num_classes, global_pool)
    model.pretrained_cfg = model.default_cfg = pretrained_cfg(model.cfg, file)
    if names is not None and model.num_classes == len(names):  # the head the names belong to
        model.pretrained_cfg["label_names"] = list(names)
    return _features(model, **features) if features.pop("features_only", False) else model


def _as_dict(cfg: Any) -> dict[str, Any]:
    """timm's pretrained cfg as a dict (it may be its PretrainedCfg dataclass, or None)."""
    if cfg is None:
        return {}
    return cfg if isinstance(cfg, dict) else cfg.to_dict()


def _architecture_fixed(kwargs: dict[str, Any], source: str, where: object) -> None:
    """Architecture keywords with pretrained weights: one line, the architecture is the ``source``'s."""
    if kwargs:
        raise CmhsaError(
            f"the architecture comes from the {source}; {', '.join(sorted(kwargs))} cannot change it", where
        )


def _from_folder(
    kind: str,
    folder_args: Any,
    source: dict[str, Any],
    pretrained: bool,
    kwargs: dict[str, Any],
    drop_path_rate: float,
    device: Any,
    cache_dir: Any,
) -> VisionTransformer:
    """A model described by a timm folder's config.json (io/timm_folder.py; ``source``: timm's
    pretrained cfg of it), with the folder's weights through timm's own loader when ``pretrained``."""
    where = (
        Path(source["file"]) / CONFIG
        if source.get("file")
        else source.get("hf_hub_id", "the model's config.json")
    )
    if source.get("file"):  # a reader never renames: a folder a killed cmhsa left mid-write is refused
        for name in (CONFIG, WEIGHTS):
            check_settled(Path(source["file"]) / name)
    cfg = config_from_arg(folder_args, kind, where)
    _architecture_fixed(kwargs, "folder", where)
    _agrees_with_timm(cfg, source, where)
    if pretrained and source.get("hf_hub_id") and not source.get("file"):
        # the local-dir: route checked config.json against the weights before timm parsed it; a Hub
        # download has its weights now: the same check (timm's own cached download, then its loader)
        from huggingface_hub import hf_hub_download  # timm's own dependency, its cache

        repo, _, revision = source["hf_hub_id"].partition("@")
        weights = hf_hub_download(repo, WEIGHTS, revision=revision or None, cache_dir=cache_dir)
        folder_config(Path(weights).parent)  # its config.json, beside the weights, timm fetched first
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = VisionTransformer(cfg, drop_path_rate)
    if pretrained:
        from timm.models import load_pretrained

        # the model is the folder's, channels and head included: no first-conv adaptation (timm
        # 1.0.16 adapts whenever in_chans != 3), no head dropped or offset, every tensor loaded
        cfg_for_load = {**source, "first_conv": None, "classifier": "head", "label_offset": 0}
        try:
            load_pretrained(
                model, cfg_for_load, num_classes=cfg.num_classes, in_chans=cfg.in_chans, cache_dir=cache_dir
            )
        except RuntimeError as e:  # load_state_dict, strict: a tensor missing or of another shape
            why = (str(e).strip().splitlines() or [""])[-1].strip()[:300]
            raise CmhsaError(
                f"the weights are not the model its config.json describes ({why})", where
            ) from None
    return model.train()


def _agrees_with_timm(cfg: ViTConfig, source: dict[str, Any], where: object) -> None:
    """What timm reads from a folder's config.json before cmhsa's ``model_args`` (the top-level
    ``num_classes``, which decides whether timm keeps the trained head, and ``input_size``, which
    decides the images it is given) must say what ``model_args`` says."""

    def plain(v: Any) -> Any:
        return list(v) if isinstance(v, list | tuple) else v

    expected = pretrained_cfg(cfg)
    for key in ("num_classes", "input_size"):
        value = source.get(key)
        if key in source and (isinstance(value, bool) or plain(value) != plain(expected[key])):
            raise CmhsaError(
                f"config.json says {key} {value!r} but its model_args' {CONFIG_ARG} makes "
                f"{expected[key]!r}; timm would load a different model than the one saved",
                where,
            )


def _features(
    model: VisionTransformer,
    out_indices: int | list[int] | None = None,
    feature_cls: str = "getter",
    output_fmt: str = "NCHW",
) -> nn.Module:
    """timm's ``features_only=True``: the blocks' outputs through ``forward_intermediates`` (timm's
    FeatureGetterNet, as for its own ViTs: the last 3 blocks by default, or every block of a
    shallower model), the rest pruned."""
    if feature_cls != "getter":
        raise TypeError(f"cmhsa models give features through feature_cls='getter', not {feature_cls!r}")
    depth = len(model.blocks)
    if out_indices is None:
        out_indices = min(3, depth)
    if isinstance(out_indices, int):  # the last n blocks
        fits = 0 < out_indices <= depth
    else:  # blocks by index, negative from the end
        fits = all(-depth <= i < depth for i in out_indices)
    if not fits:
        raise ValueError(f"out_indices={out_indices!r}: the model has {depth} blocks (0..{depth - 1})")
    # timm's private modules, imported only for features_only (a timm that moves them breaks that
    # option alone, not the registry, cmhsa's loaders or training)
    from timm.models._builder import pretrained_cfg_for_features
    from timm.models._features import FeatureGetterNet

    features = FeatureGetterNet(model, out_indices, output_fmt=output_fmt)
    features.pretrained_cfg = features.default_cfg = pretrained_cfg_for_features(model.pretrained_cfg)
    return features


def _checked_first(load: Any, read: Any) -> Any:
    """timm's folder-config loader ``load``, after cmhsa's check of the config.json ``read(...)``
    returns (a path): a folder that names a cmhsa architecture is refused in one line before timm
    parses it, builds anything or loads a weight."""

    @functools.wraps(load)
    def checked(model_id: Any, *args: Any, **kwargs: Any) -> Any:
        path = read(model_id, *args, **kwargs)
        if path is not None:
            folder_config(Path(path).parent)
        return load(model_id, *args, **kwargs)

    checked.cmhsa_checked = True  # type: ignore[attr-defined]
    return checked


def _check_folders_before_timm() -> None:
    """Put cmhsa's folder check in front of timm's two folder-config loaders (``local-dir:``,
    ``hf-hub:``) where timm's factory calls them (private names: skipped when a timm release moves
    them; ``_create`` still checks what reaches it)."""
    try:
        from timm.models import _factory, _hub
    except ImportError:
        return
    local = getattr(_factory, "load_model_config_from_path", None)
    if callable(local) and not getattr(local, "cmhsa_checked", False):
        _factory.load_model_config_from_path = _checked_first(local, lambda d, *a, **k: Path(d) / CONFIG)
    hub = getattr(_factory, "load_model_config_from_hf", None)
    if callable(hub) and hasattr(_hub, "download_from_hf") and not getattr(hub, "cmhsa_checked", False):

        def fetched(model_id: str, cache_dir: Any = None, *a: Any, **k: Any) -> Any:
            return _hub.download_from_hf(model_id, CONFIG, cache_dir=cache_dir)  # timm's own call, cached

        _factory.load_model_config_from_hf = _checked_first(hub, fetched)


_check_folders_before_timm()


@register_model
def cmhsa_conv(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Phase 1: the convolutional ViT (the paper's size unless a file or kwargs say otherwise)."""
    return _create("conv", pretrained, **kwargs)


@register_model
def cmhsa_attn(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Phase 2: the attention ViT with relative position bias (the paper's size by default)."""
    return _create("attn", pretrained, **kwargs)


@register_model
def cmhsa5_224(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """The paper's CMHSA-5: 224 px, P = 16, d = 768, depth 6, 9 heads from a 5×5 kernel."""
    return _create("attn", pretrained, **{"kernel_size": 5, **kwargs})


@register_model
def cmhsa3_224(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """The paper's CMHSA-3: as CMHSA-5 with a 3×3 kernel (still 9 heads: K < 2P)."""
    return _create("attn", pretrained, **{"kernel_size": 3, **kwargs})


# the folder timm loads (io/timm_folder.py), written and checked ----------------------------------


CARD_KEYS = ("cmhsa.trained", "cmhsa.init", "cmhsa.result", "cmhsa.source_sha256", labels.KEY)


@dataclass
class TimmFolderReport:
    checkpoint: Checkpoint
    folder: Path
    written: list[Path]
    max_abs: float  # timm's model against cmhsa's, the same images: logits' largest difference

    @property
    def passed(self) -> bool:
        return self.max_abs == 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": "export",
            "format": "timm",
            "passed": self.passed,
            "folder": str(self.folder),
            "written": [str(p) for p in self.written],
            "max_abs": self.max_abs,
        }


def export_timm_folder(
    checkpoint: Path | Checkpoint, folder: Path | Folder, seed: int = 0, license_id: str | None = None
) -> TimmFolderReport:
    """Write ``checkpoint``'s model (a file, or one held in memory: ``cmhsa train --export-timm``)
    as timm's folder ``folder`` (io/timm_folder.py; ``license_id``: the weights' licence, by default
    the training data's), then load it with timm as a timm user would and compare logits on 4 random
    images (float32, CPU): they must be equal, the same weights in the same model."""
    if not isinstance(folder, Folder):  # a path the user gave: made if missing, held while written
        path = Path(folder)
        if path.exists() and not path.is_dir():
            raise CmhsaError("is a file; a timm folder is a directory", path)
        made = make_folder(path)
        try:
            with Folder.open(path) as held:
                reads = [checkpoint.path if isinstance(checkpoint, Checkpoint) else checkpoint]
                for name in FILES:  # never over the model it exports (DIR/model.safetensors)
                    check_apart(Target(held, name), reads)
                return export_timm_folder(checkpoint, held, seed, license_id)
        except BaseException:  # a folder this call made goes, with what it wrote there
            remove_made(made, keep=FILES)
            raise
    import timm

    from .loaders import image_mode

    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
    image_mode(ckpt.config.in_chans, ckpt.path)  # what timm's and transformers' preprocessing describe
    model = ckpt.model(torch.float32)
    meta = {k: ckpt.metadata[k] for k in CARD_KEYS if k in ckpt.metadata}  # what the model card tells
    written = write_timm_folder(folder, ckpt.config, model.state_dict(), meta, license_id)
    # timm reads the folder back through the one held (a link put in its place cannot answer)
    held_path = folder.writer_path(WEIGHTS).parent
    try:
        loaded = timm.create_model(f"local-dir:{held_path}", pretrained=True).eval()
    except CmhsaError as e:  # named as the user named the folder, not by the descriptor it is read through
        where = e.path.replace(str(held_path), str(folder.path), 1) if e.path else folder.path
        raise CmhsaError(e.message, where) from None
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, ckpt.config.in_chans, *ckpt.config.img_size, generator=g)
    with torch.inference_mode():
        diff = (loaded(x) - model(x)).abs().max().item()
    return TimmFolderReport(ckpt, folder.path, written, diff)
