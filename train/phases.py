"""The model each phase trains, and where its weights come from.

Phase 1: a ConvViT, randomly initialised, or from a conv checkpoint's weights (``--init``: a fresh
run, its optimizer and schedule new). Phase 2: an attention ViT from ``--init``, which is
- a conv-phase checkpoint: converted in memory (Theorem 1) and verified against the conv model
  before the first step; a conversion that is not exact within ``verify_tol`` aborts the run;
- an attention checkpoint: loaded as it is;
- ``random``: the paper's "2nd phase only" baseline;
- ``mimetic`` or ``impulse``: random init with attention started local (:mod:`convit_convert.starts`).
With a checkpoint (a file, or a timm folder cmhsa wrote) the architecture is the checkpoint's; model
flags given explicitly must agree. Data with another number of classes than the checkpoint's gets a
new head (fine-tuning, as timm's ``--pretrained`` with another ``--num-classes``): every other
tensor is the checkpoint's. The checkpoint also decides the channels: data of other channels is
converted to the checkpoint's (PIL's conversion), as the run that made it converted its data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..api import as_float32, convert_checkpoint, load_checkpoint
from ..config import ViTConfig
from ..conv_mixer import AUTO_FORM, token_form_bytes
from ..errors import CheckFailed, CmhsaError
from ..io.checkpoint import Checkpoint
from ..io.report import sha256_file
from ..loaders import image_mode
from ..model import ATTENTION_PARAMS, VisionTransformer
from ..options.training import TrainConfig
from ..resources import check_fits
from ..starts import start_model


@dataclass
class PhaseModel:
    model: VisionTransformer
    config: ViTConfig  # its kind says which phase's model it is
    init: dict[str, Any] = field(default_factory=dict)  # where the weights came from, for config.json


def flag_config(cfg: TrainConfig, num_classes: int) -> ViTConfig:
    """The conv config the model flags describe. A kernel reaching past the image is refused here,
    for a model about to be trained, not in ViTConfig: the conversion is exact for it too."""
    mcfg = ViTConfig.build(
        img_size=cfg.model.img_size,
        patch_size=cfg.model.patch_size,
        in_chans=cfg.model.in_chans,
        hidden_chans=cfg.model.hidden_chans,
        depth=cfg.model.depth,
        mlp_ratio=cfg.model.mlp_ratio,
        num_classes=num_classes,
        kernel_size=cfg.model.kernel_size,
        dilation=cfg.model.dilation,
    )
    h, w = mcfg.img_size
    reach = mcfg.dilation * (mcfg.kernel_size - 1) // 2
    if reach >= max(h, w):  # its outer taps would only ever see the zero padding
        raise CmhsaError(
            f"kernel_size {mcfg.kernel_size} (dilation {mcfg.dilation}) reaches {reach} pixels, "
            f"beyond the {h}x{w} image"
        )
    return mcfg


def _check_explicit(cfg: TrainConfig, ckpt_cfg: ViTConfig, num_classes: int, path: object) -> None:
    """Model flags the user typed must describe the checkpoint they also gave, compared field by
    field as the ViTConfig values they set: ``mlp_ratio`` as the MLP width it gives at the
    checkpoint's embed_dim (the ratio read back from a width is not the ratio typed: 130 / 48)."""
    square = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    as_field = {  # flag -> (ViTConfig field, the flag's value as that field)
        "img_size": ("img_size", square),
        "in_chans": ("in_chans", int),
        "patch_size": ("patch_size", int),
        "hidden_chans": ("hidden_chans", int),
        "depth": ("depth", int),
        "kernel_size": ("kernel_size", int),
        "dilation": ("dilation", int),
        "mlp_ratio": ("mlp_hidden_dim", lambda r: round(ckpt_cfg.embed_dim * r)),
        "heads": ("num_heads", int),
        "qk_dim": ("qk_dim", int),
        "sink": ("sink", bool),
        "pinning": ("pinning", str),
    }
    for name in sorted(cfg.given & as_field.keys()):
        field_name, convert = as_field[name]
        have, typed = getattr(ckpt_cfg, field_name), cfg.flag(name)
        if have is not None and typed is not None and convert(typed) != have:
            said = f"`{name}` {typed}" + (f" ({field_name} {convert(typed)})" if field_name != name else "")
            raise CmhsaError(f"{said} disagrees with the checkpoint's {field_name} {have}", path)
    image_mode(ckpt_cfg.in_chans, path)  # 1 or 3: the loader converts every image to it


