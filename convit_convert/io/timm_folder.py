"""A model as timm's pretrained folder: what ``timm.create_model("local-dir:DIR", pretrained=True)``
reads (timm >= 1.0.31, after ``import convit_convert.timm``) and the Hugging Face Hub hosts
(``hf-hub:user/name``, once ``huggingface_hub.upload_folder`` has put the folder there):

    DIR/model.safetensors   the weights, in cmhsa's checkpoint format (cmhsa reads the file too)
    DIR/config.json         timm's: {"architecture": "cmhsa_attn", "num_classes": 10,
                            "num_features": 48, "model_args": {"cmhsa_config": {...}},
                            "pretrained_cfg": {"input_size": [1, 28, 28], "mean": [...], ...}}
    DIR/README.md           the model card (io/model_card.py): the Hub's metadata, how it was
                            made, its input, how to run it
    DIR/modeling_cmhsa.py   the model for transformers, with no cmhsa installed
                            (convit_convert/shipped/modeling_cmhsa.py, copied as it is), which
                            config.json's ``auto_map`` names: ``trust_remote_code=True`` loads it

One config.json serves both: timm reads its ``architecture``, ``model_args`` and ``pretrained_cfg``
and ignores ``auto_map``; transformers reads a timm config.json as its TimmWrapper's (the route
after ``import convit_convert.timm``) unless ``trust_remote_code=True`` picks ``auto_map``'s classes.
It has no ``model_type``: with one, transformers would no longer take the folder for timm's.

``model_args`` carries the model's whole cmhsa config, so any size cmhsa supports is rebuilt as it
was; ``pretrained_cfg`` is how the model wants its input (timm's ``resolve_data_config`` reads it).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ViTConfig
from ..errors import CmhsaError
from ..labels import check_class_names, from_metadata, to_metadata
from ..notices import notice
from ..options.values import EVAL_CROP_PCT, EVAL_INTERPOLATION
from ..text import json_text
from ..version import __version__
from .atomic import atomic_names
from .checkpoint import CONFIG_KEY, KIND_KEY, read_metadata, write_checkpoint
from .folder import Folder
from .model_card import CARD, check_license, data_license, model_card, source_url
from .outputs import Target
from .paths import open_regular, parse_json, read_text

WEIGHTS, CONFIG = "model.safetensors", "config.json"
MODELING = "modeling_cmhsa.py"  # the model for transformers, shipped in the folder
SHIPPED = Path(__file__).resolve().parent.parent / "shipped" / MODELING
# transformers' Auto classes -> the shipped file's classes (``trust_remote_code=True``)
AUTO_MAP = {
    "AutoConfig": "modeling_cmhsa.CmhsaConfig",
    "AutoModelForImageClassification": "modeling_cmhsa.CmhsaForImageClassification",
    "AutoImageProcessor": "modeling_cmhsa.CmhsaImageProcessor",
}
ARCHITECTURES = {"conv": "cmhsa_conv", "attn": "cmhsa_attn"}  # timm's registered names, by kind
CONFIG_ARG = "cmhsa_config"  # the model_args key holding the cmhsa config


def pretrained_cfg(cfg: ViTConfig, file: str | None = None, license_id: str = "mit") -> dict[str, Any]:
    """timm's description of how a model wants its input (what ``cmhsa eval`` does: bicubic resize
    to size / 0.875, centre crop, ImageNet's mean and std), where its head is, and the weights'
    licence (the model card's: io/model_card.data_license)."""
    from ..loaders import channel_stats

    mean, std = channel_stats(cfg.in_chans)
    # no first conv to adapt to other in_chans when the patch embedding is the identity (the paper's)
    first_conv = "patch_embed" if cfg.patch_embed == "linear" else ()
    # fixed_input_size: the relative position table is the patch grid's, so the image size is fixed
    return {
        "input_size": (cfg.in_chans, *cfg.img_size),
        "fixed_input_size": True,
        "mean": mean,
        "std": std,
        "interpolation": EVAL_INTERPOLATION,
        "crop_pct": EVAL_CROP_PCT,
        "num_classes": cfg.num_classes,
        "first_conv": first_conv,
        "classifier": "head",
        "file": file,
        "license": license_id,
    }


def preprocessing(cfg: ViTConfig) -> dict[str, str]:
    """How a model of ``cfg`` wants an image, as strings (an ONNX file's ``metadata_props``):
    ``cmhsa eval``'s transform, timm's eval one, step by step (resize the shorter side to
    floor(size / crop_pct), centre crop, scale to 0..1, normalise); only for RGB or grey images
    (``loaders.image_mode``: an export refuses a model of other channels before it writes)."""
    from ..loaders import image_mode

    pcfg = pretrained_cfg(cfg)
    c, h, w = pcfg["input_size"]
    return {
        "input_size": json_text([c, h, w], indent=None),
        "channels": image_mode(c),
        "resize_shorter_to": str(math.floor(min(h, w) / pcfg["crop_pct"])),
        "interpolation": pcfg["interpolation"],
        "crop": "center",
        "crop_pct": str(pcfg["crop_pct"]),
        "scale": "1/255",
        "mean": json_text(list(pcfg["mean"]), indent=None),
        "std": json_text(list(pcfg["std"]), indent=None),
        "num_classes": str(cfg.num_classes),
        "layout": "NCHW float32, input pixel_values, output logits",
    }


def timm_config(
    cfg: ViTConfig, classes: tuple[str, ...] | None = None, license_id: str = "mit"
) -> dict[str, Any]:
    """config.json's content for a model of ``cfg`` (``classes``: its outputs' names, as timm's
    ``push_to_hf_hub`` writes them, a top-level ``label_names``, which timm moves into
    ``pretrained_cfg`` and transformers' TimmWrapper reads as ``id2label``)."""
    pcfg = {k: v for k, v in pretrained_cfg(cfg, license_id=license_id).items() if k != "file"}
    doc: dict[str, Any] = {
        "architecture": ARCHITECTURES[cfg.kind],
        "num_classes": cfg.num_classes,
        "num_features": cfg.embed_dim,
    }
    if classes is not None:
        doc["label_names"] = list(classes)
    return {**doc, "model_args": {CONFIG_ARG: cfg.to_dict()}, "pretrained_cfg": pcfg, "auto_map": AUTO_MAP}


def write_timm_folder(
    folder: Folder,
    cfg: ViTConfig,
    state_dict: dict[str, Any],
    metadata: dict[str, str] | None = None,
    license_id: str | None = None,
) -> list[Path]:
    """Write the held ``folder``'s four files together (all or none): the weights, timm's
    config.json, the model card README.md (io/model_card.py, from ``metadata``) and the model for
    transformers (:data:`MODELING`); ``state_dict``:
    every tensor of the model (timm loads it strictly); ``license_id``: the weights' licence in both
    the card and ``pretrained_cfg`` (default: the training data's). The paths written."""
    classes = from_metadata(metadata or {}, cfg.num_classes, folder.show(WEIGHTS))
    license_id = check_license(license_id or data_license(metadata or {})[0])
    text = model_card(cfg, metadata or {}, cfg.num_params(), preprocessing(cfg), license_id, source_url())
    doc = json_text(timm_config(cfg, classes, license_id)) + "\n"
    targets = [Target(folder, name) for name in FILES]
    with atomic_names(*targets) as (tmp_weights, tmp_config, tmp_card, tmp_code):
        write_checkpoint(tmp_weights, cfg, state_dict, metadata, folder.show(WEIGHTS))
        tmp_config.write_text(doc, encoding="utf-8")
        tmp_card.write_text(text, encoding="utf-8")
        tmp_code.write_bytes(SHIPPED.read_bytes())
    return [t.show() for t in targets]


FILES = (WEIGHTS, CONFIG, CARD, MODELING)  # what a timm folder cmhsa writes holds


# pretrained_cfg's keys timm adds to a folder's (local-dir:, hf-hub:) before a model is built
TIMM_ADDED = ("file", "source", "hf_hub_id")
MAX_LICENSE = 100


def _plain(v: Any) -> Any:
    """JSON's view of a value, compared strictly: tuples as lists, nested; a bool never equal to a number."""
    if isinstance(v, bool):
        return ("bool", v)
    return [_plain(x) for x in v] if isinstance(v, list | tuple) else v


def _quoted(v: Any) -> str:
    """A value from a file in a message: its repr, cut at 60 characters."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_folder_config(doc: Any, where: object, added: tuple[str, ...] = ()) -> ViTConfig | None:
    """A timm folder's config.json, read as untrusted input before timm builds anything: None if it
    names an architecture that is not cmhsa's (timm's own to read), else the cmhsa config it holds,
    checked field by field as cmhsa writes it (:func:`timm_config`): ``model_args`` holds the cmhsa
    config and nothing else (no ``num_classes``, ``global_pool`` or ``device`` that timm would pass
    to the model's factory), the top-level ``num_classes`` and every ``pretrained_cfg`` key are what
    that config makes (``license`` any short text; ``added``: keys timm itself set), no other key. A
    one-line CmhsaError naming the field otherwise."""
    if not isinstance(doc, dict):
        raise CmhsaError("config.json is not a JSON object", where)
    arch = doc.get("architecture")
    if not isinstance(arch, str):
        raise CmhsaError(f"config.json's architecture is {type(arch).__name__}, not a model's name", where)
    kind = next((k for k, name in ARCHITECTURES.items() if name == arch), None)
    if kind is None:
        return None
    args = doc.get("model_args")
    if not isinstance(args, dict) or set(args) != {CONFIG_ARG}:
        what = _quoted(sorted(args)) if isinstance(args, dict) else type(args).__name__
        raise CmhsaError(
            f"config.json's model_args must hold {CONFIG_ARG!r} alone, not {what}: timm passes each to the "
            "model's factory; not a folder cmhsa wrote",
            where,
        )
    cfg = config_from_arg(args[CONFIG_ARG], kind, where)
    top = {"architecture", "num_classes", "num_features", "label_names", "model_args", "pretrained_cfg"}
    unknown = sorted(set(doc) - top - {"auto_map"} - set(TRANSFORMERS_KEYS))
    if unknown:
        raise CmhsaError(
            f"config.json holds {_quoted(unknown[0])}, which neither cmhsa nor transformers' save_pretrained "
            "writes",
            where,
        )
    auto_map = doc.get("auto_map", {})  # older folders have none
    if not isinstance(auto_map, dict) or not auto_map.items() <= AUTO_MAP.items():
        raise CmhsaError(
            f"config.json's auto_map is not the one cmhsa writes ({_quoted(auto_map)}): transformers "
            "would run other code than the folder's model; not a folder cmhsa wrote",
            where,
        )
    if "label_names" in doc:
        check_class_names(doc["label_names"], cfg.num_classes, where)
    check_transformers_keys(doc, cfg, where)
    written = timm_config(cfg)
    for key in ("num_classes", "num_features"):
        if key in doc and _plain(doc[key]) != _plain(written[key]):
            raise CmhsaError(
                f"config.json says {key} {_quoted(doc[key])} but its model_args' {CONFIG_ARG} makes "
                f"{written[key]!r}; timm would load a different model than the one saved",
                where,
            )
    pcfg = doc.get("pretrained_cfg")
    if not isinstance(pcfg, dict):
        raise CmhsaError(f"config.json's pretrained_cfg is {type(pcfg).__name__}, not a JSON object", where)
    expected = written["pretrained_cfg"]
    for key, value in pcfg.items():
        if key in added:
            continue
        if key not in expected and key != "label_names":
            raise CmhsaError(
                f"config.json's pretrained_cfg holds {_quoted(key)}, which cmhsa never writes", where
            )
        if key == "label_names":
            check_class_names(value, cfg.num_classes, where)
        elif key == "license":
            if not isinstance(value, str) or len(value) > MAX_LICENSE:
                raise CmhsaError("config.json's pretrained_cfg license is not a short text", where)
        elif _plain(value) != _plain(expected[key]):
            raise CmhsaError(
                f"config.json's pretrained_cfg says {key} {_quoted(value)} but its model_args' "
                f"{CONFIG_ARG} makes {_quoted(expected[key])}; timm would load or feed a different "
                "model than the one saved",
                where,
            )
    return cfg


def check_transformers_keys(doc: dict[str, Any], cfg: ViTConfig, where: object) -> None:
    """What transformers' ``save_pretrained`` adds to config.json (the shipped model's config) must
    describe the same model: its class and type cmhsa's, its class names the folder's (or the
    outputs' numbers where the folder names none), its options of the values it takes."""
    for key, allowed in TRANSFORMERS_KEYS.items():
        if key in doc and not allowed(doc[key]):
            raise CmhsaError(
                f"config.json's {key} is {_quoted(doc[key])}, not what the shipped model writes", where
            )
    id2label = doc.get("id2label")
    if id2label is not None:
        names = doc.get("label_names") or [str(i) for i in range(cfg.num_classes)]
        if not isinstance(id2label, dict) or id2label != {str(i): n for i, n in enumerate(names)}:
            raise CmhsaError(
                "config.json's id2label does not name the classes its label_names do (or, without them, "
                "the outputs' numbers): transformers would show other names than cmhsa",
                where,
            )


def _is_text(limit: int) -> Any:
    return lambda v: isinstance(v, str) and len(v) <= limit


# config.json keys transformers' save_pretrained writes for the shipped model, with the values each may hold
TRANSFORMERS_KEYS: dict[str, Any] = {
    "architectures": lambda v: v == ["CmhsaForImageClassification"],
    "model_type": lambda v: v == "cmhsa",
    "transformers_version": _is_text(40),
    "dtype": lambda v: v in ("float32", "float16", "bfloat16", "float64"),
    "torch_dtype": lambda v: v in ("float32", "float16", "bfloat16", "float64"),
    "id2label": lambda v: isinstance(v, dict),  # checked against the class names
    "label2id": lambda v: v is None or isinstance(v, dict),
    "drop_path_rate": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1,
    "problem_type": lambda v: (
        v in (None, "regression", "single_label_classification", "multi_label_classification")
    ),
    "output_hidden_states": lambda v: isinstance(v, bool),
    "return_dict": lambda v: isinstance(v, bool),
}

MAX_CONFIG_BYTES = 2**20  # a cmhsa config.json is about 1 KB


@dataclass(frozen=True)
class FolderModel:
    """A timm folder as every route reads it: the model its config.json describes (checked against
    the weights' own config where they record one), its class names, and the weights' metadata
    (cmhsa's, or, for a folder transformers' save_pretrained wrote, made from config.json)."""

    config: ViTConfig
    classes: tuple[str, ...] | None
    metadata: dict[str, str]
    saved_by: str  # "cmhsa", or "transformers" (weights without cmhsa's metadata)


def folder_config(path: Path) -> ViTConfig | None:
    """The timm folder ``path``'s config.json read as untrusted input (bounded, a regular file)
    and checked as cmhsa writes it (:func:`check_folder_config`), and against the weights where
    they are there (:func:`read_folder`); None for a folder of another architecture. What timm's
    loaders (``convit_convert.timm``) and every cmhsa command ask."""
    where = Path(path) / CONFIG
    doc = parse_json(read_text(where, MAX_CONFIG_BYTES, "timm config.json"), where, "config.json")
    cfg = check_folder_config(doc, where)
    weights = Path(path) / WEIGHTS
    if cfg is not None and weights.exists():  # a Hub download fetches config.json first
        check_weights(doc, cfg, where, weights)
    return cfg


def read_folder(path: Path) -> FolderModel:
    """The model a timm folder holds, for every route that reads one (cmhsa's commands, timm's
    loaders): config.json checked (:func:`folder_config`), then the weights' own config and class
    names held to it (:func:`check_weights`); a note where the folder's modeling_cmhsa.py is not
    the file cmhsa ships (transformers would run it; cmhsa never does)."""
    path = Path(path)
    cfg = folder_config(path)
    if cfg is None:
        raise CmhsaError("is a timm folder of another architecture than cmhsa's", path)
    if not (path / WEIGHTS).is_file():
        raise CmhsaError(f"is a timm folder without {WEIGHTS}", path)
    doc = parse_json(
        read_text(path / CONFIG, MAX_CONFIG_BYTES, "timm config.json"), path / CONFIG, "config.json"
    )
    metadata = read_metadata(path / WEIGHTS)
    note_modeling_file(path)
    if KIND_KEY in metadata:
        return FolderModel(cfg, from_metadata(metadata, cfg.num_classes, path / WEIGHTS), metadata, "cmhsa")
    names = doc.get("label_names")
    names = tuple(names) if names else None
    return FolderModel(cfg, names, to_metadata(names), "transformers")


def check_weights(doc: dict[str, Any], cfg: ViTConfig, config: Path, weights: Path) -> None:
    """config.json (``doc``, describing ``cfg``) must describe the model its weights hold where the
    weights record one (cmhsa's metadata: timm builds from the first, cmhsa from the second), and
    name its classes as they do; weights without cmhsa's metadata (transformers' save_pretrained)
    take config.json's. Every route that reads a folder asks this (timm's loaders too)."""
    metadata = read_metadata(weights)
    if KIND_KEY not in metadata:
        return
    held = ViTConfig.from_json(metadata.get(CONFIG_KEY, "null"), metadata[KIND_KEY], weights)
    check_one_truth(cfg, held, config, weights)
    check_label_names(doc, metadata, cfg, config, weights)


def check_one_truth(said: ViTConfig, held: ViTConfig, config: Path, weights: Path) -> None:
    """A timm folder's config.json must describe the model its weights hold: a one-line
    CmhsaError naming both files and the first field where they differ."""
    if said == held:
        return
    a, b = said.to_dict(), held.to_dict()
    field_name = next((k for k in a if a.get(k) != b.get(k)), "kind")
    show = (lambda v: str(v)[:40]) if field_name != "kind" else None
    one, two = (said.kind, held.kind) if show is None else (show(a.get(field_name)), show(b.get(field_name)))
    raise CmhsaError(
        f"says {field_name} {one} but {weights.name} holds a model of {field_name} {two}: timm would "
        "build one model and cmhsa another; not a folder cmhsa wrote",
        config,
    )


# sha256 of the modeling_cmhsa.py each earlier cmhsa release shipped -> that release
SHIPPED_BEFORE = {"9266a368a014daac7ef835797cf29fc485ca23ec6ede18eeeb8f0684ff7c4972": "0.1.0"}
MAX_MODELING_BYTES = 2**20


def note_modeling_file(path: Path) -> None:
    """A note, where the folder's modeling_cmhsa.py is not the file this cmhsa ships: which release
    shipped it, if one did. transformers runs that file with ``trust_remote_code=True``; cmhsa
    reads the folder's config.json and weights only, never the file."""
    code = path / MODELING
    if not code.exists():
        return
    with open_regular(code, MAX_MODELING_BYTES, "modeling_cmhsa.py") as f:
        text = f.read(MAX_MODELING_BYTES + 1)
    if text == SHIPPED.read_bytes():
        return
    release = SHIPPED_BEFORE.get(hashlib.sha256(text).hexdigest())
    which = f"it is the file cmhsa {release} shipped" if release else "no cmhsa release shipped this file"
    notice(
        f"{code} is not the file this cmhsa ({__version__}) ships ({which}): transformers "
        "runs it with trust_remote_code=True, so read it before you do; cmhsa never runs it"
    )


def check_label_names(
    doc: dict[str, Any], metadata: dict[str, str], cfg: ViTConfig, config: Path, weights: Path
) -> None:
    """One source of a timm folder's class names: the weights' (``cmhsa.classes``, what ``cmhsa
    predict`` and ``eval`` read). config.json's ``label_names`` (what timm and transformers'
    pipeline read) must be those names, or absent with them, and ``pretrained_cfg``'s, if there,
    too; else one line naming the folder's config.json and the first class that differs."""
    names = from_metadata(metadata, cfg.num_classes, weights)
    pcfg = doc.get("pretrained_cfg") if isinstance(doc.get("pretrained_cfg"), dict) else {}
    said = {"label_names": doc.get("label_names")}
    if pcfg.get("label_names") is not None:
        said["pretrained_cfg's label_names"] = pcfg["label_names"]
    for field_name, listed in said.items():
        listed = None if listed is None else tuple(listed)
        if listed == names:
            continue
        if listed is None or names is None:
            missing = field_name if listed is None else f"{WEIGHTS}'s class names"
            detail = f"{missing} are absent where the other names the classes"
        else:
            i = next(i for i, (a, b) in enumerate(zip(listed, names, strict=True)) if a != b)
            detail = f"class {i} is {listed[i][:40]!r} in {field_name}, {names[i][:40]!r} in {WEIGHTS}"
        raise CmhsaError(
            f"config.json's {field_name} are not the class names {WEIGHTS} records ({detail}): timm and "
            "transformers would show one set and cmhsa another; not a folder cmhsa wrote",
            config,
        )


def config_from_arg(value: Any, kind: str, where: object) -> ViTConfig:
    """The cmhsa config a timm folder's ``model_args[CONFIG_ARG]`` holds (timm passes each of
    model_args to the model's factory as a keyword); a one-line CmhsaError naming ``where`` if it is
    not a valid config of ``kind``."""
    if not isinstance(value, dict):
        raise CmhsaError(f"model_args' {CONFIG_ARG!r} is not a JSON object: not a folder cmhsa wrote", where)
    return ViTConfig.from_dict(value, kind, where)
