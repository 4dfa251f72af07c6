"""JSON reports written beside outputs, and the file facts they record (no torch import)."""

from __future__ import annotations

import hashlib
import platform
import sys
from pathlib import Path
from typing import Any

from ..text import json_text
from ..version import __version__
from .atomic import atomic_text
from .outputs import Target


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_facts(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    return {"path": str(p), "bytes": p.stat().st_size, "sha256": sha256_file(p)}


def default_report_path(output: Path) -> Path:
    """``vit.safetensors`` -> ``vit.report.json``, beside it."""
    return output.with_name(output.stem + ".report.json")


def environment() -> dict[str, str]:
    import torch

    return {
        "cmhsa": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def report_text(report: dict[str, Any]) -> str:
    return json_text(report) + "\n"


def write_report(target: Target, report: dict[str, Any]) -> None:
    """``report`` as JSON, written as ``target`` in its held folder."""
    atomic_text((target, report_text(report)))