HEAD = ("head.weight", "head.bias")  # the classifier: what fine-tuning on other classes makes anew


def load_start(cfg: TrainConfig, num_classes: int, data_chans: int | None, log: Any = print) -> Checkpoint:
    """The checkpoint ``init`` names (a file, or a timm folder cmhsa wrote), float32, checked
    against the flags given (:func:`_check_explicit`: an explicit ``in_chans`` must be the
    checkpoint's). The checkpoint decides the channels: data of other channels is converted to
    them as the run that made it converted its data (PIL's conversion: RGB to grey weighs, grey to
    RGB repeats), said in one line; the number of classes may differ (:func:`fitted_head`)."""
    ckpt = as_float32(load_checkpoint(cfg.start.init))
    _check_explicit(cfg, ckpt.config, num_classes, ckpt.path)
    have = ckpt.config.in_chans
    if data_chans is not None and data_chans != have:
        colours = {1: "grey", 3: "colour"}
        log(
            f"note: the {cfg.data.name} images are {colours.get(data_chans, data_chans)} and the `init` "
            f"checkpoint takes {have} channel{'s' * (have > 1)}: every image is converted to {have}, as the "
            "checkpoint decides (cmhsa adapts no patch embedding; `in_chans` other than the checkpoint's "
            "is refused)"
        )
    return ckpt


def start_record(ckpt: Checkpoint, init: str) -> dict[str, Any]:
    """What a run records of the model it starts from (``cmhsa.init``, the model card's): the file
    and its sha256, the data that model was trained on and that data's licence, and the Hub model
    it is a download of (huggingface_hub's cache layout), where known."""
    from ..io.hub import hub_id_of, is_hub_name, parse_hub_name
    from ..io.model_card import data_license, trained_data

    record: dict[str, Any] = {"init": init, "init_kind": ckpt.kind, "init_sha256": sha256_file(ckpt.path)}
    data = trained_data(ckpt.metadata)
    if data is not None:
        record["init_data"], record["init_license"] = data, data_license(ckpt.metadata)[0]
    if is_hub_name(init):
        hub = parse_hub_name(init)[0]
    else:
        hub = hub_id_of(Path(init).expanduser()) if Path(init).expanduser().is_dir() else None
    if hub is not None:
        record["init_hub_id"] = hub
    return record


def fitted_head(
    model_cfg: ViTConfig, tensors: dict[str, torch.Tensor], num_classes: int, drop_path: float, **kw: Any
) -> tuple[VisionTransformer, ViTConfig, list[str]]:
    """A model of ``model_cfg`` holding ``tensors``; for data of another ``num_classes``, a new head
    (freshly initialised, as the model makes one) and every other tensor loaded. The names made anew."""
    if model_cfg.num_classes == num_classes:
        model = VisionTransformer(model_cfg, drop_path, **kw)
        model.load_state_dict(tensors)
        return model, model_cfg, []
    mcfg = dataclasses.replace(model_cfg, num_classes=num_classes)
    model = VisionTransformer(mcfg, drop_path, **kw)
    kept = {k: v for k, v in tensors.items() if k not in HEAD}
    missing, unexpected = model.load_state_dict(kept, strict=False)
    assert sorted(missing) == sorted(HEAD) and not unexpected, (missing, unexpected)
    return model, mcfg, list(HEAD)


