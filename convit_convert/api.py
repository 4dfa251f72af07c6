"""The library's operations on model files, each returning a typed report (the CLI renders them):
``load_checkpoint`` (any format), ``convert_checkpoint`` / ``convert_file``, ``verify_files``,
``export_file`` and ``inspect_file``. ``cmhsa train`` calls the same functions.

Bad input raises :class:`CmhsaError` before anything is written; a check that fails is a report
with ``passed`` False, its output not written and its JSON report written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .approximate import (
    Approximation,
    BlockChoice,
    Calibration,
    HeldOut,
    choose,
    guard_logits,
    held_back,
    heldout_errors,
    noise_calibration,
    problems,
)
from .config import ViTConfig
from .construct import convert_state_dict, pinned_offsets
from .errors import CmhsaError, article
from .io.atomic import atomic_paths, check_writable
from .io.checkpoint import Checkpoint, check_geometry, load_tensor_checkpoint, write_checkpoint
from .io.report import default_report_path, environment, file_facts, report_text, write_report
from .model import VisionTransformer
from .resources import check_fits
from .spec import DEFAULT_TOL, ConversionPlan, ConversionSpec, Offset, check_tol
from .theory import HeadCount, head_count
from .verify import VerifyResult, verify_models


def load_checkpoint(
    path: str | Path, *, img_size: tuple[int, int] | None = None, patch_size: int | None = None,
    dilation: int = 1, norm_eps: float = 1e-6, onnx_tol: float = DEFAULT_TOL,
) -> Checkpoint:  # fmt: skip
    """Any model file: cmhsa safetensors, a bare conv-phase state dict (given ``img_size`` and
    ``patch_size``), or a conv-phase ONNX graph, read by its structure and checked against
    onnxruntime within ``onnx_tol`` (:mod:`convit_convert.onnx.importer`)."""
    path = Path(path)
    if path.suffix.lower() != ".onnx":
        return load_tensor_checkpoint(path, img_size=img_size, patch_size=patch_size, dilation=dilation, norm_eps=norm_eps)  # fmt: skip
    from .onnx.importer import import_onnx

    ckpt = import_onnx(path, tol=onnx_tol)
    check_geometry(ckpt.config, img_size, patch_size, path, "graph")
    return ckpt


def check_batch(batch: int) -> None:
    if batch < 1:
        raise CmhsaError(f"`batch` must be positive, got {batch}")


def resolve_device(name: str) -> str:
    """'auto' is CUDA when present; anything but cpu, cuda, cuda:N, or a GPU that is not there, is bad input."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    m = re.fullmatch(r"cuda(?::(\d{1,4}))?", name)
    if name != "cpu" and m is None:
        raise CmhsaError(f"`device` must be auto, cpu, cuda or cuda:N, got {name!r}")
    if m is not None and not torch.cuda.is_available():
        raise CmhsaError(f"`device` {name}: CUDA is not available here (use `device` cpu or auto)")
    if m is not None and m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise CmhsaError(f"`device` {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    return name


def resolve_dtype(name: str) -> torch.dtype:
    if name not in ("float32", "float64"):
        raise CmhsaError(f"`dtype` must be float32 or float64, got {name!r}")
    return getattr(torch, name)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def check_outputs(source: Path, output: Path, report_path: Path, suffix: str, what: str) -> None:
    """Before any work: the output's suffix says what is written, both outputs are writable,
    neither is the input, and they are not the same file."""
    if output.suffix.lower() != suffix:
        raise CmhsaError(f"writes {what}: give the output the suffix {suffix}", output)
    for p, name in ((output, "output"), (report_path, "report")):
        if _same_file(p, source):
            raise CmhsaError(f"{name} path is the input file; choose another", p)
        check_writable(p)
    if _same_file(output, report_path):
        raise CmhsaError("report path is the output path; choose another", report_path)


@dataclass
class Conversion:
    """A conv checkpoint converted in memory (Theorem 1) by ``plan``, and its verification."""

    source: Checkpoint
    plan: ConversionPlan
    tensors: dict[str, torch.Tensor]
    verification: VerifyResult | None = None
    timings: dict[str, float] = field(default_factory=dict)
    approximation: Approximation | None = None  # fewer heads than the theorem needs

    @property
    def config(self) -> ViTConfig:
        """The attention config."""
        return self.plan.config

    @property
    def pinned(self) -> list[Offset | None]:
        """Per head: the offset it attends to, None if it reads nothing (an approximate conversion:
        the first block's kept offsets)."""
        return list(self.plan.pinned if self.approximation is None else self.approximation.blocks[0].kept)

    @property
    def passed(self) -> bool:
        return self.verification is None or self.verification.passed

    def model(self, drop_path_rate: float = 0.0) -> VisionTransformer:
        model = VisionTransformer(self.config, drop_path_rate)
        model.load_state_dict(self.tensors)
        return model

    def summary(self) -> dict[str, Any]:
        pinned, plan = self.pinned, self.plan
        return {
            "heads": plan.config.num_heads,
            "pinned_heads": sum(o is not None for o in pinned),
            "offsets": [None if o is None else list(o) for o in pinned],
            "offset_logit": plan.offset_logit,
            "sink_logit": plan.sink_logit,
            "qk_init_std": plan.spec.qk_init_std,
            "approximation": None if self.approximation is None else self.approximation.to_dict(),
        }


def convert_checkpoint(
    ckpt: Checkpoint, spec: ConversionSpec | None = None, *, verify: bool = True, batch: int = 4,
    dtype: torch.dtype = torch.float32, device: str = "cpu",
    calibrate: Callable[[ViTConfig], Calibration] | None = None,
) -> Conversion:  # fmt: skip
    """Convert a conv checkpoint as ``spec`` says (default: the paper's construction) and, unless
    ``verify`` is False, verify it against the conv model on ``batch`` random images: every relative
    error must be <= ``spec.tol``.

    An approximate spec (``approximate`` with ``heads`` below what the kernel needs) keeps the
    ``heads`` offsets chosen by ``spec.rule`` and refits their W^O on the images
    ``calibrate(config)`` makes (called only then; default: noise images), then measures the result
    on its held-out images (:mod:`convit_convert.approximate`); with enough heads it is the exact
    conversion. Verification still judges against ``spec.tol``."""
    spec = spec or ConversionSpec()
    if ckpt.kind != "conv":
        raise CmhsaError(
            f"is {article(ckpt.kind)} checkpoint already; convert takes a conv-phase one", ckpt.path
        )
    check_batch(batch)
    t = time.perf_counter()
    src = ckpt.config
    plan = spec.plan(src)
    # the output's size is known before anything is built: refuse what cannot fit (float32 weights,
    # the output and the conv model held together, and verification's activations)
    out_cfg = plan.config
    need = 4 * (out_cfg.num_params() + src.num_params()) + (out_cfg.activation_bytes(batch) if verify else 0)
    check_fits(
        need * dtype.itemsize // 4,
        f"the converted model ({out_cfg.num_heads} heads, qk_dim {out_cfg.qk_dim})",
        ckpt.path,
    )
    approx, conv_model = None, None
    if plan.approximate:
        calibration = calibrate(src) if calibrate else noise_calibration(src, seed=spec.seed)
        conv_model = ckpt.model()  # built once: choice, held-out errors and verification share it
        blocks = choose(
            as_float32_model(ckpt, conv_model),
            out_cfg.num_heads,
            calibration.images.float(),
            spec.rule,
            spec.refit,
        )
        approx = approximation(ckpt, plan, conv_model, blocks, calibration)
    tensors = convert_state_dict(
        ckpt.tensors, plan, path=ckpt.path, overrides=None if approx is None else overrides(ckpt, approx.blocks)
    )  # fmt: skip
    conv = Conversion(ckpt, plan, tensors, approximation=approx)
    conv.timings["convert_s"] = time.perf_counter() - t
    if approx is not None:
        t = time.perf_counter()
        approx.heldout = heldout_errors(conv_model, conv.model(), calibration.heldout, calibration.labels)  # type: ignore[arg-type]
        conv.timings["heldout_s"] = time.perf_counter() - t
    if verify:
        t = time.perf_counter()
        conv.verification = verify_models(
            conv_model or ckpt.model(), conv.model(), batch=batch, seed=spec.seed, dtype=dtype, device=device,
            tol=spec.tol,
        )  # fmt: skip
        conv.timings["verify_s"] = time.perf_counter() - t
    return conv


def approximation(
    ckpt: Checkpoint, plan: ConversionPlan, conv: VisionTransformer, blocks: list[BlockChoice],
    calibration: Calibration,
) -> Approximation:  # fmt: skip
    """``plan``'s per-block choices (each refit already judged on its own block), their refits then
    guarded on the logits of the held-back calibration images."""
    spec, images = plan.spec, calibration.images.float()
    approx = Approximation(spec.rule, spec.refit, calibration.source, len(images), blocks)
    if any(b.refit_kept for b in blocks):
        approx.guard_images = held = held_back(len(images))
        approx.blocks, approx.guard_logits_drop, approx.guard_logits_error = guard_logits(
            conv, blocks, images[-held:], lambda c: converted_model(ckpt, plan, c)
        )
    return approx


def as_float32_model(ckpt: Checkpoint, model: VisionTransformer) -> VisionTransformer:
    """``model`` (``ckpt``'s, in its dtype) if that is float32, else ``ckpt``'s model in float32: the
    approximation's choice runs on float32 activations (its fits in float64)."""
    return model if ckpt.dtype == torch.float32 else ckpt.model(torch.float32)


def overrides(ckpt: Checkpoint, blocks: list[BlockChoice]) -> list[tuple[list[Offset], torch.Tensor]]:
    """An approximate conversion's per-block offsets and W^O, in the checkpoint's dtype."""
    return [(c.kept, c.wo.to(ckpt.dtype)) for c in blocks]


def converted_model(
    ckpt: Checkpoint, plan: ConversionPlan, blocks: list[BlockChoice] | None = None
) -> VisionTransformer:
    """The attention model ``plan`` converts ``ckpt`` into, in eval mode; ``blocks``: an
    approximate conversion's choices."""
    model = VisionTransformer(plan.config)
    sd = convert_state_dict(
        ckpt.tensors, plan, path=ckpt.path, overrides=None if blocks is None else overrides(ckpt, blocks)
    )
    model.load_state_dict(sd)
    return model.eval()


@dataclass
class SweepRow:
    """One head count of :func:`heads_sweep`: worst block on the calibration set (plain dropping,
    refit), and the converted model on the held-out images."""

    heads: int
    calib_drop_error: float
    calib_refit_error: float
    heldout: HeldOut
    kept: list[list[Offset]] | None  # per block; None: every offset (the exact conversion)
    refit_kept: list[bool] | None  # per block, whether the guarded refit was kept

    def to_dict(self) -> dict[str, Any]:
        h = self.heldout
        return {
            "heads": self.heads, "calib_drop_error": self.calib_drop_error,
            "calib_refit_error": self.calib_refit_error, "heldout_mixer_error": max(h.mixer_errors),
            "heldout_logits_error": h.logits_error, "conv_top1": h.conv_top1, "attn_top1": h.attn_top1,
            "kept": "all" if self.kept is None else [[list(o) for o in k] for k in self.kept],
            "refit_kept": self.refit_kept,
        }  # fmt: skip


@dataclass
class HeadsSweep:
    """``cmhsa heads --checkpoint``: every head count from 1 to the bound, measured."""

    checkpoint: Checkpoint
    rule: str
    calibration: str
    heldout_images: int
    rows: list[SweepRow]

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": str(self.checkpoint.path), "rule": self.rule, "calibration": self.calibration,
            "heldout_images": self.heldout_images, "rows": [r.to_dict() for r in self.rows],
        }  # fmt: skip


