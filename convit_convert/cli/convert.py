"""``cmhsa convert``, ``verify``, ``inspect`` and ``heads``: thin commands over :mod:`convit_convert.api`
(torch loads when a command runs; ``heads`` never imports it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import CmhsaError
from .common import (
    EXIT_FAIL,
    console,
    handles_errors,
    parse_img_size,
    path_arg,
    path_opt,
    print_import,
    print_verification,
    print_written,
)

app = typer.Typer()


# fmt: off
@app.command()
@handles_errors
def convert(
    input: Annotated[Path, path_arg("Conv-phase model: cmhsa .safetensors, an ONNX file (.onnx, read by its graph), or a bare state dict (.safetensors/.pt/.pth) with --img-size and --patch-size.")],
    output: Annotated[Path, path_opt("Attention checkpoint to write (.safetensors).", "--output", "-o")],
    heads: Annotated[int | None, typer.Option(help="Attention heads (default: as many as the kernel needs); extra heads are free, trainable heads with zero output weights.")] = None,
    qk_dim: Annotated[int | None, typer.Option(help="Per-head query/key width (default: embed_dim, the paper's). Exactness does not depend on it.")] = None,
    pinning: Annotated[str, typer.Option(help="hard: the exact construction, attention fixed; gated: each head also gets content attention behind a gate that starts at 0 (still exact).")] = "hard",
    sink: Annotated[bool, typer.Option("--sink/--no-sink", help="Give each head a sink so border patches are exact. --no-sink: the paper's construction (inexact at the border).")] = True,
    qk_init_std: Annotated[float, typer.Option(help="Std of a small random W_Q, W_K (0 = the paper's zeros); moves phase 2 off the W_Q = W_K = 0 saddle and stays exact.")] = 0.0,
    tol: Annotated[float, typer.Option(help="Largest relative error verification accepts (and, for ONNX input, the import check).")] = 1e-5,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Check the result numerically before writing it.")] = True,
    report: Annotated[Path | None, path_opt("Report path (default: OUTPUT's stem + .report.json).")] = None,
    img_size: Annotated[str | None, typer.Option(help="Bare state dicts only: image size, H or HxW.")] = None,
    patch_size: Annotated[int | None, typer.Option(help="Bare state dicts only: patch size P.")] = None,
    dilation: Annotated[int, typer.Option(help="Bare state dicts only: the convolutions' dilation.")] = 1,
    norm_eps: Annotated[float, typer.Option(help="Bare state dicts only: LayerNorm eps.")] = 1e-6,
    dtype: Annotated[str, typer.Option(help="Verification dtype: float32 or float64.")] = "float32",
    batch: Annotated[int, typer.Option(help="Verification batch size.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed for the verification images and any random W_Q, W_K.")] = 0,
    device: Annotated[str, typer.Option(help="Verification device: auto, cpu, cuda, cuda:N.")] = "auto",
) -> None:  # fmt: skip
# fmt: on
    """Convert a conv-phase ViT into the attention ViT that computes the same function (Theorem 1)."""
    from ..api import convert_file

    with console.status(f"Converting {escape(str(input))} and verifying on {batch} random images..."):
        r = convert_file(
            input, output, report=report, img_size=parse_img_size(img_size), patch_size=patch_size,
            dilation=dilation, norm_eps=norm_eps, dtype=dtype, device=device, heads=heads, qk_dim=qk_dim, pinning=pinning,
            sink=sink, qk_init_std=qk_init_std, tol=tol, verify=verify, batch=batch, seed=seed,
        )  # fmt: skip
    c = r.conversion
    cfg, pinned = c.config, c.summary()["pinned_heads"]
    print_import(c.source)
    console.print(
        f"Converted {escape(str(input))}: depth {cfg.depth}, {cfg.kernel_size}x{cfg.kernel_size} conv "
        f"(dilation {cfg.dilation}) on {cfg.patch_size}px patches -> {cfg.num_heads} heads "
        f"({pinned} pinned), qk_dim {cfg.qk_dim}, v_dim {cfg.v_dim}, sink {'on' if cfg.sink else 'off'}, pinning {cfg.pinning}"
    )
    if c.verification is not None:
        print_verification(c.verification, "Verification: attention vs convolution")
    print_written(r.passed, output, r.report_path, "verification")
    if not r.passed:
        raise typer.Exit(EXIT_FAIL)


# fmt: off
@app.command("verify")
@handles_errors
def verify_cmd(
    conv: Annotated[Path, path_arg("Conv-phase checkpoint (.safetensors or .onnx).")],
    attn: Annotated[Path, path_arg("Attention checkpoint.")],
    tol: Annotated[float, typer.Option(help="Largest relative error accepted.")] = 1e-5,
    dtype: Annotated[str, typer.Option(help="float32 or float64.")] = "float32",
    batch: Annotated[int, typer.Option(help="Random images per check.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed for the random images.")] = 0,
    report: Annotated[Path | None, path_opt("Write a JSON report here.")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N.")] = "auto",
) -> None:  # fmt: skip
# fmt: on
    """Check numerically that ATTN computes what CONV computes. Exit 0 pass, 1 outside tol, 2 bad input."""
    from ..api import verify_files

    with console.status(f"Verifying on {batch} random images ({dtype})..."):
        r = verify_files(
            conv, attn, tol=tol, dtype=dtype, batch=batch, seed=seed, device=device, report=report
        )
    print_import(r.conv)
    print_verification(r.result, f"{escape(str(attn))} vs {escape(str(conv))}")
    raise typer.Exit(0 if r.passed else EXIT_FAIL)


# fmt: off
@app.command()
@handles_errors
def inspect(
    ckpt: Annotated[Path, path_arg("A cmhsa checkpoint.")],
    img_size: Annotated[str | None, typer.Option(help="Bare state dicts only: image size, H or HxW.")] = None,
    patch_size: Annotated[int | None, typer.Option(help="Bare state dicts only: patch size P.")] = None,
) -> None:
# fmt: on
    """Kind, config, size and hash of a checkpoint; for attention, each head's pinned offset."""
    from ..api import inspect_file

    r = inspect_file(ckpt, img_size=parse_img_size(img_size), patch_size=patch_size)
    c, cfg = r.checkpoint, r.checkpoint.config
    info = Table(title=escape(str(ckpt)), title_justify="left", show_header=False)
    info.add_column(style="bold")
    info.add_column()
    info.add_row(
        "kind", f"{c.kind} ({'phase 1: convolutional ViT' if c.kind == 'conv' else 'phase 2: attention ViT'})"
    )
    info.add_row("read as", c.source)
    for key, value in cfg.to_dict().items():
        info.add_row(key, escape(str(value)))
    info.add_row("parameters", f"{c.num_params:,}")
    info.add_row("dtype", str(c.dtype).removeprefix("torch."))
    info.add_row("file size", f"{r.facts['bytes']:,} bytes")
    info.add_row("heads needed", f"{r.heads.patch_heads} ({escape(r.heads.patch_reason)})")
    console.print(info)
    console.print(f"sha256 {r.facts['sha256']}", soft_wrap=True)
    if r.pinned is None:
        return
    heads = Table(title="Pinned offset (dy, dx) per head, read back from the bias", title_justify="left")
    heads.add_column("head")
    for i in range(cfg.depth):
        heads.add_column(f"block {i}", justify="center")
    for h in range(cfg.num_heads):
        cells = ["free" if o[h] is None else f"{o[h][0]:+d},{o[h][1]:+d}" for o in r.pinned]
        if r.gates is not None:
            cells = [f"{c} g={g[h]:.2f}" for c, g in zip(cells, r.gates, strict=True)]
        heads.add_row(str(h), *cells)
    console.print(heads)
    console.print(
        "[dim]a query patch at (y, x) reads the key patch at (y+dy, x+dx); free: not pinned to one patch[/]"
    )