def said_replaced(ckpt: Checkpoint, num_classes: int, replaced: list[str], log: Any) -> dict[str, Any]:
    """One line saying which tensors fine-tuning made anew; what config.json records of it."""
    if not replaced:
        return {}
    log(
        f"fine-tuning: the checkpoint's head is for {ckpt.config.num_classes} classes and the data has "
        f"{num_classes}: {', '.join(replaced)} made anew, every other tensor loaded from {ckpt.path}"
    )
    return {"replaced": replaced, "init_num_classes": ckpt.config.num_classes}


def freeze_attention(model: VisionTransformer) -> None:
    """The ablation's model: where attention looks stays as converted; values, outputs, MLPs train."""
    for name, p in model.named_parameters():
        if name.endswith(ATTENTION_PARAMS):
            p.requires_grad_(False)


def training_bytes(cfg: TrainConfig, mcfg: ViTConfig) -> tuple[int, str]:
    """The memory a run of ``cfg`` training a model of ``mcfg`` holds, and what that is: float32
    weights, gradients and two AdamW moments, and (on CPU) a batch's activations kept for the
    backward; all of it once per seed of a `seeds` stack, which holds and steps every seed at once."""
    on_cpu = cfg.runtime.device == "cpu" or not torch.cuda.is_available()
    batch, stack = cfg.recipe.batch_size, max(1, len(cfg.runtime.seeds))
    need = 16 * mcfg.num_params() + (mcfg.activation_bytes(batch, training=True) if on_cpu else 0)
    form = AUTO_FORM.get("cpu", "pixels") if cfg.runtime.conv_form == "auto" else cfg.runtime.conv_form
    tokens = on_cpu and mcfg.kind == "conv" and form == "tokens"
    if tokens:  # the form that will run, sized as it allocates
        sizes = (mcfg.hidden_chans, mcfg.kernel_size, mcfg.patch_size, mcfg.dilation, mcfg.grid_size)
        need += mcfg.depth * token_form_bytes(*sizes, batch)
    what = f"training a {mcfg.kind} model of {mcfg.num_params():,} parameters at batch {batch}"
    if stack > 1:
        what = f"{what}, {stack} seeds stacked (`seeds`: each seed's weights, moments and batch at once)"
    return stack * need, what + (" in the token form (`conv_form` tokens)" if tokens else "")


def check_trainable(cfg: TrainConfig, mcfg: ViTConfig) -> None:
    """Refuse, with the estimate, a model whose training cannot fit in memory (:func:`training_bytes`)."""
    check_fits(*training_bytes(cfg, mcfg))


