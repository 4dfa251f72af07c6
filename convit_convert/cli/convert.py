"""``cmhsa convert``, ``verify``, ``inspect`` and ``heads``: thin commands over :mod:`convit_convert.api`
(torch loads when a command runs; ``heads`` never imports it)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from ..errors import CmhsaError
from ..io.model_card import SHOWN_CLASSES
from ..options.conversion import ConversionSpec
from ..options.operations import CalibrationSource, Geometry, HeadsQuery, Verification, VerifyOptions
from .common import (
    EXIT_FAIL,
    console,
    parse_img_size,
    path_arg,
    path_opt,
    print_import,
    print_titled,
    print_verification,
    print_written,
    safe,
)
from .options import (
    BareImgSize,
    BarePatchSize,
    Heads,
    Margin,
    Pinning,
    QkDim,
    QkInitStd,
    Sink,
    Tol,
    VerifyBatch,
    VerifyDtype,
    alias_option,
    calibration_options,
    device_option,
    output_option,
    use_alias,
)

if TYPE_CHECKING:
    from ..approximate import Approximation

app = typer.Typer()
# the flags' defaults: the library's objects', each stated there once (tests/test_options.py)
SPEC, GEOMETRY, VERIFICATION, CALIBRATION = ConversionSpec(), Geometry(), Verification(), CalibrationSource()
HEADS, VERIFY = HeadsQuery(), VerifyOptions()
APPROXIMATE_CALIB, SWEEP_CALIB = calibration_options("--approximate"), calibration_options("--checkpoint")


@app.command()
def convert(
    input: Annotated[
        Path,
        path_arg(
            "Conv-phase model: cmhsa .safetensors, an ONNX file (.onnx, read by its "
            "graph), or a bare state dict (.safetensors/.pt/.pth) with --img-size "
            "and --patch-size."
        ),
    ],
    output: Annotated[Path, output_option("Attention checkpoint to write (.safetensors).")],
    heads: Heads = SPEC.heads,
    qk_dim: QkDim = SPEC.qk_dim,
    pinning: Pinning = SPEC.pinning,
    sink: Sink = SPEC.sink,
    qk_init_std: QkInitStd = SPEC.qk_init_std,
    margin: Margin = SPEC.margin,
    tol: Tol = SPEC.tol,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Check the result numerically before writing it.")
    ] = True,
    report: Annotated[Path | None, path_opt("Report path (default: OUTPUT's stem + .report.json).")] = None,
    img_size: BareImgSize = None,
    patch_size: BarePatchSize = None,
    dilation: Annotated[
        int, typer.Option(help="Bare state dicts only: the convolutions' dilation.")
    ] = GEOMETRY.dilation,
    norm_eps: Annotated[
        float, typer.Option(help="Bare state dicts only: LayerNorm eps.")
    ] = GEOMETRY.norm_eps,
    dtype: VerifyDtype = VERIFICATION.dtype,
    batch: VerifyBatch = VERIFICATION.batch,
    seed: Annotated[
        int, typer.Option(help="Seed for the verification images and any random W_Q, W_K.")
    ] = SPEC.seed,
    device: Annotated[str, device_option()] = VERIFICATION.device,
    approximate: Annotated[
        bool,
        typer.Option(
            "--approximate",
            help="With --heads below what the kernel needs: keep the offsets that matter "
            "most on calibration images and refit their W_O (the paper's open "
            "problem; measured, not exact: verification still judges against --tol).",
        ),
    ] = SPEC.approximate,
    rule: Annotated[
        str,
        typer.Option(
            help="--approximate: greedy (drop the offset whose loss hurts least, "
            "measured, one at a time) or corner (drop the farthest offsets first, "
            "whatever the data)."
        ),
    ] = SPEC.rule,
    refit: Annotated[
        bool,
        typer.Option(
            "--refit/--no-refit",
            help="--approximate: refit the kept heads' W_O by least squares (--no-refit: plain dropping).",
        ),
    ] = SPEC.refit,
    calib: Annotated[str | None, APPROXIMATE_CALIB["calib"]] = CALIBRATION.calib,
    data_dir: Annotated[str | None, APPROXIMATE_CALIB["data_dir"]] = CALIBRATION.data_dir,
    calib_images: Annotated[int, APPROXIMATE_CALIB["calib_images"]] = CALIBRATION.calib_images,
    heldout_images: Annotated[int, APPROXIMATE_CALIB["heldout_images"]] = CALIBRATION.heldout_images,
) -> None:
    """Convert a conv-phase ViT into the attention ViT that computes the same function (Theorem 1)."""
    from ..api import convert_file

    if not approximate and (calib is not None or data_dir is not None):
        raise CmhsaError(
            "--calib and --data-dir calibrate an approximate conversion: add --approximate and --heads N"
        )

    spec = ConversionSpec(
        heads=heads,
        qk_dim=qk_dim,
        sink=sink,
        pinning=pinning,
        qk_init_std=qk_init_std,
        margin=margin,
        seed=seed,
        tol=tol,
        approximate=approximate,
        rule=rule,
        refit=refit,
    )
    with console.status(f"Converting {safe(str(input))} and verifying on {batch} random images..."):
        r = convert_file(
            input,
            output,
            spec,
            report=report,
            geometry=Geometry(parse_img_size(img_size), patch_size, dilation, norm_eps),
            verify=verify,
            verification=Verification(dtype, batch, device),
            calibration=CalibrationSource(calib, data_dir, calib_images, heldout_images, seed),
        )
    print_conversion(r, input, approximate)
    if not r.passed:
        raise typer.Exit(EXIT_FAIL)


def print_conversion(r: Any, input: Path, approximate: bool) -> None:
    """A ConvertReport: what was read and made, the approximation's choices, the verification, what
    was written, and what to do when an approximate conversion fails its --tol."""
    c = r.conversion
    cfg, pinned = c.config, c.summary()["pinned_heads"]
    print_import(c.source)
    console.print(
        f"Converted {safe(str(input))}: depth {cfg.depth}, {cfg.kernel_size}x{cfg.kernel_size} conv "
        f"(dilation {cfg.dilation}) on {cfg.patch_size}px patches -> {cfg.num_heads} heads "
        f"({pinned} pinned), qk_dim {cfg.qk_dim}, v_dim {cfg.v_dim}, sink "
        f"{'on' if cfg.sink else 'off'}, pinning {cfg.pinning}"
    )
    if approximate and c.approximation is None:
        console.print(
            f"--approximate: {cfg.num_heads} heads are enough for this kernel, so the conversion is exact"
        )
    if c.approximation is not None:
        print_approximation(c.approximation)
    if c.verification is not None:
        print_verification(c.verification, "Verification: attention vs convolution")
    print_written(
        r.passed, r.output, r.report_path, "verification", bool((r.output_facts or {}).get("replaced"))
    )
    if not r.passed and c.approximation is not None and c.verification is not None:
        console.print(
            "An approximate conversion is not exact: to write it, pass --tol "
            f"{rounded_up(c.verification.worst.rel)} "
            "or more (the held-out errors above say what the approximation costs)."
        )


def print_approximation(a: Approximation) -> None:
    """Per block: what was kept and dropped (with the error after each drop), and what it measured."""
    off = lambda o: f"{o[0]:+d}{o[1]:+d}"  # noqa: E731
    h = a.heldout
    console.print(
        f"Approximate: {len(a.blocks[0].kept)} heads per block, rule {a.rule}, "
        f"{'W_O refit' if a.refit else 'taps kept (no refit)'}; calibration: {safe(a.calibration)}"
    )
    table = Table(
        caption="offsets as dy dx; errors relative; held-out: the mixer on the conv model's activations; "
        "taps: the refit lost to plain dropping on held-back calibration images, so not kept"
    )
    for col in ("block", "kept", "dropped: calib. error after each", "drop", "refit", "held-out"):
        table.add_column(col)
    for i, b in enumerate(a.blocks):
        dropped = " ".join(f"{off(o)}:{e:.3f}" for o, e in zip(b.dropped, b.steps, strict=True))
        refit = f"{b.refit_error:.4f}" if b.refit_kept else ("taps" if a.refit else "")
        table.add_row(
            str(i),
            " ".join(off(o) for o in b.kept),
            dropped,
            f"{b.drop_error:.4f}",
            refit,
            "" if h is None else f"{h.mixer_errors[i]:.4f}",
        )
    console.print(table)
    if h is not None:
        acc = (
            ""
            if h.conv_top1 is None
            else (
                f"; top-1 {h.attn_top1:.2f}% against the conv model's {h.conv_top1:.2f}% "
                f"(drop {h.accuracy_drop:.2f} points)"
            )
        )
        console.print(f"Held out ({h.images} images): logits relative error {h.logits_error:.4f}{acc}")


@app.command("verify")
def verify_cmd(
    conv: Annotated[Path, path_arg("Conv-phase checkpoint (.safetensors or .onnx).")],
    attn: Annotated[Path, path_arg("Attention checkpoint.")],
    tol: Annotated[float, typer.Option(help="Largest relative error accepted.")] = VERIFY.tol,
    dtype: VerifyDtype = VERIFICATION.dtype,
    batch: VerifyBatch = VERIFICATION.batch,
    seed: Annotated[
        int, typer.Option(help="Seed for the random images (convert checks on seed 0's: these are others).")
    ] = VERIFY.seed,
    report: Annotated[Path | None, path_opt("Write a JSON report here.")] = None,
    device: Annotated[str, device_option()] = VERIFICATION.device,
) -> None:
    """Check numerically that ATTN computes what CONV computes. Exit 0 pass, 1 outside tol, 2 bad input."""
    from ..api import verify_files

    with console.status(f"Verifying on {batch} random images ({dtype})..."):
        r = verify_files(
            conv,
            attn,
            options=VerifyOptions(tol, seed),
            verification=Verification(dtype, batch, device),
            report=report,
        )
    print_import(r.conv)
    print_verification(r.result, f"{safe(str(attn))} vs {safe(str(conv))}")
    raise typer.Exit(0 if r.passed else EXIT_FAIL)


@app.command()
def inspect(
    ckpt: Annotated[
        Path,
        path_arg(
            "A checkpoint: cmhsa .safetensors, a timm folder, an ONNX file (read by its graph), "
            "or a bare state dict (.safetensors/.pt/.pth) with --img-size and "
            "--patch-size."
        ),
    ],
    img_size: BareImgSize = None,
    patch_size: BarePatchSize = GEOMETRY.patch_size,
) -> None:
    """Kind, config, size and hash of a checkpoint; for attention, each head's pinned offset."""
    from ..api import inspect_file

    r = inspect_file(ckpt, Geometry(parse_img_size(img_size), patch_size))
    c, cfg = r.checkpoint, r.checkpoint.config
    info = Table(show_header=False)
    info.add_column(style="bold")
    info.add_column()
    info.add_row(
        "kind", f"{c.kind} ({'phase 1: convolutional ViT' if c.kind == 'conv' else 'phase 2: attention ViT'})"
    )
    info.add_row("read as", safe(c.source))
    for key, value in cfg.to_dict().items():
        info.add_row(key, safe(str(value)))
    info.add_row("parameters", f"{c.num_params:,}")
    info.add_row("dtype", str(c.dtype).removeprefix("torch."))
    info.add_row("file size", f"{r.facts['bytes']:,} bytes")
    info.add_row("heads needed", f"{r.heads.patch_heads} ({safe(r.heads.patch_reason)})")
    if "cmhsa.trained" in c.metadata:  # written by `cmhsa train`: how the weights were made
        info.add_row("trained", safe(c.metadata["cmhsa.trained"]))
    if "cmhsa.init" in c.metadata:
        info.add_row("init", safe(init_text(c.metadata["cmhsa.init"])))
    if c.classes is not None:  # output i is class i; anyone's names: escaped, the first few shown
        shown = ", ".join(safe(n[:60]) for n in c.classes[:SHOWN_CLASSES])
        more = len(c.classes) - SHOWN_CLASSES
        info.add_row("classes", shown + (f", ... ({more:,} more)" if more > 0 else ""))
    print_titled(safe(str(ckpt)), info)
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
    if r.gates is not None:
        console.print(
            "[dim]g: the head's gate (--pinning gated), the share of its attention that content "
            "(q·k) takes from its pinned offset: 0 is exactly the pinned patch, 1 content alone[/]"
        )


