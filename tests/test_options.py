"""One declaration per option: every command's flags take their defaults and ranges from the
library's typed objects (convit_convert.options: operations, conversion, training), so a
CLI default or range that differs from the library's fails here, for every command; and what the
command line refuses (a value its parser cannot read as the flag's type, a name that is not one of
the choices) the library refuses when the object is made."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import pytest

from conftest import leaf_commands
from convit_convert.errors import CmhsaError
from convit_convert.options.conversion import ConversionSpec
from convit_convert.options.operations import (
    AttentionOptions,
    CalibrationSource,
    EvalOptions,
    ExportOptions,
    Geometry,
    HeadsQuery,
    PredictOptions,
    Verification,
    VerifyOptions,
)
from convit_convert.options.training import TrainConfig
from convit_convert.options.values import BOUNDS

# Each command, and the library objects (or callables) its options are the fields (or keywords) of,
# first match wins; options that are the CLI's own (paths, a switch between code paths, an old
# spelling) are listed, so a new option must be declared in the library or named here.
LIBRARY: dict[str, tuple[Any, ...]] = {
    "convert": (ConversionSpec, Verification, Geometry, CalibrationSource),
    "verify": (Verification, VerifyOptions),
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
    "export": {"output", "format", "report", "license"},  # license: --format timm's (export_timm_folder)
    "eval": {"data"},  # required, no default: a missing --data is the CLI's one-line error
    "predict": {"output"},
    "attention": {"output", "data"},
    "plot": {"output"},
    # seeds: comma-separated text, parsed to RuntimeConfig.seeds' tuple (cli/train.seed_list; the
    # library's range of each seed: tests/test_stacked.py)
    # config, print_config: the flags read from a file, and printed (cli/train.read_run_config)
    "train phase1": {"output", "out", "seeds", "config", "print_config"},
    "train phase2": {"output", "out", "seeds", "config", "print_config"},
}
REQUIRED = {"data": "digits"}  # what objects with a required field are made with here


def commands() -> list[tuple[str, Any]]:
    """(name, click command) of every command, named as LIBRARY names it."""
    return [(" ".join(path), cmd) for path, cmd in leaf_commands()]


def fields(source: Any) -> dict[str, Any]:
    """A library source's option names and defaults (``inspect.Parameter.empty``: required)."""
    if source is TrainConfig:
        return TrainConfig.from_flags().to_dict()
    return {
        f.name: f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
        for f in dataclasses.fields(source)
    }


def make(source: Any, name: str, value: Any) -> None:
    """Hand ``value`` for option ``name`` to the library as a user of it would."""
    if source is TrainConfig:
        TrainConfig.from_flags(phase="phase2", **{name: value})
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
    """Every numeric option with a range (shown in --help and checked by the CLI, options.values.BOUNDS) is
    refused by the library just outside that range, and taken at its ends: the library holds each
    value to the range the CLI shows."""
    cmd = dict(commands())[command]
    probed = 0
    for p in cmd.params:
        bound = BOUNDS.get(p.name or "")
        owner = next((s for s in LIBRARY[command] if p.name in fields(s)), None)
        if bound is None or owner is None or p.param_type_name != "option" or p.name in CLI_ONLY[command]:
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


def wrong_values(command: Any, param: Any) -> list[tuple[str, Any]]:
    """What the command line refuses for ``param``, as (the text typed, the Python value a library
    user would pass for it): the command's own parser decides which texts it refuses."""
    if param.is_flag:  # --sink / --no-sink take no value: a library user may still pass one
        return [("no", "no"), ("1", 1)]
    ctx, refused = command.context_class(command), []
    for text, value in (("2.5", 2.5), ("x", "x"), ("True", True)):
        try:
            param.process_value(ctx, text if param.nargs == 1 else (text,) * param.nargs)
        except Exception:  # the parser's refusal (BadParameter): the CLI's exit 2
            refused.append((text, value if param.nargs == 1 else (value,) * param.nargs))
    return refused


def choices(owner: Any, name: str) -> tuple[str, ...]:
    """The names an option of ``owner`` must be one of (its CHOICES, under the field it is)."""
    if owner is TrainConfig:
        owner, name = TrainConfig.owner(name)
    return getattr(owner, "CHOICES", {}).get(name, ())


@pytest.mark.parametrize("command", sorted(LIBRARY))
def test_what_a_command_refuses_the_library_refuses_when_the_object_is_made(command: str) -> None:
    """The refusal table: every value the command line refuses for an option (by its parser: a
    number that is no integer, text for a number, a value for a switch; by the library: a name not
    among the choices) is refused by the library object that owns the option, when it is made, in
    one CmhsaError naming the option, never accepted to fail later."""
    cmd = dict(commands())[command]
    refused = 0
    for p in cmd.params:
        owner = next((s for s in LIBRARY[command] if p.name in fields(s)), None)
        if owner is None or p.param_type_name != "option" or p.name in CLI_ONLY[command]:
            continue
        named = bool(choices(owner, p.name)) or p.name == "device"  # a name the library checks
        table = wrong_values(cmd, p) + [("nope", "nope")] * named
        for text, value in table:
            with pytest.raises(CmhsaError) as e:
                make(owner, p.name, value)
            assert f"`{p.name}` must be" in e.value.message, (command, p.name, text, e.value.message)
            refused += 1
    assert refused >= {"plot": 0, "inspect": 3}.get(command, 4), (command, refused)


@pytest.mark.parametrize(
    "make_it",
    [
        lambda: TrainConfig.from_flags(epochs=-5),
        lambda: TrainConfig.from_flags(lr=-1),
        lambda: TrainConfig.from_flags(batch_size=0),
        lambda: TrainConfig.from_flags(data="nope"),
        lambda: TrainConfig.from_flags(loader="x"),
        lambda: TrainConfig.from_flags(amp="x"),
        lambda: ConversionSpec(margin="40"),  # type: ignore[arg-type]
        lambda: ConversionSpec(heads=2.5),  # type: ignore[arg-type]
        lambda: ConversionSpec(sink="no"),  # type: ignore[arg-type]
        lambda: Verification(batch=True),
        lambda: Verification(batch="4"),  # type: ignore[arg-type]
    ],
)
def test_the_values_the_library_once_took_are_refused(make_it: Any) -> None:
    """Each accepted before the objects checked themselves (issue 58); ConversionSpec(sink="no")
    reached the conversion plan."""
    with pytest.raises(CmhsaError, match="must be"):
        make_it()


@pytest.mark.parametrize("value", [True, "4", (1, "x"), [2.0, None]])
def test_a_range_check_refuses_what_is_no_number(value: Any) -> None:
    """options.values.check, which the CLI and every option object call: a bool or text is no
    number, so never "in range" (it once skipped both)."""
    from convit_convert.options.values import check

    with pytest.raises(CmhsaError, match="`batch` must be a number"):
        check("batch", value)
