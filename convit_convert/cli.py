"""The ``cmhsa`` command line.

Start-up matters: this module imports neither torch nor timm. ``cmhsa --help`` and ``cmhsa heads``
never import torch; ``convert``, ``verify`` and ``inspect`` import torch and safetensors only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import CmhsaError, article
from .exits import EXIT_FAIL, handles_errors
from .report import default_report_path

app = typer.Typer(
    name="cmhsa",
    help="Turn trained convolutional ViTs into exactly equivalent self-attention ViTs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False)


def parse_img_size(value: str | None) -> tuple[int, int] | None:
    """'224' -> (224, 224); '224x160' or '224,160' -> (224, 160)."""
    if value is None:
        return None
    parts = value.lower().replace(",", "x").split("x")
    try:
        hw = [int(p) for p in parts]
    except ValueError:
        hw = []
    if len(hw) == 1:
        hw *= 2
    if len(hw) != 2 or min(hw) < 1:
        raise CmhsaError(f"--img-size must be H or HxW (positive integers), got {value!r}")
    return hw[0], hw[1]


def _dtype(name: str) -> Any:
    import torch

    if name not in ("float32", "float64"):
        raise CmhsaError(f"--dtype must be float32 or float64, got {name!r}")
    return getattr(torch, name)


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CmhsaError(f"--device {name}: CUDA is not available")
    return name


def _fmt(x: float) -> str:
    return f"{x:.2e}"


def verify_table(result: Any, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("tensor", "region", "max |Δ|", "max |ref|", "rel. error", "status"):
        table.add_column(col, justify="right" if col not in ("tensor", "region") else "left")
    for e in result.errors:
        status = ("[green]ok[/]" if e.passed else "[red]FAIL[/]") if e.judged else "[dim]info[/]"
        table.add_row(e.tensor, e.region, _fmt(e.max_abs), _fmt(e.ref_max), _fmt(e.rel), status)
    return table


def print_verdict(result: Any) -> None:
    worst = result.worst
    where = f"{worst.tensor} ({worst.region})"
    unjudged = [e for e in result.errors if not e.judged]
    scope = f" (interior only: {len(unjudged)} border/logit rows not judged)" if unjudged else ""
    if result.passed:
        console.print(
            f"[green]PASS[/]{scope}: worst relative error {_fmt(worst.rel)} at {where} <= tol {result.tol:g}"
        )
    else:
        console.print(f"[red]FAIL[/]: relative error {_fmt(worst.rel)} at {where} > tol {result.tol:g}")
    console.print(f"[dim]criterion: {escape(result.criterion)}[/]")


def print_import(ckpt: Any) -> None:
    """For an ONNX input: how the graph was read, and the onnxruntime agreement that proves it."""
    info = ckpt.import_report
    if info is None:
        return
    read = "; ".join(f"{k} {', '.join(v)}" for k, v in info["read"].items())
    check = info["onnxruntime_check"]
    console.print(
        f"Read {escape(str(ckpt.path))} by its graph ({escape(info['producer'] or 'unknown producer')}, "
        f"opset {info['opsets'].get('ai.onnx', '?')}): {escape(read)}"
    )
    console.print(
        f"onnxruntime vs the rebuilt PyTorch model, batch {check['batch']}: relative error "
        f"{_fmt(check['rel'])} <= tol {check['tol']:g} (providers: {', '.join(check['providers'])})"
    )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def check_tol(tol: float) -> None:
    if not tol >= 0:  # also refuses nan
        raise CmhsaError(f"--tol must be >= 0, got {tol}")


def check_suffix(output: Path, suffix: str, what: str) -> None:
    """The output's suffix must say what is written (no .onnx holding safetensors, or back)."""
    if output.suffix.lower() != suffix:
        raise CmhsaError(f"writes {what}: give the output the suffix {suffix}", output)


def check_outputs(source: Path, output: Path, report_path: Path) -> None:
    """Before any work: both outputs writable, neither the input, and not the same file."""
    from .atomic import check_writable

    for p, name in ((output, "output"), (report_path, "report")):
        if _same_file(p, source):
            raise CmhsaError(f"{name} path is the input file; choose another", p)
        check_writable(p)
    if _same_file(output, report_path):
        raise CmhsaError("report path is the output path; choose another", report_path)


