"""Malformed input through every command that reads it: mutated safetensors headers and bodies,
mutated ONNX protos and external-data entries, renamed formats, crafted metrics, and every
numeric flag of every command out of its range (generated from cli/bounds.py's declarations).

Each case must end with exit 1 or 2 (never 3, an internal error; 0 where the mutation left a
valid file), exactly one line on stderr, no traceback, no new file beside the inputs, and the
inputs unchanged. Hypothesis drives the mutations, derandomized and bounded, so a run is the same
every time and takes about a minute.
"""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
from pathlib import Path
from typing import get_args

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from conftest import FIXTURE
from convit_convert.cli import app
from convit_convert.cli.bounds import BOUNDS, num

SETTINGS = settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def fresh(tmp_path: Path) -> Path:
    """A new folder per Hypothesis example (tmp_path is shared by all of a test's examples)."""
    return Path(tempfile.mkdtemp(dir=tmp_path))


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def check_outcome(r, inputs: Path, before: dict[str, str], allow_ok: bool = True) -> None:
    """The contract: exit 1/2 with one error line and no traceback (or 0 for a still-valid input);
    the inputs' folder exactly as it was."""
    assert r.exit_code in ((0, 1, 2) if allow_ok else (1, 2)), (r.exit_code, r.output[-2000:])
    assert "Traceback" not in r.output, r.output[-2000:]
    if r.exit_code != 0:
        err = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: "), r.stderr[-2000:]
    assert snapshot(inputs) == before


# every numeric flag, out of range ----------------------------------------------------------------


def commands() -> list[tuple[list[str], object]]:
    """(command path, click command) for every leaf command of the app."""
    found = []

    def walk(cmd: object, path: list[str]) -> None:
        sub = getattr(cmd, "commands", None)
        if sub:
            for name, c in sub.items():
                walk(c, [*path, name])
        else:
            found.append((path, cmd))

    walk(typer.main.get_command(app), [])
    return found


def required_args(path: list[str], folder: Path) -> list[str]:
    """Just enough positional arguments and required options for the command to parse."""
    f = str(FIXTURE)
    return {
        "convert": [f, "-o", str(folder / "out.safetensors")],
        "verify": [f, f],
        "inspect": [f],
        "export": [f, "-o", str(folder / "out.onnx")],
        "eval": [f],
        "attention": [f, "-o", str(folder / "att")],
        "plot": [str(folder)],
        "train phase1": ["-o", str(folder / "run")],
        "train phase2": ["-o", str(folder / "run")],
    }.get(" ".join(path), [])


def out_of_range(name: str, is_int: bool) -> list[str]:
    b = BOUNDS[name]
    below = b.lo if b.lo_open else b.lo - 1
    above = b.hi if b.hi_open else b.hi + 1
    values = [num(below), num(above)]
    if not is_int:
        values += ["nan", "inf", "-inf"]
    else:
        values += ["1.5", "x"]  # not integers: the parser's own one-line refusal
    return values


def number_type(p: object) -> type | None:
    """int or float for a numeric option (a pair of them included), else None."""
    ann = p.type_descriptor.annotation  # type: ignore[attr-defined]
    base = (get_args(ann) or (ann,))[0]
    return base if base in (int, float) else None


def flag_cases() -> list[tuple[list[str], str, int, str]]:
    cases = []
    for path, cmd in commands():
        for p in cmd.params:  # type: ignore[attr-defined]
            if p.name in BOUNDS and p.opts and p.opts[0].startswith("--"):
                for v in out_of_range(p.name, number_type(p) is int):
                    cases.append((path, p.opts[0], p.nargs, v))
    return cases


FLAG_CASES = flag_cases()


def test_every_command_s_numeric_flags_are_declared() -> None:
    """The generator sees the flags: every numeric option of every command has a bound."""
    unbounded = []
    for path, cmd in commands():
        for p in cmd.params:  # type: ignore[attr-defined]
            if number_type(p) is not None and p.name not in BOUNDS:
                unbounded.append(f"{' '.join(path)} {p.opts[0]}")
    assert unbounded == []
    assert len(FLAG_CASES) > 150