def heads_sweep(
    ckpt: Checkpoint, calibration: Calibration | None = None, rule: str = "greedy", seed: int = 0
) -> HeadsSweep:
    """For every N from 1 to the bound, the approximate conversion's errors (as ``convert
    --approximate``), from one pass of the calibration images through the conv model and one drop
    sequence per block: N's choice is its prefix."""
    if ckpt.kind != "conv":
        raise CmhsaError(f"is {article(ckpt.kind)} checkpoint; the sweep needs a conv-phase one", ckpt.path)
    cfg = ckpt.config
    spec = ConversionSpec(approximate=True, rule=rule, seed=seed)
    calibration = calibration or noise_calibration(cfg, seed=seed)
    conv = ckpt.model()
    probs = problems(as_float32_model(ckpt, conv), calibration.images.float(), rule)
    rows = []
    for n in range(1, spec.plan(cfg).needed + 1):
        plan = spec.replace(heads=n).plan(cfg)
        a = None
        if plan.approximate:
            a = approximation(ckpt, plan, conv, [p.choice(n) for p in probs], calibration)
        attn = converted_model(ckpt, plan, None if a is None else a.blocks)
        h = heldout_errors(conv, attn, calibration.heldout, calibration.labels)
        rows.append(SweepRow(
            n, 0.0 if a is None else max(b.drop_error for b in a.blocks),
            0.0 if a is None else max(b.refit_error for b in a.blocks), h,
            None if a is None else [b.kept for b in a.blocks], None if a is None else [b.refit_kept for b in a.blocks],
        ))  # fmt: skip
    return HeadsSweep(ckpt, rule, calibration.source, len(calibration.heldout), rows)


