"""How ``cmhsa export`` writes and checks an ONNX file (:class:`ExportOptions`): no torch, so the
command line reads its defaults from here at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import Checked


@dataclass(frozen=True)
class ExportOptions(Checked):
    """How ``cmhsa export`` writes and checks: validated when made (numbers against BOUNDS), each
    default stated once."""

    opset: int | None = None  # ai.onnx opset; None: the exporter's
    tol: float = 1e-4  # largest relative error of onnxruntime against PyTorch
    exporter: str = "dynamo"  # or "legacy" (TorchScript)
    form: str = "fused"  # attention models: "fused" (W_V·W_O folded) or "trained"
    device: str = "auto"  # onnxruntime provider of the check: auto, cpu, cuda or cuda:N
    seed: int = 0  # of the check images

    def __post_init__(self) -> None:
        from .export import check_options  # torch: only when options are made

        super().__post_init__()
        check_options(self.exporter, self.opset, self.form)