INIT_WORDS = {"init_kind": "kind", "init_sha256": "sha256", "init_num_classes": "its classes"}


def init_text(raw: str) -> str:
    """``cmhsa.init`` (a JSON object `cmhsa train` writes: how the weights started) as words for a
    table cell: the start (a file by its name, never its folder), then its kind, hash and what was
    replaced; text that is not such an object is shown as it is (escaped by the caller)."""
    from ..io.paths import parse_json

    try:
        doc = parse_json(raw, None, "metadata cmhsa.init")
    except CmhsaError:
        return raw
    if not isinstance(doc, dict):
        return raw
    parts = []
    for key, value in doc.items():
        if value is None or value == [] or value is False:
            continue
        if key == "init":
            parts.insert(0, str(value).replace("\\", "/").rsplit("/", 1)[-1])
        elif key == "init_sha256" and isinstance(value, str):
            parts.append(f"sha256 {value[:16]}…")
        elif key == "replaced" and isinstance(value, list):
            parts.append(f"made anew: {', '.join(map(str, value))}")
        else:
            parts.append(f"{INIT_WORDS.get(key, key)} {value}")
    return "; ".join(parts) or raw


@app.command()
def heads(
    kernel_size: Annotated[
        int | None, typer.Option("--kernel-size", "-k", help="Kernel size K (or --checkpoint).")
    ] = HEADS.kernel_size,
    patch_size: Annotated[
        int | None, typer.Option("--patch-size", "-p", help="Patch size P (or --checkpoint).")
    ] = HEADS.patch_size,
    dilation: Annotated[int, typer.Option("--dilation", "-d", help="Dilation D.")] = HEADS.dilation,
    channels: Annotated[
        int | None, typer.Option(help="Channels C (Theorem 5's pixel-input bound is min(K², C)).")
    ] = HEADS.channels,
    checkpoint: Annotated[
        Path | None,
        path_opt(
            "A conv-phase checkpoint: also measure, for every N from 1 to the bound, "
            "the error of an approximate conversion with N heads (as convert "
            "--approximate)."
        ),
    ] = None,
    rule: Annotated[
        str, typer.Option(help="--checkpoint: greedy or corner (see convert --rule).")
    ] = SPEC.rule,
    calib: Annotated[str | None, SWEEP_CALIB["calib"]] = CALIBRATION.calib,
    data_dir: Annotated[str | None, SWEEP_CALIB["data_dir"]] = CALIBRATION.data_dir,
    calib_images: Annotated[int, SWEEP_CALIB["calib_images"]] = CALIBRATION.calib_images,
    heldout_images: Annotated[int, SWEEP_CALIB["heldout_images"]] = CALIBRATION.heldout_images,
    seed: Annotated[
        int, typer.Option(help="--checkpoint: seed of the calibration images.")
    ] = CALIBRATION.seed,
    kernel: Annotated[int | None, alias_option("--kernel", "--kernel-size")] = None,
    patch: Annotated[int | None, alias_option("--patch", "--patch-size")] = None,
) -> None:
    """How many heads an MHSA layer needs to express a KxK convolution, and why.

    With --checkpoint: what fewer heads cost that checkpoint, measured."""
    from ..theory import head_count, same_padding

    kernel = use_alias(kernel_size, kernel, "--kernel", "--kernel-size")
    patch = use_alias(patch_size, patch, "--patch", "--patch-size")
    query, ckpt = HeadsQuery(kernel, patch, dilation, channels), None
    if checkpoint is not None:
        from ..api import checkpoint_head_count, load_checkpoint, make_calibration

        ckpt = load_checkpoint(checkpoint)
        hc = checkpoint_head_count(ckpt, query)
        kernel, patch, dilation = hc.kernel_size, hc.patch_size, hc.dilation
        ConversionSpec(rule=rule)  # refuses a bad --rule before anything is printed
        source = CalibrationSource(calib, data_dir, calib_images, heldout_images, seed)
        calib_set = make_calibration(ckpt.config, source)
    elif kernel is None or patch is None:
        raise CmhsaError("give --kernel-size and --patch-size, or --checkpoint")
    else:
        hc = head_count(kernel, patch, dilation, channels)
    left, right = same_padding(kernel, dilation)
    console.print(
        f"{kernel}x{kernel} kernel, dilation {dilation} (extent {hc.extent} px, "
        f"'same' padding {left} before / "
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
    if len(ys) > 15:  # a grid a terminal can show; the counts above say the rest
        console.print(
            f"Patch offsets: {len(ys)}x{len(ys)}, dy and dx from {ys[0]:+d} to {ys[-1]:+d} (grid not shown)"
        )
    else:
        grid = "\n".join(
            "  " + "  ".join(f"h{ys.index(dy) * len(ys) + ys.index(dx)}:({dy:+d},{dx:+d})" for dx in ys)
            for dy in ys
        )
        console.print(f"Patch offsets (dy, dx), one head each, row-major:\n{grid}")
    if ckpt is not None:
        print_sweep(ckpt, rule, calib_set, seed)


def print_sweep(ckpt: Any, rule: str, calib_set: Any, seed: int) -> None:
    """``heads --checkpoint``: the measured error of N heads, N = 1 … the bound."""
    from ..api import heads_sweep

    with console.status(
        "Converting with 1, 2, ... heads up to the bound, measuring each on "
        f"{len(calib_set.heldout)} held-out images..."
    ):
        rows = [row.to_dict() for row in heads_sweep(ckpt, calib_set, rule=rule, seed=seed).rows]
    title = (
        f"{safe(str(ckpt.path))}: N heads per block (rule {rule}, W_O refit where it generalises); "
        f"calibration: {safe(calib_set.source)}"
    )
    table = Table()
    labelled = rows[0]["conv_top1"] is not None
    cols = ["N", "calib: drop", "calib: refit", "held-out mixer", "held-out logits"] + (
        ["top-1 %"] if labelled else []
    )
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        cells = [
            str(r["heads"]),
            f"{r['calib_drop_error']:.4f}",
            f"{r['calib_refit_error']:.4f}",
            f"{r['heldout_mixer_error']:.4f}",
            f"{r['heldout_logits_error']:.4f}",
        ]
        if labelled:
            cells.append(f"{r['attn_top1']:.2f}")
        table.add_row(*cells)
    print_titled(title, table)
    console.print(
        "[dim]errors are relative (Frobenius), worst block; calib: on the calibration images, with the kept "
        "taps (drop) or refit W_O; held-out: each block's mixer on the conv "
        "model's activations, and the logits"
        + (f"; the conv model's top-1 is {rows[0]['conv_top1']:.2f}%" if labelled else "")
        + "[/]"
    )


def rounded_up(x: float) -> str:
    """``x`` rounded up to two significant digits: a --tol that ``x`` passes."""
    if not x > 0 or not math.isfinite(x):
        return f"{x:g}"
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return f"{math.ceil(x / step) * step:.2g}"