@dataclass
class ConvertReport:
    conversion: Conversion
    output: Path
    report_path: Path
    input_facts: dict[str, Any]
    output_facts: dict[str, Any] | None
    timings: dict[str, float]

    @property
    def passed(self) -> bool:
        return self.conversion.passed

    def to_dict(self) -> dict[str, Any]:
        c, ckpt = self.conversion, self.conversion.source
        return {
            "command": "convert",
            "passed": None if c.verification is None else c.verification.passed,
            "input": {
                **self.input_facts,
                "kind": "conv",
                "read_as": ckpt.source,
                "onnx_import": ckpt.import_report,
                "dtype": str(ckpt.dtype).removeprefix("torch."),
            },
            "output": self.output_facts,
            "config": c.config.to_dict(),
            "conversion": c.summary(),
            "verification": None if c.verification is None else c.verification.to_dict(),
            "timings": self.timings,
            "environment": environment(),
        }


def convert_file(
    input: Path, output: Path, spec: ConversionSpec | None = None, *, report: Path | None = None,
    img_size: tuple[int, int] | None = None, patch_size: int | None = None, dilation: int = 1,
    norm_eps: float = 1e-6, dtype: str = "float32", device: str = "auto", verify: bool = True, batch: int = 4,
    calibrate: Callable[[ViTConfig], Calibration] | None = None,
) -> ConvertReport:  # fmt: skip
    """``cmhsa convert``: load, convert as ``spec`` says and verify (:func:`convert_checkpoint`),
    write the attention checkpoint if verification passed, and the JSON report either way."""
    spec = spec or ConversionSpec()
    report_path = report or default_report_path(output)
    check_outputs(input, output, report_path, ".safetensors", "a safetensors checkpoint (export writes ONNX)")
    verify_dtype = resolve_dtype(dtype)
    verify_device = resolve_device(device) if verify else "cpu"
    t = time.perf_counter()
    ckpt = load_checkpoint(input, img_size=img_size, patch_size=patch_size, dilation=dilation, norm_eps=norm_eps, onnx_tol=spec.tol)  # fmt: skip
    timings = {"load_s": time.perf_counter() - t}
    input_facts = file_facts(input)
    conv = convert_checkpoint(
        ckpt, spec, verify=verify, batch=batch, dtype=verify_dtype, device=verify_device, calibrate=calibrate
    )
    timings.update(conv.timings)
    output_facts = None
    # the model and its report together or neither: a failed write keeps both previous files
    with atomic_paths(*([output] if conv.passed else []), report_path) as tmps:
        if conv.passed:
            t = time.perf_counter()
            digest = write_checkpoint(tmps[0], conv.config, conv.tensors, {"cmhsa.source_sha256": input_facts["sha256"]}, output)  # fmt: skip
            timings["write_s"] = time.perf_counter() - t
            output_facts = {"path": str(output), "bytes": tmps[0].stat().st_size, "sha256": digest}
        result = ConvertReport(conv, output, report_path, input_facts, output_facts, timings)
        tmps[-1].write_text(report_text(result.to_dict()), encoding="utf-8")
    return result


