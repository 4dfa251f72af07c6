"""Every command's ``--help`` and its vocabulary: one spelling per concept across subcommands, each
default shown once, no type metavars, arguments named as the README names them."""

from __future__ import annotations

import re

import pytest
import typer

from conftest import invoke, leaf_commands
from convit_convert.cli import app
from convit_convert.cli import options as opts

WIDE = {"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"}  # one row per option: no wrapping to confuse the checks


COMMANDS = leaf_commands()
# the old spellings, kept hidden for one release; a visible one would be a second spelling
OLD = {"--out": "--output", "--kernel": "--kernel-size", "--patch": "--patch-size"}


def test_every_command_is_walked() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {
        "convert",
        "verify",
        "inspect",
        "heads",
        "export",
        "train phase1",
        "train phase2",
        "eval",
        "attention",
        "plot",
        "predict",
    } <= names


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p))
def test_help_shows_each_default_once_and_no_type_metavars(path: tuple[str, ...]) -> None:
    r = invoke([*path, "--help"], env=WIDE)
    assert r.exit_code == 0, r.output
    text = r.output
    assert not re.search(r"<(int|integer|str|text|float|path|bool)>", text), "a type metavar"
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert "{" not in usage, usage  # INPUT, as the README writes it, not {input}
    rows = [line for line in text.splitlines() if re.match(r"\s*│\s*\*?\s*-", line)]
    assert rows, text
    for row in rows:
        assert len(re.findall(r"default", row, re.I)) <= 1, f"a default said twice: {row.strip()}"
        assert "[default: None]" not in row, row.strip()


def shown(p) -> tuple:
    """(the default a user is shown, the help without the default and range typer or train add)."""
    said = re.search(r" \\\[default: ([^\]]*)\]$", p.help.split(" \\[range")[0])
    help = p.help.split(" \\[range")[0]
    if said and p.default is None:  # train's flags default to None ("not typed") and say theirs
        return said.group(1), help[: said.start()]
    return p.default, help


def test_one_spelling_per_concept() -> None:
    """Written paths are -o/--output everywhere; --device has one default and one help; --workers
    one help and one default; the old spellings are hidden aliases only."""
    seen: dict[str, list] = {}
    for path, cmd in COMMANDS:
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            if not p.hidden:
                assert not set(p.opts) & OLD.keys(), (path, p.opts)
                # the help's prose names the new spellings too
                named = set(re.findall(r"--[a-z][a-z-]*", p.help or ""))
                assert not named & OLD.keys(), (path, p.opts, named & OLD.keys())
            seen.setdefault(p.name, []).append((path, p))
    for path, p in seen["output"]:
        assert set(p.opts) == {"--output", "-o"}, path
    devices = {shown(p) for _, p in seen["device"]}
    assert devices == {("auto", opts.DEVICE_HELP)}, devices
    workers = {shown(p) for _, p in seen["workers"]}
    assert workers == {(None, opts.WORKERS_HELP)}, workers
    for name in ("kernel_size", "patch_size"):  # heads, train, convert: one name for K and P
        assert all(p.opts[0] == "--" + name.replace("_", "-") for _, p in seen[name])
    assert len(seen["margin"]) == 2  # convert and phase 2 (which converts --init)


def test_old_spellings_still_work_and_say_so() -> None:
    new = invoke(["heads", "--kernel-size", "5", "--patch-size", "16"])
    old = invoke(["heads", "--kernel", "5", "--patch", "16"])
    assert new.exit_code == old.exit_code == 0
    assert "note: --kernel is now --kernel-size" in old.stderr and "note:" not in new.stderr
    assert old.stdout == new.stdout
    both = invoke(["heads", "-k", "5", "--kernel", "7", "-p", "4"])
    assert both.exit_code == 2 and "--kernel and --kernel-size are one option" in both.stderr


def test_train_takes_output_and_the_old_out(tmp_path) -> None:
    for flag in ("-o", "--output", "--out"):
        r = invoke(["train", "phase2", flag, str(tmp_path / "r"), "--pinning", "soft"])
        assert r.exit_code == 2 and "--pinning must be one of hard, gated" in r.stderr, (
            r.output
        )  # past the alias
        assert ("note: --out is now -o/--output" in r.stderr) == (flag == "--out")
    r = invoke(["train", "phase1", "--epochs", "1"])
    assert r.exit_code == 2 and "-o/--output is missing" in r.stderr


