"""A conv-phase ViT written without cmhsa, as someone else would: other parameter names, tokens
as channel-first patches (feature c·P² + py·P + px, not cmhsa's (py·P + px)·C + c), explicit
integer padding, or an F.pad before the conv for even kernels, and optionally the MLP on a
(B·N, d) matrix so that exporters write Gemm. The ONNX import tests read its exports."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class TheirConvViT(nn.Module):
    def __init__(
        self,
        img: tuple[int, int] = (16, 24),
        p: int = 4,
        chans: int = 3,
        hidden: int | None = None,
        depth: int = 2,
        k: int = 3,
        dil: int = 1,
        mlp: int = 40,
        classes: int = 5,
        eps: float = 1e-6,
        conv_bias: bool = True,
        flat_mlp: bool = False,
        act: str = "gelu",
        seed: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        hidden = hidden or chans
        self.p, self.img, self.chans, self.hidden, self.flat_mlp, self.act = (
            p,
            img,
            chans,
            hidden,
            flat_mlp,
            act,
        )
        d = p * p * hidden
        self.stem = nn.Linear(p * p * chans, d) if hidden != chans else None
        total = dil * (k - 1)
        self.pad = (total // 2, total - total // 2)
        same = self.pad[0] == self.pad[1]
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "pre_mix": nn.LayerNorm(d, eps=eps),
                    "spatial": nn.Conv2d(
                        hidden, hidden, k, dilation=dil, bias=conv_bias, padding=self.pad[0] if same else 0
                    ),
                    "pre_ffn": nn.LayerNorm(d, eps=eps),
                    "ffn_in": nn.Linear(d, mlp),
                    "ffn_out": nn.Linear(mlp, d),
                }
            )
            for _ in range(depth)
        )
        self.final_ln = nn.LayerNorm(d, eps=eps)
        self.classifier = nn.Linear(d, classes)
        with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
            for name, prm in self.named_parameters():
                if name.endswith("bias"):
                    prm.normal_(0, 0.1)
                elif "ln" in name or "pre_" in name:
                    prm.normal_(1, 0.2)
        self.eval()

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.p
        x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def pixels(self, t: torch.Tensor) -> torch.Tensor:
        p, (h, w), c = self.p, self.img, self.hidden
        t = t.reshape(t.shape[0], h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return t.reshape(-1, c, h, w)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return {"gelu": F.gelu, "relu": F.relu, "tanh": lambda v: F.gelu(v, approximate="tanh")}[self.act](x)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.tokens(image)
        if self.stem is not None:
            x = self.stem(x)
        for layer in self.layers:
            y = self.pixels(layer["pre_mix"](x))
            if self.pad[0] != self.pad[1]:
                y = F.pad(y, (self.pad[0], self.pad[1], self.pad[0], self.pad[1]))
            x = x + self.tokens(layer["spatial"](y))
            z = layer["pre_ffn"](x)
            if self.flat_mlp:
                b, n, d = x.shape
                z = z.reshape(b * n, d)
            z = layer["ffn_out"](self.activation(layer["ffn_in"](z)))
            x = x + z.reshape(x.shape)
        return self.classifier(self.final_ln(x).mean(1))


def export(
    model: nn.Module, path: Path, exporter: str, opset: int | None = None, dynamic: bool = True
) -> Path:
    """Their export: input 'image', output 'scores', dynamic batch (or a fixed batch of 2)."""
    x = torch.randn(2, model.chans, *model.img)
    kw = {
        "dynamo": exporter == "dynamo",
        "input_names": ["image"],
        "output_names": ["scores"],
        "opset_version": opset,
    }
    if dynamic and exporter == "dynamo":
        kw["dynamic_shapes"] = {"image": {0: torch.export.Dim("batch")}}
    elif dynamic:
        kw["dynamic_axes"] = {"image": {0: "batch"}, "scores": {0: "batch"}}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), **kw)
    return path