@pytest.mark.parametrize(("path", "flag", "nargs", "value"), FLAG_CASES, ids=lambda v: str(v))
def test_out_of_range_flag(tmp_path: Path, path: list[str], flag: str, nargs: int, value: str) -> None:
    before = snapshot(tmp_path)
    r = invoke(*path, *required_args(path, tmp_path), flag, *([value] * nargs))
    check_outcome(r, tmp_path, before, allow_ok=False)
    assert r.exit_code == 2 and flag in r.stderr, r.stderr


# mutated safetensors -----------------------------------------------------------------------------


def fixture_parts() -> tuple[dict, bytes]:
    raw = FIXTURE.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def pack(header: object, body: bytes, pad: bool = True) -> bytes:
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


WEIRD = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.none(),
    st.booleans(),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=5),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@SETTINGS
@given(data=st.data())
def test_mutated_safetensors_header(tmp_path: Path, data: st.DataObject) -> None:
    header, body = fixture_parts()
    names = sorted(k for k in header if k != "__metadata__")
    target = data.draw(st.sampled_from([*names, "__metadata__"]))
    if target == "__metadata__":
        key = data.draw(st.sampled_from([*sorted(header["__metadata__"]), "new"]))
        header["__metadata__"][key] = data.draw(WEIRD)
    else:
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
        header[target][field] = data.draw(WEIRD)
    folder = fresh(tmp_path)
    bad = folder / "model.safetensors"
    bad.write_bytes(pack(header, body, pad=data.draw(st.booleans())))
    before = snapshot(folder)
    check_outcome(invoke("inspect", bad), folder, before)


@SETTINGS
@given(data=st.data())
def test_mutated_safetensors_bytes(tmp_path: Path, data: st.DataObject) -> None:
    raw = bytearray(FIXTURE.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    kind = data.draw(st.sampled_from(["flip-header", "flip-length", "truncate", "append"]))
    if kind == "flip-header":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(8, 8 + n - 1))
            raw[i] = data.draw(st.integers(0, 255))
    elif kind == "flip-length":
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw += bytes(data.draw(st.binary(min_size=1, max_size=64)))
    folder = fresh(tmp_path)
    bad = folder / "model.safetensors"
    bad.write_bytes(bytes(raw))
    before = snapshot(folder)
    out = fresh(tmp_path)
    for args in (["inspect", bad], ["convert", bad, "-o", out / "v.safetensors", "--no-verify"]):
        check_outcome(invoke(*args), folder, before)


# renamed and foreign formats ---------------------------------------------------------------------


def renamed_inputs(folder: Path) -> list[Path]:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(FIXTURE))
    made = []

    def put(name: str, data: bytes) -> None:
        (folder / name).write_bytes(data)
        made.append(folder / name)

    torch.save(tensors, folder / "zip.pt")
    put("zip-as.safetensors", (folder / "zip.pt").read_bytes())
    (folder / "zip.pt").unlink()
    put("safetensors-as.pt", FIXTURE.read_bytes())
    put("safetensors-as.onnx", FIXTURE.read_bytes())
    put("random.onnx", bytes(range(256)) * 8)
    put("random.safetensors", bytes(range(256)) * 8)
    put("text.pt", b"not a pickle at all\n")
    put("empty.safetensors", b"")
    put("json.safetensors", b'{"a": 1}')
    torch.save({"model": {"x": 1}}, folder / "nested.pt")
    made.append(folder / "nested.pt")
    torch.save([tensors["head.bias"]], folder / "list.pt")
    made.append(folder / "list.pt")
    return made