def test_convert_margin_shapes_the_conversion(tmp_path) -> None:
    """--margin M on convert: the logits are S = ln N + M and S + M (N = 64 patches of the fixture),
    and the softmax leaks about e^-M: at M = 5 the worst relative error is within 10x of e^-5
    (measured 7.0e-3), at the default 40 float32 rounding (below 1e-5)."""
    import json
    import math

    def convert(*flags: str) -> tuple[dict, float]:
        out = tmp_path / f"m{len(flags)}.safetensors"
        r = invoke(["convert", "fixtures/conv_digits.safetensors", "-o", str(out), "--tol", "1", *flags])
        assert r.exit_code == 0, r.output
        doc = json.loads(out.with_suffix(".report.json").read_text())
        worst = max(e["rel"] for e in doc["verification"]["errors"])
        return doc["conversion"], worst

    low, low_err = convert("--margin", "5")
    assert math.isclose(low["sink_logit"], math.log(64) + 5) and math.isclose(
        low["offset_logit"], math.log(64) + 10
    )
    assert math.exp(-5) / 10 < low_err < math.exp(-5) * 10
    default, err = convert()
    assert math.isclose(default["offset_logit"], math.log(64) + 80) and err < 1e-5


def test_a_missing_data_names_the_flag_and_the_choices(tmp_path) -> None:
    for cmd in (
        ["eval", "fixtures/conv_digits.safetensors"],
        ["attention", "fixtures/conv_digits.safetensors", "-o", str(tmp_path)],
    ):
        r = invoke(cmd)
        assert r.exit_code == 2, r.output
        assert (
            f"--data is missing: {cmd[0]} needs a dataset, one of cifar100, cifar10, imagefolder, digits"
            in r.stderr
        )
        assert "cifar100` needs" not in r.stderr and "--data-dir" not in r.stderr  # not a dataset never typed


def flag_pairs(cmd) -> list[str]:
    """The --x/--no-x pairs a command shows (the hidden ones aside), by their --x."""
    return [p.opts[0] for p in cmd.params if getattr(p, "secondary_opts", None) and not p.hidden]


PAIRED = [(p, c) for p, c in COMMANDS if flag_pairs(c)]


def test_the_flag_pair_test_sees_the_commands_with_pairs() -> None:
    assert {" ".join(p) for p, _ in PAIRED} >= {"convert", "train phase1", "train phase2", "eval"}


@pytest.mark.parametrize(("path", "cmd"), PAIRED, ids=lambda x: " ".join(x) if isinstance(x, tuple) else "")
def test_a_flag_pairs_default_is_shown_one_way(path: tuple[str, ...], cmd) -> None:
    """--x/--no-x shows "[default: x]" or "[default: no-x]" in every command that has a pair
    (typer's own way), never True/False; every pair the command declares is a row checked."""
    r = invoke([*path, "--help"], env=WIDE)
    seen = []
    for row in (line for line in r.output.splitlines() if "--no-" in line):
        flag = re.search(r"--([a-z-]+)\s+--no-\1", row)
        assert flag, row.strip()
        said = re.search(r"\[default: ([^\]]*)\]", row)
        assert said and said.group(1) in (flag.group(1), f"no-{flag.group(1)}"), row.strip()
        seen.append(f"--{flag.group(1)}")
    assert sorted(seen) == sorted(flag_pairs(cmd)), (seen, flag_pairs(cmd))


def test_cmhsa_keeps_its_state_on_its_own_objects() -> None:
    """Running a command adds no attribute to typer's or click's objects (the root group, the
    commands, their callbacks): which commands are tidied and bounded is kept in cmhsa's modules."""
    from convit_convert.cli import bounds

    root = typer.main.get_command(app)  # the object run below, as cmhsa's main() runs it
    before = {id(c): set(vars(c)) for c in [root, *root.commands.values()]}
    root.main(["heads", "--kernel-size", "3", "--patch-size", "2"], standalone_mode=False)
    after = {id(c): set(vars(c)) for c in [root, *root.commands.values()]}
    assert after == before
    callbacks = [i.callback for i in app.registered_commands]
    assert all(not any(k.startswith("_bounded") for k in vars(cb)) for cb in callbacks)
    assert set(callbacks) <= bounds.BOUNDED


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p))
def test_a_commands_summary_is_one_whole_sentence(path: tuple[str, ...]) -> None:
    """`cmhsa --help` lists each command by its help's first paragraph: a line break there shows
    as a sentence cut in the middle (heads, export and predict once did)."""
    cmd = dict(COMMANDS)[path]
    summary = (cmd.help or "").strip().split("\n\n")[0]
    assert summary and "\n" not in summary and summary.endswith("."), summary