@app.command()
@handles_errors
def convert(
    input: Annotated[
        Path,
        typer.Argument(
            readable=False,
            help="Conv-phase model: cmhsa .safetensors, an ONNX file (.onnx, read by its graph), or a bare state dict (.safetensors/.pt/.pth) with --img-size and --patch-size.",
            show_default=False,
        ),
    ],
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="Attention checkpoint to write (.safetensors).",
            show_default=False,
            readable=False,
        ),
    ],
    heads: Annotated[
        int | None,
        typer.Option(
            help="Attention heads (default: as many as the kernel needs; extra heads get zero output weights)."
        ),
    ] = None,
    qk_dim: Annotated[
        int | None,
        typer.Option(
            help="Per-head query/key width (default: embed_dim, the paper's). Exactness does not depend on it."
        ),
    ] = None,
    sink: Annotated[
        bool,
        typer.Option(
            "--sink/--no-sink",
            help="Give each head a sink so border patches are exact. --no-sink: the paper's construction (inexact at the border).",
        ),
    ] = True,
    qk_init_std: Annotated[
        float,
        typer.Option(
            help="Std of a small random W_Q, W_K (0 = the paper's zeros); moves phase 2 off the W_Q = W_K = 0 saddle and stays exact."
        ),
    ] = 0.0,
    tol: Annotated[
        float,
        typer.Option(
            help="Largest relative error verification accepts (and, for ONNX input, the import check)."
        ),
    ] = 1e-5,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Check the result numerically before writing it.")
    ] = True,
    report: Annotated[
        Path | None, typer.Option(readable=False, help="Report path (default: OUTPUT's stem + .report.json).")
    ] = None,
    img_size: Annotated[str | None, typer.Option(help="Bare state dicts only: image size, H or HxW.")] = None,
    patch_size: Annotated[int | None, typer.Option(help="Bare state dicts only: patch size P.")] = None,
    dilation: Annotated[int, typer.Option(help="Bare state dicts only: the convolutions' dilation.")] = 1,
    norm_eps: Annotated[float, typer.Option(help="Bare state dicts only: LayerNorm eps.")] = 1e-6,
    dtype: Annotated[str, typer.Option(help="Verification dtype: float32 or float64.")] = "float32",
    batch: Annotated[int, typer.Option(help="Verification batch size.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed for the verification images and any random W_Q, W_K.")] = 0,
    device: Annotated[str, typer.Option(help="Verification device: auto, cpu, cuda, cuda:N.")] = "auto",
) -> None:
    """Convert a conv-phase ViT into the attention ViT that computes the same function (Theorem 1)."""
    report_path = report or default_report_path(output)
    check_suffix(output, ".safetensors", "a safetensors checkpoint (cmhsa export writes ONNX)")
    check_outputs(input, output, report_path)
    check_tol(tol)
    if batch < 1:
        raise CmhsaError(f"--batch must be positive, got {batch}")
    if not qk_init_std >= 0:
        raise CmhsaError(f"--qk-init-std must be >= 0, got {qk_init_std}")
    verify_dtype = _dtype(dtype)
    verify_device = _device(device) if verify else "cpu"

    from .checkpoint import load_checkpoint, save_checkpoint
    from .convert import convert_state_dict, pinning_logits
    from .report import environment, file_facts, write_report
    from .theory import patch_offsets

    timings: dict[str, float] = {}
    t = time.perf_counter()
    ckpt = load_checkpoint(
        input,
        img_size=parse_img_size(img_size),
        patch_size=patch_size,
        dilation=dilation,
        norm_eps=norm_eps,
        onnx_tol=tol,
    )
    timings["load_s"] = time.perf_counter() - t
    if ckpt.kind != "conv":
        raise CmhsaError("is an attention checkpoint already; convert takes a conv-phase checkpoint", input)
    print_import(ckpt)
    input_facts = file_facts(input)
    t = time.perf_counter()
    tensors, attn_cfg = convert_state_dict(
        ckpt.tensors,
        ckpt.config,
        num_heads=heads,
        qk_dim=qk_dim,
        sink=sink,
        qk_init_std=qk_init_std,
        seed=seed,
        path=input,
    )
    timings["convert_s"] = time.perf_counter() - t
    cfg = ckpt.config
    offsets = patch_offsets(cfg.kernel_size, cfg.patch_size, cfg.dilation)
    m, s = pinning_logits(cfg.num_patches, sink)
    console.print(
        f"Converted {escape(str(input))}: depth {cfg.depth}, {cfg.kernel_size}x{cfg.kernel_size} conv "
        f"(dilation {cfg.dilation}) on {cfg.patch_size}px patches -> {attn_cfg.num_heads} heads "
        f"({len(offsets)} pinned), qk_dim {attn_cfg.qk_dim}, v_dim {attn_cfg.v_dim}, sink {'on' if sink else 'off'}"
    )

    result = None
    if verify:
        from .models import build_model, model_from_checkpoint
        from .verify import verify_models

        attn_model = build_model("attn", attn_cfg)
        attn_model.load_state_dict(tensors)
        with console.status(f"Verifying on {batch} random images ({dtype}, {verify_device})..."):
            t = time.perf_counter()
            result = verify_models(
                model_from_checkpoint(ckpt),
                attn_model,
                batch=batch,
                seed=seed,
                dtype=verify_dtype,
                device=verify_device,
                tol=tol,
            )
            timings["verify_s"] = time.perf_counter() - t
        console.print(verify_table(result, "Verification: attention vs convolution"))
        print_verdict(result)

    output_facts = None
    if result is None or result.passed:
        t = time.perf_counter()
        digest = save_checkpoint(
            output, "attn", attn_cfg, tensors, {"cmhsa.source_sha256": input_facts["sha256"]}
        )
        timings["write_s"] = time.perf_counter() - t
        output_facts = {"path": str(output), "bytes": output.stat().st_size, "sha256": digest}
    doc = {
        "command": "convert",
        "passed": None if result is None else result.passed,
        "input": {
            **input_facts,
            "kind": "conv",
            "read_as": ckpt.source,
            "dtype": str(ckpt.dtype).removeprefix("torch."),
            "onnx_import": ckpt.import_report,
        },
        "output": output_facts,
        "config": attn_cfg.to_dict("attn"),
        "conversion": {
            "heads": attn_cfg.num_heads,
            "offsets": [list(o) for o in offsets],
            "offset_logit": m,
            "sink_logit": s if sink else None,
            "qk_init_std": qk_init_std,
        },
        "verification": None if result is None else result.to_dict(),
        "timings": timings,
        "environment": environment(),
    }
    write_report(report_path, doc)
    if result is not None and not result.passed:
        console.print(
            f"Not written: {escape(str(output))} (verification failed); report: {escape(str(report_path))}"
        )
        raise typer.Exit(EXIT_FAIL)
    console.print(f"Wrote {escape(str(output))} and {escape(str(report_path))}")