# fmt: off
@app.command()
@handles_errors
def heads(
    kernel: Annotated[int, typer.Option("--kernel", "-k", help="Kernel size K.", show_default=False)],
    patch: Annotated[int, typer.Option("--patch", "-p", help="Patch size P.", show_default=False)],
    dilation: Annotated[int, typer.Option("--dilation", "-d", help="Dilation D.")] = 1,
    channels: Annotated[int | None, typer.Option(help="Channels C (Theorem 5's pixel-input bound is min(K², C)).")] = None,
) -> None:
# fmt: on
    """How many heads an MHSA layer needs to express a KxK convolution, and why."""
    from ..theory import head_count, same_padding

    if min(kernel, patch, dilation) < 1 or (channels is not None and channels < 1):
        raise CmhsaError("--kernel, --patch, --dilation and --channels must be positive")
    hc = head_count(kernel, patch, dilation, channels)
    left, right = same_padding(kernel, dilation)
    console.print(
        f"{kernel}x{kernel} kernel, dilation {dilation} (extent {hc.extent} px, 'same' padding {left} before / "
        f"{right} after), {patch}x{patch} patches"
    )
    lb = lambda v: "none proven" if v is None else str(v)  # noqa: E731
    console.print(
        f"patch input (P = {patch}): {hc.patch_heads} heads; lower bound {lb(hc.patch_lower_bound)}"
    )
    console.print(f"  {hc.patch_reason}")
    console.print(f"pixel input (P = 1): {hc.pixel_heads} heads; lower bound {lb(hc.pixel_lower_bound)}")
    console.print(f"  {hc.pixel_reason}")
    ys = sorted({dy for dy, _ in hc.offsets})
    grid = "\n".join(
        "  " + "  ".join(f"h{ys.index(dy) * len(ys) + ys.index(dx)}:({dy:+d},{dx:+d})" for dx in ys)
        for dy in ys
    )
    console.print(f"Patch offsets (dy, dx), one head each, row-major:\n{grid}")