@dataclass
class VerifyReport:
    conv: Checkpoint
    attn: Checkpoint
    result: VerifyResult
    timings: dict[str, float]

    @property
    def passed(self) -> bool:
        return self.result.passed

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": "verify",
            "passed": self.passed,
            "conv": file_facts(self.conv.path),
            "attn": file_facts(self.attn.path),
            "config": self.attn.config.to_dict(),
            "verification": self.result.to_dict(),
            "timings": self.timings,
            "environment": environment(),
        }


def verify_files(
    conv: Path, attn: Path, *, tol: float = DEFAULT_TOL, dtype: str = "float32", batch: int = 4, seed: int = 0,
    device: str = "auto", report: Path | None = None,
) -> VerifyReport:  # fmt: skip
    """``cmhsa verify``: does the attn checkpoint compute what the conv checkpoint computes?"""
    check_tol(tol)
    check_batch(batch)
    verify_dtype, verify_device = resolve_dtype(dtype), resolve_device(device)
    if report is not None:
        for p in (conv, attn):
            if _same_file(report, p):
                raise CmhsaError("report path is an input file; choose another", report)
        check_writable(report)
    t = time.perf_counter()
    a, b = load_checkpoint(conv, onnx_tol=tol), load_checkpoint(attn)
    load_s = time.perf_counter() - t
    for ck, kind, which in ((a, "conv", "first"), (b, "attn", "second")):
        if ck.kind != kind:
            msg = f"is {article(ck.kind)} checkpoint; the {which} argument must be {article(kind)} checkpoint"
            raise CmhsaError(msg, ck.path)
    shared_a, shared_b = a.config.to_dict(), b.config.without_attention().to_dict()
    differ = [k for k in shared_a if shared_a[k] != shared_b[k]]
    if differ:
        detail = ", ".join(f"{k} {shared_a[k]} vs {shared_b[k]}" for k in differ[:3])
        raise CmhsaError(f"config does not match the conv checkpoint's: {detail}", attn)
    need = (b.config.activation_bytes(batch) + a.config.activation_bytes(batch)) * verify_dtype.itemsize // 4
    check_fits(need, f"verifying at batch {batch}", attn)
    t = time.perf_counter()
    result = verify_models(
        a.model(), b.model(), batch=batch, seed=seed, dtype=verify_dtype, device=verify_device, tol=tol
    )
    out = VerifyReport(a, b, result, {"load_s": load_s, "verify_s": time.perf_counter() - t})
    if report is not None:
        write_report(report, out.to_dict())
    return out


