"""The model sizes the benchmarks run at: the paper's, which BENCHMARKS.md's figures measure, and a
tiny one (``--tiny``), at which tests/test_bench.py runs every script so that none rots (its
output is a table, not a measurement).

    from sizes import add_size_flag, conv_config
    add_size_flag(ap); cfg = conv_config(args)          # ViTConfig.build(), or the tiny model
"""

from __future__ import annotations

import argparse
from typing import Any

from convit_convert.config import ViTConfig

# the paper's phase-1 model is ViTConfig.build()'s defaults: 224 px, P 16, d 768, depth 6, K 5
TINY = {"img_size": 16, "patch_size": 4, "depth": 1, "kernel_size": 3, "num_classes": 10}


def add_size_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny model: checks the script runs, measures nothing"
    )


def conv_config(args: argparse.Namespace, **kw: Any) -> ViTConfig:
    """The benchmark's phase-1 config: the paper's (``kw`` over ViTConfig.build's defaults), or,
    with ``--tiny``, the tiny model (``kw`` but the sizes)."""
    if getattr(args, "tiny", False):
        kw = {k: v for k, v in kw.items() if k not in TINY and k != "hidden_chans"}
        return ViTConfig.build(**{**TINY, **kw})
    return ViTConfig.build(**kw)