@app.command("verify")
@handles_errors
def verify_cmd(
    conv: Annotated[
        Path,
        typer.Argument(
            readable=False, help="Conv-phase checkpoint (.safetensors or .onnx).", show_default=False
        ),
    ],
    attn: Annotated[Path, typer.Argument(readable=False, help="Attention checkpoint.", show_default=False)],
    tol: Annotated[float, typer.Option(help="Largest relative error accepted.")] = 1e-5,
    dtype: Annotated[str, typer.Option(help="float32 or float64.")] = "float32",
    batch: Annotated[int, typer.Option(help="Random images per check.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed for the random images.")] = 0,
    report: Annotated[Path | None, typer.Option(readable=False, help="Write a JSON report here.")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N.")] = "auto",
) -> None:
    """Check numerically that ATTN computes what CONV computes. Exit 0 pass, 1 outside tol, 2 bad input."""
    check_tol(tol)
    if batch < 1:
        raise CmhsaError(f"--batch must be positive, got {batch}")
    verify_dtype, verify_device = _dtype(dtype), _device(device)
    if report is not None:
        for p in (conv, attn):
            if _same_file(report, p):
                raise CmhsaError("report path is an input file; choose another", report)
        from .atomic import check_writable

        check_writable(report)

    from .checkpoint import load_checkpoint
    from .models import model_from_checkpoint
    from .report import environment, file_facts, write_report
    from .verify import verify_models

    t = time.perf_counter()
    a, b = load_checkpoint(conv, onnx_tol=tol), load_checkpoint(attn)
    load_s = time.perf_counter() - t
    print_import(a)
    if a.kind != "conv":
        raise CmhsaError(
            f"is {article(a.kind)} checkpoint; the first argument must be a conv checkpoint", conv
        )
    if b.kind != "attn":
        raise CmhsaError(
            f"is {article(b.kind)} checkpoint; the second argument must be an attn checkpoint", attn
        )
    shared_a, shared_b = a.config.to_dict("conv"), b.config.to_dict("conv")
    differ = [k for k in shared_a if shared_a[k] != shared_b[k]]
    if differ:
        detail = ", ".join(f"{k} {shared_a[k]} vs {shared_b[k]}" for k in differ[:3])
        raise CmhsaError(f"config does not match the conv checkpoint's: {detail}", attn)
    with console.status(f"Verifying on {batch} random images ({dtype}, {verify_device})..."):
        t = time.perf_counter()
        result = verify_models(
            model_from_checkpoint(a),
            model_from_checkpoint(b),
            batch=batch,
            seed=seed,
            dtype=verify_dtype,
            device=verify_device,
            tol=tol,
        )
        verify_s = time.perf_counter() - t
    console.print(verify_table(result, f"{escape(str(attn))} vs {escape(str(conv))}"))
    print_verdict(result)
    if report is not None:
        write_report(
            report,
            {
                "command": "verify",
                "passed": result.passed,
                "conv": file_facts(conv),
                "attn": file_facts(attn),
                "config": b.config.to_dict("attn"),
                "verification": result.to_dict(),
                "timings": {"load_s": load_s, "verify_s": verify_s},
                "environment": environment(),
            },
        )
    raise typer.Exit(0 if result.passed else EXIT_FAIL)


@app.command()
@handles_errors
def inspect(
    ckpt: Annotated[Path, typer.Argument(readable=False, help="A cmhsa checkpoint.", show_default=False)],
    img_size: Annotated[str | None, typer.Option(help="Bare state dicts only: image size, H or HxW.")] = None,
    patch_size: Annotated[int | None, typer.Option(help="Bare state dicts only: patch size P.")] = None,
) -> None:
    """Kind, config, size and hash of a checkpoint; for attention, each head's pinned offset."""
    from .checkpoint import load_checkpoint
    from .convert import pinned_offsets
    from .report import file_facts
    from .theory import head_count

    c = load_checkpoint(ckpt, img_size=parse_img_size(img_size), patch_size=patch_size)
    facts = file_facts(ckpt)
    cfg = c.config
    info = Table(title=escape(str(ckpt)), title_justify="left", show_header=False)
    info.add_column(style="bold")
    info.add_column()
    info.add_row("kind", f"{c.kind} ({'ConvViT, phase 1' if c.kind == 'conv' else 'AttnViT, phase 2'})")
    info.add_row("read as", c.source)
    for key, value in cfg.to_dict(c.kind).items():
        info.add_row(key, escape(str(value)))
    info.add_row("parameters", f"{c.num_params:,}")
    info.add_row("dtype", str(c.dtype).removeprefix("torch."))
    info.add_row("file size", f"{facts['bytes']:,} bytes")
    hc = head_count(cfg.kernel_size, cfg.patch_size, cfg.dilation, channels=cfg.hidden_chans)
    info.add_row("heads needed", f"{hc.patch_heads} ({escape(hc.patch_reason)})")
    console.print(info)
    console.print(f"sha256 {facts['sha256']}", soft_wrap=True)
    if c.kind != "attn":
        return
    heads = Table(title="Pinned offset (dy, dx) per head, read back from the bias", title_justify="left")
    heads.add_column("head")
    for i in range(cfg.depth):
        heads.add_column(f"block {i}", justify="center")
    per_block = [
        pinned_offsets(c.tensors[f"blocks.{i}.attn.rel_pos_bias"], c.tensors.get(f"blocks.{i}.attn.sink"))
        for i in range(cfg.depth)
    ]
    for h in range(cfg.num_heads):
        heads.add_row(str(h), *("free" if o[h] is None else f"{o[h][0]:+d},{o[h][1]:+d}" for o in per_block))
    console.print(heads)
    console.print(
        "[dim]a query patch at (y, x) reads the key patch at (y+dy, x+dx); free: not pinned to one patch[/]"
    )


@app.command()
@handles_errors
def heads(
    kernel: Annotated[int, typer.Option("--kernel", "-k", help="Kernel size K.", show_default=False)],
    patch: Annotated[int, typer.Option("--patch", "-p", help="Patch size P.", show_default=False)],
    dilation: Annotated[int, typer.Option("--dilation", "-d", help="Dilation D.")] = 1,
    channels: Annotated[
        int | None, typer.Option(help="Channels C (Theorem 5's pixel-input bound is min(K², C)).")
    ] = None,
) -> None:
    """How many heads an MHSA layer needs to express a KxK convolution, and why."""
    from .theory import head_count, same_padding

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


def export_table(check: Any) -> Table:
    table = Table(title="onnxruntime vs PyTorch, same images", title_justify="left")
    for col in ("batch", "logits shape", "max |Δ|", "max |ref|", "rel. error", "status"):
        table.add_column(col, justify="right")
    for b in check.batches:
        status = "[green]ok[/]" if b.passed else "[red]FAIL[/]"
        table.add_row(
            str(b.batch), str(tuple(b.output_shape)), _fmt(b.max_abs), _fmt(b.ref_max), _fmt(b.rel), status
        )
    return table


def run_export(
    checkpoint: Path,
    output: Path,
    *,
    opset: int | None = None,
    tol: float = 1e-4,
    exporter: str = "dynamo",
    device: str = "cpu",
    seed: int = 0,
    report: Path | None = None,
) -> bool:
    """``cmhsa export``, also run by ``cmhsa train --export-onnx``: export, check, and write the
    file only if the check passes; the report is written either way. Returns whether it passed."""
    import hashlib

    from .atomic import atomic_write

    report_path = report or output.with_name(output.name + ".report.json")
    check_suffix(output, ".onnx", "ONNX (cmhsa convert writes safetensors checkpoints)")
    check_outputs(checkpoint, output, report_path)
    check_tol(tol)
    from .onnx_export import check_options

    check_options(exporter, opset)

    from .checkpoint import load_checkpoint
    from .models import model_from_checkpoint
    from .onnx_export import export_and_check
    from .onnx_load import providers_for
    from .report import environment, file_facts, write_report

    providers = providers_for(device)
    t = time.perf_counter()
    ckpt = load_checkpoint(checkpoint)
    load_s = time.perf_counter() - t
    print_import(ckpt)
    cfg = ckpt.config
    with console.status(f"Exporting {escape(str(checkpoint))} ({exporter} exporter) and checking it..."):
        ex = export_and_check(
            model_from_checkpoint(ckpt, dtype=None),
            exporter=exporter,
            opset=opset,
            tol=tol,
            providers=providers,
            seed=seed,
            path=output,
        )
    check = ex.check
    console.print(
        f"Exported {escape(str(checkpoint))} ({ckpt.kind}, depth {cfg.depth}, {cfg.img_size[0]}x{cfg.img_size[1]} px) "
        f"with the {ex.exporter} exporter, opset {ex.opsets.get('ai.onnx')}, in {ex.timings['export_s']:.1f} s: "
        f"{len(ex.data) / 1e6:.1f} MB"
    )
    io = ", ".join(f"{v['name']} {v['shape']}" for v in check.inputs + check.outputs)
    console.print(f"checker: full_check passed; {escape(io)}; providers: {', '.join(check.providers)}")
    console.print(export_table(check))
    for problem in check.problems:
        console.print(f"[red]problem[/]: {escape(problem)}")
    worst = check.worst
    output_facts = None
    if check.passed:
        console.print(
            f"[green]PASS[/]: worst relative error {_fmt(worst.rel)} (batch {worst.batch}) <= tol {tol:g}"
        )
        atomic_write(output, lambda tmp: tmp.write_bytes(ex.data))
        output_facts = {
            "path": str(output),
            "bytes": len(ex.data),
            "sha256": hashlib.sha256(ex.data).hexdigest(),
        }
    else:
        console.print(
            f"[red]FAIL[/]: worst relative error {_fmt(worst.rel)} (batch {worst.batch}), tol {tol:g}"
        )
    import onnx
    import onnxruntime

    write_report(
        report_path,
        {
            "command": "export",
            "passed": check.passed,
            "input": {
                **file_facts(checkpoint),
                "kind": ckpt.kind,
                "dtype": str(ckpt.dtype).removeprefix("torch."),
            },
            "output": output_facts,
            "config": cfg.to_dict(ckpt.kind),
            "export": {
                "exporter": ex.exporter,
                "opsets": ex.opsets,
                "ir_version": ex.ir_version,
                "dtype": "float32",
                "onnx": onnx.__version__,
                "onnxruntime": onnxruntime.__version__,
            },
            "check": check.to_dict(),
            "timings": {"load_s": load_s, **ex.timings},
            "environment": environment(),
        },
    )
    if check.passed:
        console.print(f"Wrote {escape(str(output))} and {escape(str(report_path))}")
    else:
        console.print(
            f"Not written: {escape(str(output))} (check failed); report: {escape(str(report_path))}"
        )
    return check.passed


@app.command("export")
@handles_errors
def export_cmd(
    checkpoint: Annotated[
        Path, typer.Argument(readable=False, help="Checkpoint to export (attn or conv).", show_default=False)
    ],
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", readable=False, help="ONNX file to write (.onnx).", show_default=False
        ),
    ],
    opset: Annotated[
        int | None, typer.Option(help="ai.onnx opset (>= 17; default: the exporter's).", show_default=False)
    ] = None,
    tol: Annotated[float, typer.Option(help="Largest relative error of onnxruntime vs PyTorch.")] = 1e-4,
    exporter: Annotated[
        str, typer.Option(help="dynamo (torch.export, torch's default) or legacy (TorchScript).")
    ] = "dynamo",
    device: Annotated[
        str,
        typer.Option(help="onnxruntime provider for the check: cpu, cuda, or auto (CUDA when it has it)."),
    ] = "cpu",
    seed: Annotated[int, typer.Option(help="Seed of the check images.")] = 0,
    report: Annotated[
        Path | None, typer.Option(readable=False, help="Report path (default: OUTPUT + .report.json).")
    ] = None,
) -> None:
    """Export a checkpoint to one self-contained ONNX file and check it in onnxruntime (exit 1 outside --tol)."""
    if device not in ("cpu", "cuda", "auto"):
        raise CmhsaError(f"--device must be cpu, cuda or auto, got {device!r}")
    passed = run_export(
        checkpoint, output, opset=opset, tol=tol, exporter=exporter, device=device, seed=seed, report=report
    )
    raise typer.Exit(0 if passed else EXIT_FAIL)


def version_callback(value: bool) -> None:
    if value:
        print(f"cmhsa {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=version_callback, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """cmhsa: exact conv -> self-attention conversion ("Can Vision Transformers Perform Convolution?")."""


def _mount_training() -> None:
    from train.cli import register  # typer only: torch and timm load when a training command runs

    register(app)


_mount_training()


def main() -> None:
    from .atomic import exit_on_sigterm

    exit_on_sigterm()  # a killed convert/export unwinds and removes its temp files (training traps it first)
    app()