def test_renamed_and_foreign_files_through_every_reader(tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    files = renamed_inputs(folder)
    out = tmp_path / "out"
    out.mkdir()
    before = snapshot(folder)
    for f in files:
        for args in (
            ["inspect", f],
            ["convert", f, "-o", out / "v.safetensors", "--no-verify"],
            ["verify", FIXTURE, f],
            ["export", f, "-o", out / "v.onnx"],
            ["heads", "--checkpoint", f],
            ["eval", f, "--data", "synthetic"],
        ):
            r = invoke(*args)
            check_outcome(r, folder, before)  # 0 where the content is valid whatever the name


# mutated ONNX ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conv_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("onnx") / "conv.onnx"
    r = invoke("export", FIXTURE, "-o", path)
    assert r.exit_code == 0, r.output
    return path


ONNX_MUTATIONS = ["dims", "data_type", "raw_data", "drop_node", "op_type", "opset", "external", "input_shape"]


@settings(
    max_examples=24,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_mutated_onnx(tmp_path: Path, conv_onnx: Path, data: st.DataObject) -> None:
    import onnx

    model = onnx.load(str(conv_onnx))
    graph = model.graph
    kind = data.draw(st.sampled_from(ONNX_MUTATIONS))
    inits = list(graph.initializer)
    t = inits[data.draw(st.integers(0, len(inits) - 1))]
    folder = fresh(tmp_path)
    if kind == "dims":
        t.dims[:] = data.draw(st.lists(st.integers(0, 2**20), min_size=0, max_size=4))
    elif kind == "data_type":
        t.data_type = data.draw(st.integers(0, 40))
    elif kind == "raw_data":
        t.raw_data = t.raw_data[: data.draw(st.integers(0, max(0, len(t.raw_data) - 1)))]
    elif kind == "drop_node":
        del graph.node[data.draw(st.integers(0, len(graph.node) - 1))]
    elif kind == "op_type":
        graph.node[data.draw(st.integers(0, len(graph.node) - 1))].op_type = data.draw(
            st.sampled_from(["Relu", "Sigmoid", "Identity", "Foo", "Add", "Transpose"])
        )
    elif kind == "opset":
        model.opset_import[0].version = data.draw(st.integers(1, 40))
    elif kind == "input_shape":
        dim = graph.input[0].type.tensor_type.shape.dim[data.draw(st.integers(1, 3))]
        dim.dim_value = data.draw(st.integers(0, 2**20))
    else:  # external data entries the file cannot honour
        (folder / "weights.bin").write_bytes(t.raw_data)
        t.ClearField("raw_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        entries = {
            "location": data.draw(
                st.sampled_from(["weights.bin", "../x.bin", "/etc/passwd", "", "nope.bin"])
            ),
            "offset": data.draw(st.sampled_from(["0", "x", "-8", "1e3", str(2**40)])),
            "length": data.draw(st.sampled_from(["", "-1", "y", "4", str(2**40)])),
        }
        for k, v in entries.items():
            e = t.external_data.add()
            e.key, e.value = k, v
    bad = folder / "conv.onnx"
    bad.write_bytes(model.SerializeToString())
    before = snapshot(folder)
    check_outcome(invoke("inspect", bad), folder, before)


# plot: what it reads and where it writes ---------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff\xfe binary \x89PNG",
        b"",
        b"just one line\n",
        b"epoch,top1\nx,y\n",
        b"a;b\n1;2\n",
        b"epoch\n1\n2\n",
    ],
)
def test_plot_refuses_unusable_metrics_in_one_line(tmp_path: Path, content: bytes) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_bytes(content)
    before = snapshot(run)
    r = invoke("plot", run, "-o", tmp_path / "curves.png")
    check_outcome(r, run, before)


def test_plot_refuses_an_output_that_is_not_an_image(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text(
        "epoch,train_loss,val_loss,top1,top5\n1,2.0,1.9,30,80\n2,1.5,1.4,50,90\n"
    )
    before = snapshot(run)
    for suffix in (".txt", ".safetensors", ""):
        r = invoke("plot", run, "-o", tmp_path / f"curves{suffix}")
        check_outcome(r, run, before, allow_ok=False)
        assert not (tmp_path / f"curves{suffix}").exists()
