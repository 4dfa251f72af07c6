"""``cmhsa convert``: a conv checkpoint converted (Theorem 1, or fewer heads approximately) and
verified in memory (:class:`Conversion`), and written with its JSON report (:class:`ConvertReport`).

Bad input raises :class:`CmhsaError` before anything is written; a verification that fails is a
report with ``passed`` False, no model written and its JSON report written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..approximate import (
    Approximation,
    BlockChoice,
    Calibration,
    choose,
    guard_logits,
    held_back,
    heldout_errors,
    noise_calibration,
)
from ..config import ViTConfig
from ..construct import convert_state_dict
from ..errors import CmhsaError, article
from ..io.atomic import atomic_names
from ..io.checkpoint import Checkpoint, write_checkpoint
from ..io.outputs import held_outputs
from ..io.report import default_report_path, environment, file_facts, report_text
from ..labels import to_metadata
from ..model import VisionTransformer
from ..options.conversion import ConversionPlan, ConversionSpec, Offset
from ..options.operations import CalibrationSource, Geometry, Verification
from ..resources import check_fits
from ..verify import VerifyResult, verify_models
from .common import check_suffix, load_checkpoint, read_paths, resolve_device, resolve_dtype


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
    ckpt: Checkpoint,
    spec: ConversionSpec | None = None,
    *,
    verify: bool = True,
    verification: Verification | None = None,
    calibration: CalibrationSource | Calibration | None = None,
) -> Conversion:
    """Convert a conv checkpoint as ``spec`` says (default: the paper's construction) and, unless
    ``verify`` is False, verify it against the conv model as ``verification`` says (default:
    ``Verification()``: 4 random float32 images, on CUDA when there is one): every relative
    error must be <= ``spec.tol``.

    An approximate spec (``approximate`` with ``heads`` below what the kernel needs) keeps the
    ``heads`` offsets chosen by ``spec.rule`` and refits their W^O on ``calibration``'s images
    (images already made, or where to make them: :func:`make_calibration`; default: noise images,
    made only then), then measures the result on its held-out images
    (:mod:`convit_convert.approximate`); with enough heads it is the exact conversion. Verification
    still judges against ``spec.tol``."""
    spec = spec or ConversionSpec()
    if ckpt.kind != "conv":
        raise CmhsaError(
            f"is {article(ckpt.kind)} checkpoint already; convert takes a conv-phase one", ckpt.path
        )
    v = verification or Verification()
    batch, dtype, device = v.batch, resolve_dtype(v.dtype), resolve_device(v.device) if verify else "cpu"
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
        calibration = make_calibration(src, calibration or CalibrationSource(seed=spec.seed))
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
        ckpt.tensors,
        plan,
        path=ckpt.path,
        overrides=None if approx is None else overrides(ckpt, approx.blocks),
    )
    conv = Conversion(ckpt, plan, tensors, approximation=approx)
    conv.timings["convert_s"] = time.perf_counter() - t
    if approx is not None:
        t = time.perf_counter()
        approx.heldout = heldout_errors(conv_model, conv.model(), calibration.heldout, calibration.labels)  # type: ignore[arg-type]
        conv.timings["heldout_s"] = time.perf_counter() - t
    if verify:
        t = time.perf_counter()
        conv.verification = verify_models(
            conv_model or ckpt.model(),
            conv.model(),
            batch=batch,
            seed=spec.seed,
            dtype=dtype,
            device=device,
            tol=spec.tol,
        )
        conv.timings["verify_s"] = time.perf_counter() - t
    return conv


def approximation(
    ckpt: Checkpoint,
    plan: ConversionPlan,
    conv: VisionTransformer,
    blocks: list[BlockChoice],
    calibration: Calibration,
) -> Approximation:
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
    input: Path,
    output: Path,
    spec: ConversionSpec | None = None,
    *,
    report: Path | None = None,
    geometry: Geometry | None = None,
    verify: bool = True,
    verification: Verification | None = None,
    calibration: CalibrationSource | Calibration | None = None,
) -> ConvertReport:
    """``cmhsa convert``: load (a bare state dict as ``geometry`` says), convert as ``spec`` says and
    verify as ``verification`` says (default: 4 random float32 images on CUDA when there is one;
    :func:`convert_checkpoint`), write the attention checkpoint if verification passed, and the
    JSON report either way."""
    spec = spec or ConversionSpec()
    verification = verification or Verification()
    report_path = report or default_report_path(output)
    check_suffix(output, ".safetensors", "a safetensors checkpoint (export writes ONNX)")
    reads = [*read_paths(input), *([calibration.data_dir] if _reads_data(calibration) else [])]
    with held_outputs(output, report_path, reads=reads) as (out, rep):
        if verify:
            resolve_device(verification.device)  # a GPU that is not there, before the slow part
        t = time.perf_counter()
        ckpt = load_checkpoint(input, geometry, onnx_tol=spec.tol)
        timings = {"load_s": time.perf_counter() - t}
        input_facts = file_facts(input)
        conv = convert_checkpoint(
            ckpt, spec, verify=verify, verification=verification, calibration=calibration
        )
        timings.update(conv.timings)
        output_facts = None
        replaced = out.exists()  # said in the report and by the CLI: a file is never replaced silently
        # the model and its report together or neither: a failed write keeps both previous files
        with atomic_names(*([out] if conv.passed else []), rep) as tmps:
            if conv.passed:
                t = time.perf_counter()
                meta = {"cmhsa.source_sha256": input_facts["sha256"], **to_metadata(ckpt.classes)}
                if isinstance(ckpt.metadata.get("cmhsa.trained"), str):  # its data: the card's licence
                    meta["cmhsa.trained"] = ckpt.metadata["cmhsa.trained"]
                digest = write_checkpoint(tmps[0], conv.config, conv.tensors, meta, output)
                timings["write_s"] = time.perf_counter() - t
                output_facts = {
                    "path": str(output),
                    "bytes": tmps[0].stat().st_size,
                    "sha256": digest,
                    "replaced": replaced,
                }
            result = ConvertReport(conv, output, report_path, input_facts, output_facts, timings)
            tmps[-1].write_text(report_text(result.to_dict()), encoding="utf-8")
    return result


def _reads_data(calibration: CalibrationSource | Calibration | None) -> bool:
    """Whether the conversion reads a data folder (an approximate conversion's ``calib`` images)."""
    return (
        isinstance(calibration, CalibrationSource)
        and calibration.calib is not None
        and bool(calibration.data_dir)
    )


def make_calibration(cfg: ViTConfig, source: CalibrationSource | Calibration) -> Calibration:
    """Calibration images for a model of ``cfg``: ``source`` itself if already made, N(0, 1) noise
    images, or ``source.calib``'s images (torchvision loads only then)."""
    if isinstance(source, Calibration):
        return source
    if source.calib is None:
        return noise_calibration(cfg, source.calib_images, source.heldout_images, source.seed)
    from .on_data import calibration_from_data

    return calibration_from_data(cfg, source)