@dataclass
class ExportReport:
    checkpoint: Checkpoint
    exported: Any  # onnx.export.Exported
    output: Path
    report_path: Path
    output_facts: dict[str, Any] | None
    timings: dict[str, float]

    @property
    def passed(self) -> bool:
        return self.exported.check.passed

    def to_dict(self) -> dict[str, Any]:
        import onnx
        import onnxruntime

        ex, ckpt = self.exported, self.checkpoint
        return {
            "command": "export",
            "passed": self.passed,
            "input": {
                **file_facts(ckpt.path),
                "kind": ckpt.kind,
                "dtype": str(ckpt.dtype).removeprefix("torch."),
            },
            "output": self.output_facts,
            "config": ckpt.config.to_dict(),
            "export": {
                "exporter": ex.exporter,
                "form": ex.form,
                "opsets": ex.opsets,
                "ir_version": ex.ir_version,
                "dtype": "float32",
                "onnx": onnx.__version__,
                "onnxruntime": onnxruntime.__version__,
            },
            "check": ex.check.to_dict(),
            "timings": self.timings,
            "environment": environment(),
        }


def export_file(
    checkpoint: Path, output: Path, *, opset: int | None = None, tol: float = 1e-4, exporter: str = "dynamo",
    device: str = "cpu", seed: int = 0, report: Path | None = None, form: str = "fused",
) -> ExportReport:  # fmt: skip
    """``cmhsa export`` (and ``cmhsa train --export-onnx``): export, check in onnxruntime, write the
    file only if the check passes; the JSON report either way."""
    from .onnx.export import check_options, export_and_check
    from .onnx.load import providers_for

    if device not in ("cpu", "cuda", "auto"):
        raise CmhsaError(f"`device` must be cpu, cuda or auto, got {device!r}")
    report_path = report or output.with_name(output.name + ".report.json")
    check_outputs(checkpoint, output, report_path, ".onnx", "ONNX (convert writes safetensors checkpoints)")
    check_tol(tol)
    check_options(exporter, opset, form)
    providers = providers_for(device)
    t = time.perf_counter()
    ckpt = load_checkpoint(checkpoint)
    load_s = time.perf_counter() - t
    ex = export_and_check(
        ckpt.model(), exporter=exporter, opset=opset, tol=tol, providers=providers, seed=seed, path=output,
        form=form,
    )  # fmt: skip
    facts = None
    with atomic_paths(*([output] if ex.check.passed else []), report_path) as tmps:  # both or neither
        if ex.check.passed:
            tmps[0].write_bytes(ex.data)
            facts = {
                "path": str(output),
                "bytes": len(ex.data),
                "sha256": hashlib.sha256(ex.data).hexdigest(),
            }
        out = ExportReport(ckpt, ex, output, report_path, facts, {"load_s": load_s, **ex.timings})
        tmps[-1].write_text(report_text(out.to_dict()), encoding="utf-8")
    return out


