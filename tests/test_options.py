"""One declaration per option: every command's flags take their defaults and ranges from the
library's typed objects (convit_convert.settings, ConversionSpec, ExportOptions, TrainConfig), so a
CLI default or range that differs from the library's fails here, for every command."""

from __future__ import annotations

import dataclasses
import inspect
import math
from pathlib import Path
from typing import Any

import pytest
import typer.main

from convit_convert.bounds import BOUNDS
from convit_convert.cli import app
from convit_convert.errors import CmhsaError
from convit_convert.onnx.options import ExportOptions
from convit_convert.settings import (
    AttentionOptions,
    CalibrationSource,
    EvalOptions,
    Geometry,
    HeadsQuery,
    PredictOptions,
    Verification,
)
from convit_convert.spec import ConversionSpec
from convit_convert.train.config import TrainConfig


def _verify_files(**kwargs: Any) -> Any:
    from convit_convert.api import verify_files

    missing = Path("/nonexistent")
    return verify_files(missing / "conv.safetensors", missing / "attn.safetensors", **kwargs)


def _verify_keywords() -> dict[str, Any]:
    from convit_convert.api import verify_files

    params = inspect.signature(verify_files).parameters
    return {n: params[n].default for n in ("tol", "seed")}


# Each command, and the library objects (or callables) its options are the fields (or keywords) of,
# first match wins; options that are the CLI's own (paths, a switch between code paths, an old
# spelling) are listed, so a new option must be declared in the library or named here.
LIBRARY: dict[str, tuple[Any, ...]] = {
    "convert": (ConversionSpec, Verification, Geometry, CalibrationSource),
    "verify": (Verification, _verify_files),
    "inspect": (Geometry,),
    "heads": (HeadsQuery, CalibrationSource, ConversionSpec),
    "export": (ExportOptions,),
    "eval": (EvalOptions,),
    "predict": (PredictOptions,),
    "attention": (AttentionOptions,),
    "plot": (),
    "train phase1": (TrainConfig,),
    "train phase2": (TrainConfig,),
}
CLI_ONLY = {
    "convert": {"output", "report", "verify", "img_size"},  # img_size: "H or HxW", parsed to Geometry's
    "verify": {"report"},
    "inspect": {"img_size"},
    "heads": {"checkpoint", "kernel", "patch"},  # kernel, patch: hidden old spellings
    "export": {"output", "format", "report"},
    "eval": {"data"},  # required, no default: a missing --data is the CLI's one-line error
    "predict": {"output"},
    "attention": {"output", "data"},
    "plot": {"output"},
    "train phase1": {"output", "out"},
    "train phase2": {"output", "out"},
}
REQUIRED = {"data": "digits"}  # what objects with a required field are made with here


def commands() -> list[tuple[str, Any]]:
    root = typer.main.get_command(app)
    out = []
    for name, cmd in root.commands.items():
        subs = getattr(cmd, "commands", None)
        out += [(f"{name} {s}", c) for s, c in subs.items()] if subs else [(name, cmd)]
    return out


def fields(source: Any) -> dict[str, Any]:
    """A library source's option names and defaults (``inspect.Parameter.empty``: required)."""
    if source is TrainConfig:
        return TrainConfig.from_flags().to_dict()
    if dataclasses.is_dataclass(source):
        return {
            f.name: f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
            for f in dataclasses.fields(source)
        }
    return _verify_keywords()


def make(source: Any, name: str, value: Any) -> None:
    """Hand ``value`` for option ``name`` to the library as a user of it would."""
    if source is TrainConfig:
        TrainConfig.from_flags(phase="phase2", **{name: value}).check_ranges()
    elif dataclasses.is_dataclass(source):
        required = {
            f.name: REQUIRED[f.name]
            for f in dataclasses.fields(source)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        source(**{**required, name: value})
    else:
        source(**{name: value})


def test_every_command_is_declared_here() -> None:
    assert sorted(name for name, _ in commands()) == sorted(LIBRARY)


@pytest.mark.parametrize("command", sorted(LIBRARY))
def test_a_commands_defaults_are_the_librarys(command: str) -> None:
    """Every option of ``command`` is a field of a library object (or the CLI's own), and its
    default is the field's (train's flags default to None and show the library's in --help)."""
    cmd = dict(commands())[command]
    checked = 0
    for p in cmd.params:
        if p.param_type_name != "option" or p.name == "help":
            continue
        owner = next((s for s in LIBRARY[command] if p.name in fields(s)), None)
        if owner is None:
            assert p.name in CLI_ONLY[command], f"{command} --{p.name}: no library object declares it"
            continue
        default = fields(owner)[p.name]
        if command.startswith("train"):
            assert p.default is None, (command, p.name)  # unset flags: TrainConfig's defaults
        elif default is inspect.Parameter.empty:
            assert p.default is None, (command, p.name)
        else:
            assert p.default == default, f"{command} --{p.name}: CLI {p.default!r}, library {default!r}"
        checked += 1
    assert checked >= {"plot": 0}.get(command, 1), command
    assert not (CLI_ONLY[command] - {p.name for p in cmd.params}), "a CLI-only name no option has"


def outside(lo: float, hi: float, lo_open: bool, hi_open: bool, integer: bool) -> list[float]:
    """Values just outside [lo, hi] (both ends), as the option's type can hold them, and for floats
    NaN and infinity."""
    step = 1 if integer else max(1e-9, 1e-9 * abs(hi))
    below = lo if lo_open else lo - step
    above = hi if hi_open else hi + step
    return [below, above] + ([] if integer else [math.nan, math.inf])


@pytest.mark.parametrize("command", sorted(LIBRARY))
def test_a_commands_ranges_are_the_librarys(command: str) -> None:
    """Every numeric option with a range (shown in --help and checked by the CLI, bounds.BOUNDS) is
    refused by the library just outside that range, and taken at its ends: the library holds each
    value to the range the CLI shows."""
    cmd = dict(commands())[command]
    probed = 0
    for p in cmd.params:
        bound = BOUNDS.get(p.name or "")
        owner = next((s for s in LIBRARY[command] if p.name in fields(s)), None)
        if bound is None or owner is None or p.param_type_name != "option":
            continue
        integer = "int" in repr(p.type_descriptor.annotation)  # the flag's Python type, as typer read it
        scalar = not (p.nargs != 1 or p.multiple)
        wrap = (lambda v: v) if scalar else (lambda v, n=p.nargs: (v, v) if n == 2 else [v])
        for v in outside(bound.lo, bound.hi, bound.lo_open, bound.hi_open, integer):
            with pytest.raises(CmhsaError) as e:
                make(owner, p.name, wrap(int(v) if integer and math.isfinite(v) else v))
            assert f"must be {bound.text()}" in e.value.message, (command, p.name, v, e.value.message)
        for edge in (bound.lo, bound.hi):
            if (edge == bound.lo and bound.lo_open) or (edge == bound.hi and bound.hi_open):
                continue
            value = wrap(int(edge) if integer else edge)
            try:
                make(owner, p.name, value)
            except CmhsaError as e:  # at the edge: any refusal but the range's (a missing file, ...)
                assert "must be" not in e.message, (command, p.name, edge, e.message)
        probed += 1
    expected = {"inspect": 1, "plot": 0, "eval": 4, "attention": 3}.get(command, 2)
    assert probed >= expected, (command, probed)