def build_phase_model(
    cfg: TrainConfig, num_classes: int, log: Any = print, data_chans: int | None = None
) -> PhaseModel:
    """The model ``cfg``'s phase trains on data of ``num_classes`` classes and ``data_chans``
    channels (None: not known), with its weights (module docstring)."""
    if cfg.phase == "phase1":
        if cfg.from_checkpoint:
            return _phase1_from_checkpoint(cfg, num_classes, log, data_chans)
        if cfg.start.init != "random" and (not cfg.given or "init" in cfg.given):
            raise CmhsaError(
                f"`init` {cfg.start.init} is a start of phase 2's attention; phase 1 starts from random "
                "weights or a conv checkpoint"
            )
        mcfg = flag_config(cfg, num_classes)
        check_trainable(cfg, mcfg)
        model = VisionTransformer(mcfg, cfg.model.drop_path, conv_form=cfg.runtime.conv_form)  # type: ignore[arg-type]
        return PhaseModel(model, mcfg, {"init": "random"})
    if not cfg.from_checkpoint:
        mcfg = cfg.conversion.plan(flag_config(cfg, num_classes)).config  # no conversion: its layout
        mcfg.validate()
        check_trainable(cfg, mcfg)
        model = VisionTransformer(mcfg, cfg.model.drop_path)
        if cfg.start.init == "random":
            return PhaseModel(model, mcfg, {"init": "random"})
        info = start_model(
            model,
            cfg.start.init,
            seed=cfg.seed,
            mimetic_alpha=cfg.start.mimetic_alpha,
            mimetic_beta=cfg.start.mimetic_beta,
            impulse_offsets=cfg.start.impulse_offsets,
            margin=cfg.conversion.margin,
        )
        log(
            f"started {cfg.start.init}: "
            f"{', '.join(f'{k} {v}' for k, v in info.items() if k not in ('init', 'pinned'))}"
        )
        return PhaseModel(model, mcfg, info)

    ckpt = load_start(cfg, num_classes, data_chans, log)
    if ckpt.kind == "attn":
        check_trainable(cfg, dataclasses.replace(ckpt.config, num_classes=num_classes))
        model, mcfg, replaced = fitted_head(ckpt.config, ckpt.tensors, num_classes, cfg.model.drop_path)
        info = start_record(ckpt, str(cfg.start.init))
        return PhaseModel(model, mcfg, {**info, **said_replaced(ckpt, num_classes, replaced, log)})
    # the model the conversion will make, sized before anything of its size is built
    check_trainable(cfg, cfg.conversion.plan(ckpt.config).config)
    # the same conversion and verification as `cmhsa convert`
    conv = convert_checkpoint(ckpt, cfg.conversion)
    mcfg, result = conv.config, conv.verification
    assert result is not None
    check_trainable(cfg, mcfg)
    worst = result.worst
    log(
        f"converted {cfg.start.init}: {mcfg.num_heads} heads "
        f"({conv.summary()['pinned_heads']} pinned), qk_dim {mcfg.qk_dim}, "
        f"sink {'on' if mcfg.sink else 'off'}, pinning {mcfg.pinning}; "
        f"verified: worst relative error {worst.rel:.2e} ({worst.tensor}, "
        f"{worst.region}), tol {cfg.conversion.tol:g}"
    )
    if not result.passed:
        raise CheckFailed(
            f"{cfg.start.init}: the converted model is not exact: relative error "
            f"{worst.rel:.2e} at {worst.tensor} "
            f"({worst.region}) > `verify_tol` {cfg.conversion.tol:g}; not training from it"
        )
    info = {
        **start_record(ckpt, str(cfg.start.init)),
        "verify_worst_rel": worst.rel,
        "verify_tol": cfg.conversion.tol,
        "verify_criterion": result.criterion,
    }
    model, mcfg, replaced = fitted_head(mcfg, conv.tensors, num_classes, cfg.model.drop_path)
    return PhaseModel(model.train(), mcfg, {**info, **said_replaced(ckpt, num_classes, replaced, log)})


def _phase1_from_checkpoint(
    cfg: TrainConfig, num_classes: int, log: Any, data_chans: int | None
) -> PhaseModel:
    """Phase 1 from a conv checkpoint's weights: the checkpoint's model (a new head for other
    classes); the run is otherwise fresh (a new optimizer and schedule: :mod:`.recipe`)."""
    ckpt = load_start(cfg, num_classes, data_chans, log)
    if ckpt.kind != "conv":
        raise CmhsaError(
            "is an attention checkpoint; phase 1 trains the convolutional model: continue it with "
            "`cmhsa train phase2 --init`",
            ckpt.path,
        )
    check_trainable(cfg, dataclasses.replace(ckpt.config, num_classes=num_classes))
    model, mcfg, replaced = fitted_head(
        ckpt.config, ckpt.tensors, num_classes, cfg.model.drop_path, conv_form=cfg.runtime.conv_form
    )
    log(f"starting from {ckpt.path}'s weights: a fresh run (new optimizer and schedule, warm-up included)")
    info = start_record(ckpt, str(cfg.start.init))
    return PhaseModel(model, mcfg, {**info, **said_replaced(ckpt, num_classes, replaced, log)})