@dataclass
class Inspection:
    checkpoint: Checkpoint
    facts: dict[str, Any]  # path, bytes, sha256
    heads: HeadCount
    pinned: list[list[tuple[int, int] | None]] | None  # attn: per block, per head, read from the bias
    gates: list[list[float]] | None = None  # gated attn: per block, per head, clamped to [0, 1]


def inspect_file(
    path: Path, *, img_size: tuple[int, int] | None = None, patch_size: int | None = None
) -> Inspection:
    """Kind, config, size and hash of a model file; for attention, each head's pinned offset."""
    ckpt = load_checkpoint(path, img_size=img_size, patch_size=patch_size)
    cfg = ckpt.config
    pinned = None
    if ckpt.kind == "attn":
        pinned = [
            pinned_offsets(
                ckpt.tensors[f"blocks.{i}.attn.rel_pos_bias"], ckpt.tensors.get(f"blocks.{i}.attn.sink")
            )
            for i in range(cfg.depth)
        ]
    hc = head_count(cfg.kernel_size, cfg.patch_size, cfg.dilation, channels=cfg.hidden_chans)
    gates = None
    if cfg.pinning == "gated":
        gates = [ckpt.tensors[f"blocks.{i}.attn.gate"].clamp(0, 1).tolist() for i in range(cfg.depth)]
    return Inspection(ckpt, file_facts(path), hc, pinned, gates)


def as_float32(ckpt: Checkpoint) -> Checkpoint:
    return dataclasses.replace(ckpt, tensors={k: v.float() for k, v in ckpt.tensors.items()})
