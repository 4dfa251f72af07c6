"""Malformed input through every command that reads it: mutated safetensors headers and bodies,
mutated ONNX protos and external-data entries, renamed formats, crafted metrics, hostile commit
journals beside every input and output, crafted timm folders, and every numeric flag of every
command out of its range (generated from bounds.py's declarations).

Each case must end with exit 1 or 2 (never 3, an internal error; 0 where the mutation left a
valid file), exactly one line on stderr, no traceback, no new file beside the inputs, and the
inputs unchanged. Hypothesis drives the mutations, derandomized and bounded, so a run is the same
every time and takes about a minute.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, get_args

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURE, invoke, one_error_line
from convit_convert.bounds import BOUNDS, num
from convit_convert.cli import app

SETTINGS = settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


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
        one_error_line(r, r.exit_code)
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
        "predict": [f, str(FIXTURE.parent / "digits" / "1.png")],
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


@pytest.mark.slow
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
    check_outcome(r, run, before, allow_ok=False)  # nothing here can be drawn: never exit 0
    assert not (tmp_path / "curves.png").exists()


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


# issue 33: what a path, a file or a signal can do --------------------------------------------------
# Each test below failed on the code before issue 33's changes (the cause it names in a comment).

ROOT = Path(__file__).resolve().parent.parent
TINY = (
    "--data synthetic --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 "
    "--batch-size 32 --workers 0 --epochs 1 --warmup-epochs 0 --device cpu"
).split()


def refused(r, *fragments: str, code: int = 2) -> None:
    """Exit `code`, one error line holding every fragment, no traceback."""
    assert r.exit_code == code, (r.exit_code, r.output[-2000:])
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), r.stderr[-2000:]
    assert all(f in err[0] for f in fragments), (fragments, err[0])
    assert "Traceback" not in r.output


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-epoch phase-1 run (checkpoint-last.pt, metrics.csv, config.json, conv.safetensors)."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    r = invoke("train", "phase1", *TINY, "-o", out)
    assert r.exit_code == 0, r.output
    return out


def copy_run(run: Path, to: Path) -> Path:
    to.mkdir()
    for p in run.iterdir():
        if p.is_file() and p.name != ".cmhsa.lock":
            (to / p.name).write_bytes(p.read_bytes())
    return to


# unsafe writes


def test_a_symlinked_lock_is_never_followed(tmp_path: Path, tiny_run: Path) -> None:
    # was: the link's target truncated to the PID, exit 0
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".cmhsa.lock").symlink_to(victim)
    refused(invoke("train", "phase1", *TINY, "-o", run), ".cmhsa.lock", "symbolic link")
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in run.iterdir()) == [".cmhsa.lock"]


def special_files(folder: Path) -> dict[str, Path]:
    """A FIFO, a symbolic link and (as root) a character device, each with a model file's name."""
    made = {}
    fifo = folder / "fifo.safetensors"
    os.mkfifo(fifo)
    made["FIFO"] = fifo
    target = folder / "target.safetensors"
    target.write_bytes(b"kept")
    link = folder / "link.safetensors"
    link.symlink_to(target)
    made["symbolic link"] = link
    if os.geteuid() == 0:  # a null device of our own: never /dev/null itself
        dev = folder / "dev.safetensors"
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        made["device"] = dev
    return made


def test_an_output_that_is_a_device_fifo_or_link_is_refused_and_kept(tmp_path: Path) -> None:
    # was: `--report /dev/null` and `-o FIFO` replaced by regular files
    nodes = special_files(tmp_path)
    kinds = {p: os.lstat(p).st_mode for p in [*nodes.values(), tmp_path / "target.safetensors"]}
    for kind, node in nodes.items():
        out = tmp_path / "v.safetensors"
        for args in (["-o", node], ["-o", out, "--report", node]):
            refused(invoke("convert", FIXTURE, *args), str(node.name), kind)
            assert not out.exists()
        onnx_node = node.with_name(node.name.replace(".safetensors", ".onnx"))
        os.rename(node, onnx_node)
        refused(invoke("export", FIXTURE, "-o", onnx_node), kind)
        os.rename(onnx_node, node)
    assert {p: os.lstat(p).st_mode for p in kinds} == kinds
    assert (tmp_path / "target.safetensors").read_bytes() == b"kept"


def test_an_input_that_is_a_fifo_or_device_is_refused_without_blocking(tmp_path: Path) -> None:
    for kind, node in special_files(tmp_path).items():
        if kind != "symbolic link":  # a link to a model file is read as that file
            for args in (["inspect", node], ["verify", FIXTURE, node], ["eval", node, "--data", "digits"]):
                refused(invoke(*args), kind)


def test_a_run_folder_holding_another_run_is_refused_unless_overwrite(tmp_path: Path, tiny_run: Path) -> None:
    # was: `train phase1 -o DIR` silently replaced another run's conv.safetensors, metrics.csv, config.json
    run = copy_run(tiny_run, tmp_path / "run")
    (run / "checkpoint-last.pt").unlink()
    before = snapshot(run)
    refused(
        invoke("train", "phase1", *TINY, "--seed", "3", "-o", run), "another run's outputs", "--overwrite"
    )
    assert snapshot(run) == before
    r = invoke("train", "phase1", *TINY, "--seed", "3", "--overwrite", "-o", run)
    assert r.exit_code == 0, r.output
    assert json.loads((run / "config.json").read_text())["seed"] == 3


@pytest.mark.parametrize("command", ["train", "convert", "export", "attention"])
def test_an_empty_output_path_is_refused(tmp_path: Path, monkeypatch, command: str) -> None:
    # was: `train -o ""` trained into the current folder; `convert -o ""` an internal error (exit 3)
    monkeypatch.chdir(tmp_path)
    args = {
        "train": ["train", "phase1", *TINY],
        "convert": ["convert", FIXTURE],
        "export": ["export", FIXTURE],
        "attention": ["attention", FIXTURE, "--data", "digits"],
    }[command]
    for form in (["-o", ""], ["--output="]):
        refused(invoke(*args, *form), "is empty")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def attn_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("attn") / "vit.safetensors"
    assert invoke("convert", FIXTURE, "-o", out).exit_code == 0
    return out


def test_attention_writes_its_json_and_png_together_or_not_at_all(
    tmp_path: Path, attn_model: Path, monkeypatch
) -> None:
    # was: the JSON written, then the PNG failing (disk full): one without the other, or an empty folder
    import matplotlib.figure

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    out = tmp_path / "att"
    refused(invoke("attention", attn_model, "--data", "digits", "--images", "20", "-o", out), "No space left")
    assert not out.exists()
    out.mkdir()
    refused(invoke("attention", attn_model, "--data", "digits", "--images", "20", "-o", out), "No space left")
    assert list(out.iterdir()) == []


# what a file claims


def metadata_variant(folder: Path, config: str) -> Path:
    header, body = fixture_parts()
    header["__metadata__"]["cmhsa.config"] = config
    path = folder / "crafted.safetensors"
    path.write_bytes(pack(header, body))
    return path


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("nesting", "nests deeper"),
        ("digits", "not valid JSON"),
        ("zero", "img_size must be positive"),
        ("negative", "img_size must be positive"),
    ],
)
def test_a_config_no_parser_should_meet_is_bad_input(tmp_path: Path, name: str, fragment: str) -> None:
    # was: RecursionError and int-digits ValueError as internal errors; img_size 0 accepted (inspect exit 0)
    cfg = json.loads(fixture_parts()[0]["__metadata__"]["cmhsa.config"])
    text = {
        "nesting": "[" * 100_000 + "]" * 100_000,
        "digits": json.dumps(cfg).replace('"depth": 4', '"depth": ' + "9" * 5000),
        "zero": json.dumps({**cfg, "img_size": [0, 0]}),
        "negative": json.dumps({**cfg, "img_size": [-32, 32]}),
    }[name]
    bad = metadata_variant(tmp_path, text)
    for args in (["inspect", bad], ["convert", bad, "-o", tmp_path / "v.safetensors"]):
        refused(invoke(*args), fragment)


def test_a_file_claiming_a_huge_attention_model_builds_no_position_index_to_check_it() -> None:
    # was: a 450-byte file (image 256, P 4, depth 24) made inspect build every block's (4096, 4096)
    # index, 4.2 GB for 14 s, before saying "missing tensors"
    import torch

    from convit_convert.config import ViTConfig
    from convit_convert.io.checkpoint import expected_shapes
    from convit_convert.model import VisionTransformer

    cfg = ViTConfig.build(img_size=256, patch_size=4, in_chans=1, depth=24, kernel_size=3).with_attention(9)
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    assert all(b.attn.rel_pos_index.is_meta for b in model.blocks)
    assert len(expected_shapes(cfg)) > 24 * 10


def crafted_resume(tiny_run: Path, folder: Path, change: Any) -> Path:
    import torch

    run = copy_run(tiny_run, folder)
    saved = torch.load(run / "checkpoint-last.pt", weights_only=True)
    change(saved)
    torch.save(saved, run / "checkpoint-last.pt")
    return run


def _set_config(**values: Any) -> Any:
    return lambda s: s["config"].update(values)


def _exp_avg_shape(s: dict) -> None:
    import torch

    state = next(iter(s["optimizer"]["state"].values()))
    state["exp_avg"] = torch.zeros(3)


def _model_config(**values: Any) -> Any:
    return lambda s: s["model_config"].update(values)


RESUME_CASES = {
    # each was an internal error (exit 3), a silent skip, a runaway, or a skipped memory estimate
    "optimizer state shape": (_exp_avg_shape, "exp_avg"),
    "optimizer betas": (lambda s: s["optimizer"]["param_groups"][0].update(betas=(1.5, 0.9)), "betas"),
    "optimizer lr type": (lambda s: s["optimizer"]["param_groups"][0].update(lr="fast"), "lr"),
    "scheduler field": (lambda s: s["scheduler"].update(t_initial="x"), "scheduler.t_initial"),
    "scheduler keys": (lambda s: s["scheduler"].clear(), "scheduler"),
    "partial state": (lambda s: s.update(partial={"loss_sum": "x", "seconds": 0.0, "images": 0}), "partial"),
    "step past the epoch": (lambda s: s.update(step=10**9), "step 1000000000"),
    "seed": (_set_config(seed=2**40), "--seed must be"),
    "config betas": (_set_config(opt_betas=[0.9, 2.0]), "--opt-betas must be"),
    "epochs 10^12": (_set_config(epochs=10**12), "--epochs must be"),
    "img_size 0": (_model_config(img_size=[0, 0]), "img_size must be positive"),
    "model beyond memory": (
        _model_config(
            depth=1024, hidden_chans=4096, embed_dim=4096 * 16, mlp_hidden_dim=1 << 22, patch_embed="linear"
        ),
        "more than cmhsa loads",  # ViTConfig's cap on a config read from a file (before: "would need about")
    ),
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_every_value_a_resume_reads_is_checked_like_a_flag(tmp_path: Path, tiny_run: Path, case: str) -> None:
    change, fragment = RESUME_CASES[case]
    run = crafted_resume(tiny_run, tmp_path / "run", change)
    before = snapshot(run)
    r = invoke("train", "phase1", *TINY, "--epochs", "2", "--resume", "-o", run)
    refused(r, fragment)
    assert snapshot(run) == before


def test_a_stop_after_an_epoch_s_last_step_resumes(tmp_path: Path, tiny_run: Path) -> None:
    """The one step count past the last that is a real state: stopped after the epoch's last step,
    before its evaluation (the bound above must not refuse it)."""
    import torch

    steps = torch.load(tiny_run / "checkpoint-last.pt", weights_only=True)["global_step"]  # one epoch's
    run = crafted_resume(tiny_run, tmp_path / "run", lambda s: s.update(step=steps))
    r = invoke("train", "phase1", *TINY, "--epochs", "2", "--resume", "-o", run)
    assert r.exit_code == 0, r.output
    assert epochs_in(run) == [1, 2]


def epochs_in(run: Path) -> list[int]:
    return [int(line.split(",")[0]) for line in (run / "metrics.csv").read_text().splitlines()[1:]]


@pytest.mark.parametrize(
    ("content", "outcome"),
    [
        (b"epoch,val_loss,top1,attnX_share,attn99999999_gate,\xc3\xa9\n1,2,3,4,5,6\n2,1,4,5,6,7\n", 0),
        (b"epoch,val_loss,top1\n1,1e308,3\n2,-1e308,4\n", 2),
        (b"epoch,val_loss,top1\n1,inf,3\n2,nan,4\n", 2),
    ],
)
def test_plot_reads_only_its_columns_and_refuses_values_no_metric_takes(
    tmp_path: Path, content: bytes, outcome: int
) -> None:
    # was: odd column names (int('X')) and ±1e308 (matplotlib's overflow) as internal errors
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_bytes(content)
    r = invoke("plot", run, "-o", tmp_path / "c.png")
    if outcome:
        refused(r, "metrics.csv")
    else:
        assert r.exit_code == 0 and r.stderr == "", r.output


def test_plot_refuses_a_huge_metrics_file_without_reading_it(tmp_path: Path) -> None:
    # was: a 1 GB one-line metrics.csv read whole
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.csv", "wb") as f:
        f.truncate(2**30)  # sparse: no disk used
    refused(invoke("plot", run, "-o", tmp_path / "c.png"), "more than cmhsa reads")


# datasets: IDX files and image folders


def idx_bytes(dims: list[int], body: bytes, rank: int | None = None, magic: bytes = b"\0\0\x08") -> bytes:
    return (
        magic
        + bytes([len(dims) if rank is None else rank])
        + b"".join(d.to_bytes(4, "big") for d in dims)
        + body
    )


def fashion_folder(folder: Path, broken: str) -> Path:
    import gzip

    import numpy as np

    rng = np.random.default_rng(0)
    good = {
        "train-images-idx3-ubyte": idx_bytes(
            [20, 28, 28], rng.integers(0, 255, 20 * 784, dtype=np.uint8).tobytes()
        ),
        "train-labels-idx1-ubyte": idx_bytes([20], bytes(i % 10 for i in range(20))),
        "t10k-images-idx3-ubyte": idx_bytes(
            [10, 28, 28], rng.integers(0, 255, 10 * 784, dtype=np.uint8).tobytes()
        ),
        "t10k-labels-idx1-ubyte": idx_bytes([10], bytes(range(10))),
    }
    bad = {
        "rank": ("train-images-idx3-ubyte", idx_bytes([20 * 28 * 28], bytes(20 * 784))),
        "overflowing dims": ("train-images-idx3-ubyte", idx_bytes([2**31, 2**31, 2**31], b"")),
        "label shape": ("train-labels-idx1-ubyte", idx_bytes([20, 1], bytes(20))),
        "label values": ("train-labels-idx1-ubyte", idx_bytes([20], bytes([200] * 20))),
        "0x0 images": ("train-images-idx3-ubyte", idx_bytes([20, 0, 0], b"")),
        "truncated": ("train-images-idx3-ubyte", good["train-images-idx3-ubyte"][:1000]),
        "bomb": ("t10k-labels-idx1-ubyte", idx_bytes([10], bytes(range(10)) + bytes(300 * 2**20))),
    }
    name, data = bad.get(broken, (None, b""))
    for n, content in good.items():
        payload = gzip.compress(data if n == name else content, compresslevel=1)
        if broken == "truncated gzip" and n == "train-images-idx3-ubyte":
            payload = payload[: len(payload) // 2]
        (folder / (n + ".gz")).write_bytes(payload)
    return folder


@pytest.mark.parametrize(
    ("broken", "fragment"),
    [
        ("rank", "IDX rank 1, expected 3"),
        ("overflowing dims", "IDX dimensions"),
        ("label shape", "IDX rank 2"),
        ("label values", "label 200"),
        ("0x0 images", "at least 1"),
        ("truncated", "truncated"),
        ("truncated gzip", "truncated or corrupt gzip"),
        ("bomb", "holds more than"),
    ],
)
def test_malformed_idx_files_are_bad_input(tmp_path: Path, broken: str, fragment: str) -> None:
    # was: internal errors (reshape, prod overflow, 0x0 images), 'error: aborted' exit 1 (a truncated
    # gzip's EOFError became click's Abort), and a gzip bomb decompressed whole
    folder = fashion_folder(tmp_path, broken)
    refused(invoke("eval", FIXTURE, "--data", "fashion-mnist", "--data-dir", folder), fragment)


def image_corpus(root: Path, broken: str) -> Path:
    import struct
    import zlib

    from PIL import Image

    for split in ("train", "val"):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for i in range(3):
                Image.new("L", (32, 32), 40 * i).save(root / split / label / f"{i}.png")
    target = root / "val" / "a" / "x.png"
    good = (root / "val" / "a" / "0.png").read_bytes()
    if broken == "fifo":
        os.mkfifo(target)
    elif broken == "bomb":  # a valid PNG header claiming 60000x60000 pixels
        ihdr = struct.pack(">IIBBBBB", 60000, 60000, 8, 0, 0, 0, 0)
        chunk = b"IHDR" + ihdr
        target.write_bytes(
            b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
        )
    else:
        target.write_bytes(
            {"undecodable": b"not an image at all", "empty": b"", "truncated": good[: len(good) // 2]}[broken]
        )
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    ("broken", "loader"),
    [
        ("undecodable", "device"),
        ("empty", "device"),
        ("truncated", "device"),
        ("bomb", "device"),
        ("fifo", "device"),
        ("truncated", "workers"),
    ],
)
def test_a_bad_image_in_an_image_folder_is_one_line_never_a_hang(
    tmp_path: Path, broken: str, loader: str
) -> None:
    # was: internal errors from PIL, a decompression bomb decoded, a FIFO named x.png hanging eval and train
    root = image_corpus(tmp_path / "images", broken)
    args = [
        *"train phase1 --data imagefolder --data-dir".split(),
        root,
        *"--img-size 32 --in-chans 1 --hidden-chans 1 --patch-size 4 --depth 1 "
        "--kernel-size 3 --batch-size 4 --epochs 1 --warmup-epochs 0 --device "
        "cpu --loader".split(),
        loader,
        "--workers",
        "1" if loader == "workers" else "0",
        "-o",
        tmp_path / "run",
    ]
    if loader == "device":  # read in this process, before any training: no worker, no hang to fear
        refused(invoke(*args), "x.png", "FIFO" if broken == "fifo" else "")
        return
    p = subprocess.run(
        [sys.executable, "-m", "convit_convert", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    one_error_line(p, 2, "x.png")


# the terminal, the locale and signals


def test_an_ascii_locale_prints_escapes_never_crashes(tmp_path: Path) -> None:
    # was: UnicodeEncodeError on ≥ or Δ after the outputs were written (exit 3)
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "COLUMNS": "100"}
    for args in (["inspect", FIXTURE], ["convert", FIXTURE, "-o", tmp_path / "v.safetensors"]):
        p = subprocess.run(
            [sys.executable, "-m", "convit_convert", *map(str, args)],
            capture_output=True,
            cwd=ROOT,
            env=env,
            timeout=240,
        )
        assert p.returncode == 0 and p.stderr == b"", p.stderr[-2000:]
        assert b"\\u0394" in p.stdout or b"\\u2265" in p.stdout


def test_escape_sequences_in_paths_never_reach_the_terminal(tmp_path: Path, tiny_run: Path) -> None:
    # was: `-o $'run\e]0;X\a'` and plot's run folders printed raw
    evil = tmp_path / "run\x1b]0;X\x07"
    r = invoke("train", "phase1", *TINY, "-o", evil)
    assert r.exit_code == 0 and "\x1b" not in r.output and "\\x1b]0;X\\x07" in r.output, r.output
    r = invoke("plot", evil, tiny_run)
    assert r.exit_code == 0 and "\x1b" not in r.output and r.stderr == "", r.output


def test_library_warnings_reach_the_terminal_only_with_debug() -> None:
    # was: torch's and matplotlib's warnings printed on a successful run; and (issue 48) torch's log
    # records, such as `--compile --device cpu`'s "W1126 ... No CUDA runtime is found, using
    # CUDA_HOME=...". A subprocess: pytest records warnings itself, which would hide them from a
    # CliRunner's stderr
    program = (
        "import logging, sys, warnings\n"
        "import convit_convert.api as api\n"
        "real = api.inspect_file\n"
        "def noisy(*a, **k):\n"
        '    warnings.warn("a library\'s warning", UserWarning, stacklevel=1)\n'
        "    logging.getLogger('torch.utils.cpp_extension').warning('No CUDA runtime is found')\n"
        "    return real(*a, **k)\n"
        "api.inspect_file = noisy\n"
        "from convit_convert.cli import main\n"
        "sys.argv = ['cmhsa', *sys.argv[1:]]\n"
        "main()\n"
    )
    for debug in ([], ["--debug"]):
        p = subprocess.run(
            [sys.executable, "-c", program, *debug, "inspect", str(FIXTURE)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=240,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        assert ("a library's warning" in p.stderr) == bool(debug), p.stderr[-2000:]
        assert ("No CUDA runtime is found" in p.stderr) == bool(debug), p.stderr[-2000:]


def test_help_shows_every_range_on_every_command() -> None:
    # was: `[range: …]` only in train's help
    missing = []
    for path, cmd in commands():
        text = invoke([*path, "--help"], env={"COLUMNS": "500"}).stdout
        for p in cmd.params:  # type: ignore[attr-defined]
            if (
                p.name in BOUNDS
                and p.opts[0].startswith("--")
                and f"[range: {BOUNDS[p.name].text()}]" not in " ".join(text.split())
            ):
                missing.append(f"{' '.join(path)} {p.opts[0]}")
    assert missing == []


def signalled_training(tmp_path: Path, sig: int, after: str) -> tuple[int, str, Path]:
    """`cmhsa train` with loader workers, in its own process group, sent `sig` (to the whole group,
    as Ctrl-C in a terminal does) once its output shows `after`."""
    out = tmp_path / f"run-{sig}-{after.split()[0]}"
    args = [
        *"train phase1 --data digits --img-size 16 --in-chans 1 --hidden-chans 1 "
        "--patch-size 4 --depth 1 --kernel-size 3 --batch-size 16 --epochs 3 "
        "--warmup-epochs 0 --device cpu --loader workers --workers 2 --log-every "
        "5 -o".split(),
        str(out),
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "convit_convert", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        start_new_session=True,
        text=True,
    )
    assert p.stdout is not None and p.stderr is not None
    for line in p.stdout:
        if after in line:
            os.killpg(p.pid, sig)
            break
    rest = p.communicate(timeout=240)
    return p.returncode, rest[1], out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "after"),
    [
        (signal.SIGTERM, "step 10/"),
        (signal.SIGTERM, "epoch 1/3 "),
        (signal.SIGTERM, "wrote"),
        (signal.SIGINT, "step 10/"),
        (signal.SIGINT, "wrote"),
    ],
)
def test_a_signal_to_the_process_group_is_an_interruption(tmp_path: Path, sig: int, after: str) -> None:
    # was: loader workers killed by a SIGTERM made the loader raise: an internal error (exit 3) mid-epoch,
    # a traceback between epochs; a signal while the finished run's workers shut down printed a
    # traceback or killed the process (-15, -2)
    code, err, out = signalled_training(tmp_path, sig, after)
    assert "Traceback" not in err and "internal error" not in err, err[-2000:]
    if after != "wrote":  # mid-run: saved and stopped, resumable
        assert code == 128 + sig and (out / "checkpoint-last.pt").is_file(), (code, err[-2000:])
    else:  # the run was done: it exits 0, or with the signal's code, never killed by it
        assert code in (0, 128 + sig), (code, err[-2000:])
        assert (out / "conv.safetensors").is_file()


# errors that name the right fix (issue 34, in part) -----------------------------------------------


def test_errors_name_the_fix_the_command_can_take(tmp_path: Path, tiny_run: Path, monkeypatch) -> None:
    """Each message used to name a fix the command does not take: --out (train's hidden old
    spelling), --img-size/--patch-size for eval, --data cifar100 (train's hidden default)."""
    r = invoke("eval", tiny_run / "checkpoint-last.pt", "--data", "digits")
    refused(r, "training checkpoint", "conv.safetensors", "--resume")
    assert "--img-size" not in r.stderr
    (tmp_path / "file").write_text("x")
    refused(invoke("train", "phase1", *TINY, "-o", tmp_path / "file"), "-o/--output")
    monkeypatch.chdir(tmp_path)
    no_data = [a for a in TINY if a not in ("--data", "synthetic")]
    r = invoke("train", "phase1", *no_data, "-o", tmp_path / "run")
    refused(r, "--data not given", "cifar100", "--data-dir")
    assert not (tmp_path / "run").exists()


def test_an_approximate_conversion_that_fails_its_check_says_which_tol_writes_it(tmp_path: Path) -> None:
    from convit_convert.cli.convert import rounded_up

    for x in (0.2234, 0.22, 0.0999, 3.98e-7, 1.0, 12345.0):  # never below the error it must pass
        assert x <= float(rounded_up(x)) <= x * 1.1, x
    r = invoke(
        "convert",
        FIXTURE,
        "-o",
        tmp_path / "a.safetensors",
        *"--heads 4 --approximate --calib-images 16 --heldout-images 16".split(),
    )
    assert r.exit_code == 1 and "pass --tol" in " ".join(r.stdout.split()), r.output
    tol = re.search(r"pass --tol (\S+)", " ".join(r.stdout.split())).group(1)  # type: ignore[union-attr]
    r = invoke(
        "convert",
        FIXTURE,
        "-o",
        tmp_path / "a.safetensors",
        *"--heads 4 --approximate --calib-images 16 --heldout-images 16 --tol".split(),
        tol,
    )
    assert r.exit_code == 0 and (tmp_path / "a.safetensors").is_file(), r.output


# issue 40: nothing lost by --overwrite, no internal error from a path, a stream or a flag's edge ----
# Each test below failed on main 0f89488 (the case it names in its comment).

# cmhsa with os.replace wrapped: the KILL_AT-th rename of a temp file first sends KILL_SIG to the
# process itself (as `strace -e inject=rename:signal=...` would), deterministically mid-commit
AT_RENAME = """
import os, sys
real = os.replace
calls = [0]
def replace(src, dst, *a, **k):
    if str(src).endswith(".tmp"):
        calls[0] += 1
        if calls[0] == int(os.environ["KILL_AT"]):
            os.kill(os.getpid(), int(os.environ["KILL_SIG"]))
    return real(src, dst, *a, **k)
os.replace = replace
from convit_convert.cli import main
sys.argv = ["cmhsa", *sys.argv[1:]]
main()
"""


def cmhsa_signalled_at_rename(args: list[object], at: int, sig: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILL_AT": str(at), "KILL_SIG": str(int(sig))}
    return subprocess.run(
        [sys.executable, "-c", AT_RENAME, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def pair_is_one_write(model: Path, report: Path) -> bool:
    """The report describes the model beside it (it records the model's sha256)."""
    return (
        json.loads(report.read_text())["output"]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    )


def leftovers(folder: Path) -> list[str]:
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name.endswith((".tmp", ".json", ".part")) and p.name.startswith(".")
    )


def test_convert_killed_between_its_two_renames_is_completed_by_the_next_command(tmp_path: Path) -> None:
    # was: the new model beside the previous report, and a temp file, for good
    out, report = tmp_path / "vit.safetensors", tmp_path / "vit.report.json"
    assert invoke("convert", FIXTURE, "-o", out, "--heads", "10").exit_code == 0
    old_report = report.read_bytes()
    r = cmhsa_signalled_at_rename(["convert", FIXTURE, "-o", out], 2, signal.SIGKILL)
    assert r.returncode == -signal.SIGKILL
    assert report.read_bytes() == old_report and not pair_is_one_write(out, report)  # mid-commit
    # a reader never renames: it refuses the half-committed file, naming what finishes it
    refused(invoke("inspect", out), "was cut short", "running again the cmhsa command")
    assert report.read_bytes() == old_report
    # any command writing into the folder rolls the commit forward first
    assert invoke("convert", FIXTURE, "-o", tmp_path / "other.safetensors").exit_code == 0
    assert pair_is_one_write(out, report) and leftovers(tmp_path) == []
    assert invoke("inspect", out).exit_code == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_at_a_pair_s_first_rename_is_taken_after_the_pair(tmp_path: Path, sig: int) -> None:
    # was: exit 143/130 with the new model beside the previous report
    out, report = tmp_path / "vit.safetensors", tmp_path / "vit.report.json"
    assert invoke("convert", FIXTURE, "-o", out, "--heads", "10").exit_code == 0
    r = cmhsa_signalled_at_rename(["convert", FIXTURE, "-o", out], 1, sig)
    assert r.returncode == 128 + sig, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert pair_is_one_write(out, report) and leftovers(tmp_path) == []
    assert json.loads(report.read_text())["conversion"]["heads"] == 9  # the new pair, whole


@pytest.mark.slow
def test_training_killed_between_checkpoint_and_metrics_resumes_with_every_row(tmp_path: Path) -> None:
    # was: 2 rows in checkpoint-last.pt, 1 in metrics.csv, and `--resume` exited 0 without the row
    out = tmp_path / "run"
    args = ["train", "phase1", *TINY, "--epochs", "2", "-o", out]
    r = cmhsa_signalled_at_rename(args, 2, signal.SIGKILL)  # epoch 1's save: 3 renames; epoch 2's: 4 to 6
    assert r.returncode == -signal.SIGKILL
    r = cmhsa_signalled_at_rename(
        ["train", "phase1", *TINY, "--epochs", "2", "--resume", "-o", out], 5, signal.SIGKILL
    )
    assert r.returncode == -signal.SIGKILL
    r = invoke("train", "phase1", *TINY, "--epochs", "2", "--resume", "-o", out)
    assert r.exit_code == 0, r.output
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1].startswith("1,") and rows[2].startswith("2,"), rows
    assert json.loads((out / "config.json").read_text())["epochs"] == 2
    assert leftovers(out) == []


def test_overwrite_keeps_the_previous_run_until_the_new_one_saves(tmp_path: Path, tiny_run: Path) -> None:
    # was: the previous run removed, then the new one refused (exit 2): everything lost
    run = copy_run(tiny_run, tmp_path / "run")
    before = snapshot(run)
    for bad in (["--data", "fashion-mnist", "--data-dir", tmp_path / "none"], ["--train-samples", "100000"]):
        refused(invoke("train", "phase1", *TINY, *bad, "--overwrite", "-o", run))
        assert snapshot(run) == before, bad
    r = invoke("train", "phase1", *TINY, "--seed", "3", "--overwrite", "-o", run)
    assert r.exit_code == 0, r.output
    assert json.loads((run / "config.json").read_text())["seed"] == 3


def test_overwrite_never_removes_the_file_init_starts_from(tmp_path: Path, tiny_run: Path) -> None:
    # was: `phase2 --init RUN/conv.safetensors -o RUN --overwrite` deleted it, then "no such file"
    run = copy_run(tiny_run, tmp_path / "run")
    conv = (run / "conv.safetensors").read_bytes()
    r = invoke("train", "phase2", *TINY, "--init", run / "conv.safetensors", "--overwrite", "-o", run)
    assert r.exit_code == 0, r.output
    assert (run / "conv.safetensors").read_bytes() == conv and (run / "vit.safetensors").is_file()


def test_a_failed_save_on_resume_changes_no_file(tmp_path: Path, tiny_run: Path, monkeypatch) -> None:
    # was: a full disk during `--resume` left config.json changed though the error said it was kept
    import torch

    run = copy_run(tiny_run, tmp_path / "run")
    before = snapshot(run)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    refused(
        invoke("train", "phase1", *TINY, "--epochs", "2", "--resume", "--threads", "1", "-o", run),
        "No space left",
    )
    assert snapshot(run) == before


def test_a_refused_command_leaves_no_folder_it_made(tmp_path: Path, attn_model: Path, monkeypatch) -> None:
    # was: n1/n2 left by `-o n1/n2/run` with a bad --data-dir, nope/deeper by a --resume with nothing
    # to resume, x/y by `attention -o x/y/att` on a full disk
    monkeypatch.chdir(tmp_path)
    refused(
        invoke("train", "phase1", *TINY, "--data", "fashion-mnist", "--data-dir", "none", "-o", "n1/n2/run")
    )
    refused(invoke("train", "phase1", *TINY, "--resume", "-o", "nope/deeper/run"), "no checkpoint")
    import matplotlib.figure

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    refused(
        invoke("attention", attn_model, "--data", "digits", "--images", "20", "-o", "x/y/att"), "No space"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_symlink_loop_anywhere_is_bad_input(tmp_path: Path, attn_model: Path) -> None:
    # was: `internal error: RuntimeError: Symlink loop from ...` (exit 3) for -o and --report
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop.name)
    onnx_loop = tmp_path / "loop.onnx"
    onnx_loop.symlink_to(onnx_loop.name)
    ok = tmp_path / "ok.safetensors"
    for args in (
        ["inspect", loop],
        ["verify", FIXTURE, loop],
        ["convert", loop, "-o", ok],
        ["convert", FIXTURE, "-o", loop],
        ["convert", FIXTURE, "-o", ok, "--report", loop],
        ["verify", FIXTURE, attn_model, "--report", loop],
        ["export", attn_model, "-o", onnx_loop],
        ["export", attn_model, "-o", tmp_path / "ok.onnx", "--report", loop],
    ):
        refused(invoke(*args))
    assert not ok.exists() and not (tmp_path / "ok.onnx").exists()


@pytest.mark.slow
def test_a_closed_or_broken_stdout_never_fails_finished_work(tmp_path: Path, attn_model: Path) -> None:
    # was: `export ... >&-`: AttributeError (exit 3); `convert ... | head -c1`: exit 1 with both written.
    # A closed stdout is now said (exit 2, issue 48), but the files written stay written, whole
    cmd = [sys.executable, "-m", "convit_convert"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "vit.onnx"
    p = subprocess.run(
        ["bash", "-c", '"$@" >&-', "_", *cmd, "export", str(attn_model), "-o", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 2 and out.is_file() and (tmp_path / "vit.onnx.report.json").is_file()
    assert p.stderr.strip() == "error: cannot write the output to standard output (it is closed)", p.stderr
    target = tmp_path / "v.safetensors"
    p = subprocess.run(
        [
            "bash",
            "-c",
            '"$@" | head -c1; exit "${PIPESTATUS[0]}"',
            "_",
            *cmd,
            "convert",
            str(FIXTURE),
            "-o",
            str(target),
        ],
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert p.returncode == 0 and target.is_file() and b"Traceback" not in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("redirect", "command", "why"),
    [
        ("> /dev/full", ["inspect", FIXTURE], "No space left on device"),
        ("> /dev/full", ["verify", FIXTURE, "ATTN"], "No space left on device"),
        (">&-", ["inspect", FIXTURE], "it is closed"),
        ("| head -c1", ["inspect", FIXTURE], None),
    ],
)
def test_a_report_that_cannot_be_written_is_an_error(
    attn_model: Path, redirect: str, command: list, why: str | None
) -> None:
    # was: exit 0 with nothing written for /dev/full and >&-: `cmhsa inspect X > report.txt` on a full
    # disk gave an empty file and success. A reader that went away (| head) still ends quietly
    args = [str(attn_model) if a == "ATTN" else str(a) for a in command]
    p = subprocess.run(
        [
            "bash",
            "-c",
            f'"$@" {redirect}; exit "${{PIPESTATUS[0]}}"',
            "_",
            sys.executable,
            "-m",
            "convit_convert",
            *args,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if why is None:
        assert p.returncode == 0 and p.stderr == "", p.stderr
    else:
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert p.stderr.strip() == f"error: cannot write the output to standard output ({why})", p.stderr


def test_a_name_as_long_as_the_folder_allows_is_written(tmp_path: Path) -> None:
    # was: a legal 236-250 character name failed after all the work: "File name too long" (the temp name)
    out = tmp_path / ("v" * 235 + ".safetensors")
    r = invoke("convert", FIXTURE, "-o", out, "--report", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    assert out.is_file() and leftovers(tmp_path) == []
    refused(
        invoke("convert", FIXTURE, "-o", tmp_path / ("v" * 250 + ".safetensors")),
        "File name too long",
    )


def test_edges_of_flags_and_arguments_are_one_line(
    tmp_path: Path, tiny_run: Path, attn_model: Path, monkeypatch
) -> None:
    # was: plot RUN RUN: ValueError (zip); --opt adahessian: "does not require grad"; --aa rand-n1000000
    # ran past 10 minutes; --crop-pct 1e-300: OverflowError in a worker; a failed download: URLError
    refused(invoke("plot", tiny_run, tiny_run, "-o", tmp_path / "c.png"), "given twice")
    refused(invoke("train", "phase1", *TINY, "--opt", "adahessian", "-o", tmp_path / "a"), "second-order")
    refused(invoke("train", "phase1", *TINY, "--aa", "rand-n1000000-m9", "-o", tmp_path / "b"), "n must be")
    refused(invoke("eval", attn_model, "--data", "digits", "--crop-pct", "1e-300"), "--crop-pct must be")
    import urllib.error
    import urllib.request

    def offline(*a, **k):  # no network: what urllib says then
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    r = invoke("eval", attn_model, "--data", "cifar10", "--data-dir", tmp_path / "dl" / "c10", "--download")
    refused(r, "cannot download cifar10 from https://", "--data-dir")
    assert not (tmp_path / "dl").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_run_resumes_on_a_machine_with_fewer_cores(tmp_path: Path, tiny_run: Path) -> None:
    # was: `--threads must be 1 <= x <= 8, got 16` (exit 2) on a 2-core machine, whatever --threads said
    import torch

    run = copy_run(tiny_run, tmp_path / "run")
    saved = torch.load(run / "checkpoint-last.pt", weights_only=True)
    assert {"threads", "cpu_capability", "torch", "timm", "device"} <= set(saved["environments"][0])
    saved["config"]["threads"] = 10_000
    saved["environments"][0]["threads"] = 10_000
    torch.save(saved, run / "checkpoint-last.pt")
    r = invoke(
        "train", "phase1", *TINY, "--epochs", "2", "--resume", "--threads", "1", "--deterministic", "-o", run
    )
    refused(r, "--deterministic", "threads 10000 -> 1")
    r = invoke("train", "phase1", *TINY, "--epochs", "2", "--resume", "--threads", "1", "-o", run)
    assert r.exit_code == 0, r.output
    assert "resuming in another environment (threads 10000 -> 1" in r.output
    envs = json.loads((run / "config.json").read_text())["environments"]
    assert [(e["epoch"], e["threads"]) for e in envs] == [(0, 10_000), (1, 1)]


def test_a_counter_no_run_reaches_is_refused_on_resume(tmp_path: Path, tiny_run: Path) -> None:
    # was: a global_step of 10^30 accepted
    import torch

    run = copy_run(tiny_run, tmp_path / "run")
    saved = torch.load(run / "checkpoint-last.pt", weights_only=True)
    for value, fragment in ((10**30, "beyond any run's"), (10**6, "global step 1000000")):
        saved["global_step"] = value
        torch.save(saved, run / "checkpoint-last.pt")
        refused(invoke("train", "phase1", *TINY, "--epochs", "2", "--resume", "-o", run), fragment)


def test_a_huge_conversion_is_sized_before_it_is_made(tmp_path: Path, monkeypatch) -> None:
    # was: `train phase2 --init conv --heads 4096` converted and verified the model (3.6 GB, 36 s) first
    from convit_convert.train import phases

    def never(*a, **k):
        raise AssertionError("converted before the memory estimate")

    monkeypatch.setattr(phases, "convert_checkpoint", never)
    for flag in (["--heads", "4096"], ["--qk-dim", "65536"]):
        r = invoke("train", "phase2", "--data", "digits", "--init", FIXTURE, *flag, "-o", tmp_path / "r")
        refused(r, "would need about")


def onnx_file(path: Path, nodes: list, inits: list, functions: tuple = ()) -> Path:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], functions=list(functions))
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def test_onnx_runaways_are_refused_before_onnxruntime_runs_them(tmp_path: Path) -> None:
    # was: a 171-byte Expand to (30000, 30000) took 4.3 GB in `inspect`; a Loop of 10^12 trips ran
    # for 11+ minutes, deaf to SIGTERM and SIGINT
    from onnx import TensorProto, helper

    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [30_000, 30_000])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    expand = onnx_file(
        tmp_path / "expand.onnx",
        [
            helper.make_node("Expand", ["one", "shape"], ["big"]),
            helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"]),
        ],
        [shape, one],
    )
    v = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("Identity", ["v"], ["v2"])],
        "body",
        [
            v("i", TensorProto.INT64, []),
            v("c", TensorProto.BOOL, []),
            v("v", TensorProto.FLOAT, [1, 3, 8, 8]),
        ],
        [v("c2", TensorProto.BOOL, []), v("v2", TensorProto.FLOAT, [1, 3, 8, 8])],
    )
    trips = helper.make_tensor("trips", TensorProto.INT64, [], [10**12])
    cond = helper.make_tensor("cond", TensorProto.BOOL, [], [True])
    loop = onnx_file(
        tmp_path / "loop.onnx",
        [helper.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body)],
        [trips, cond],
    )
    for path, fragment in ((expand, "900,000,000 elements"), (loop, "Loop with a subgraph")):
        for command in (["inspect", path], ["convert", path, "-o", tmp_path / "o.safetensors"]):
            refused(invoke(*command), fragment)


def test_run_session_stops_onnxruntime_at_its_deadline(tmp_path: Path) -> None:
    """The time bound and the stop: onnxruntime is told to terminate, from the waiting thread."""
    import numpy as np
    from onnx import TensorProto, helper

    from convit_convert.errors import CmhsaError
    from convit_convert.onnx.load import ort_session, run_session

    # 200 products of a 2048 x 2048 input (about 30 s on one thread); from an input, not an
    # initializer, so onnxruntime cannot fold them into constants while it builds the session
    n = 2048
    nodes = [helper.make_node("MatMul", ["x", "x"], [f"m{i}"]) for i in range(200)]
    outputs = [helper.make_tensor_value_info(f"m{i}", TensorProto.FLOAT, [n, n]) for i in range(200)]
    graph = helper.make_graph(
        nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, n])], outputs
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort_session(model, tmp_path / "slow.onnx", threads=1)
    with pytest.raises(CmhsaError, match=r"more than 0\.5 s"):
        run_session(session, None, {"x": np.ones((n, n), np.float32)}, tmp_path / "slow.onnx", seconds=0.5)


def test_onnx_external_data_in_every_part_of_a_model_is_checked(tmp_path: Path) -> None:
    # was: a Constant's sparse_value and a local function's tensors were not checked, and
    # onnxruntime opened secret.txt in the working directory
    import onnx
    from onnx import TensorProto, helper

    (tmp_path / "secret.txt").write_text("secret\n")

    def external(name: str) -> onnx.TensorProto:
        t = helper.make_tensor(name, TensorProto.FLOAT, [1], [0.0])
        del t.float_data[:]
        t.data_location = TensorProto.EXTERNAL
        e = t.external_data.add()
        e.key, e.value = "location", "../secret.txt"
        return t

    sparse = helper.make_sparse_tensor(
        external("v"), helper.make_tensor("i", TensorProto.INT64, [1], [0]), [4]
    )
    constant = helper.make_node("Constant", [], ["k"], sparse_value=sparse)
    a = onnx_file(tmp_path / "m" / "sparse.onnx", [constant, helper.make_node("Identity", ["x"], ["y"])], [])
    inner = helper.make_node("Constant", [], ["k"], value=external("w"))
    function = helper.make_function(
        "local",
        "F",
        ["a"],
        ["b"],
        [inner, helper.make_node("Identity", ["a"], ["b"])],
        [helper.make_opsetid("", 17)],
    )
    b = onnx_file(
        tmp_path / "m" / "function.onnx",
        [helper.make_node("F", ["x"], ["y"], domain="local")],
        [],
        (function,),
    )
    for path in (a, b):
        refused(invoke("inspect", path), "leaves the model's folder")


def test_onnxruntime_s_own_log_lines_never_reach_stderr(tmp_path: Path) -> None:
    # was: a graph listing an initializer as an input printed onnxruntime's colour-escaped warning
    code = (
        "from onnx import helper as h, TensorProto as T\n"
        "from pathlib import Path\n"
        "from convit_convert.onnx.load import ort_session\n"
        "w = h.make_tensor('w', T.FLOAT, [1], [2.0])\n"
        "g = h.make_graph([h.make_node('Mul', ['x', 'w'], ['y'])], 'g', "
        "[h.make_tensor_value_info('x', T.FLOAT, [1]),\n"
        "    h.make_tensor_value_info('w', T.FLOAT, [1])], "
        "[h.make_tensor_value_info('y', T.FLOAT, [1])], [w])\n"
        "m = h.make_model(g, opset_imports=[h.make_opsetid('', 17)])\n"
        "m.ir_version = 8\n"
        "ort_session(m, Path('x.onnx'))\n"
        "import onnxruntime\n"
        "onnxruntime.InferenceSession(m.SerializeToString(), providers=['CPUExecutionProvider'])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]


def test_private_attributes_cmhsa_uses_are_guarded(tmp_path: Path, monkeypatch) -> None:
    # was: `from typer._click.core import Context` (typer 0.12 to 0.20: ModuleNotFoundError for every
    # command, --help included); atexit._run_exitfuncs and torch's _SIGCHLD_handler_set unguarded
    code = (
        "import atexit, sys\ndel atexit._run_exitfuncs\nfrom convit_convert.cli import main\n"
        "sys.argv = ['cmhsa', 'heads', '--kernel-size', '3', '--patch-size', '2']\nmain()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    from torch.utils.data._utils import signal_handling

    from convit_convert.train.run import worker_deaths_at_fetch

    monkeypatch.delattr(signal_handling, "_SIGCHLD_handler_set")
    with worker_deaths_at_fetch():
        pass
    for f in [*(ROOT / "convit_convert").rglob("*.py"), *(ROOT / "train").rglob("*.py")]:
        text = f.read_text()
        assert not re.search(r"typer\._|^\s*(from|import) click\b", text, re.M), f
    assert private_accesses() == GUARDED, "a private name of another library, not in GUARDED"


# Every private name of another library cmhsa touches, and how a release without it is survived
GUARDED = {
    ("cli/__init__.py", "getattr(atexit, '_run_exitfuncs', None)"): "getattr: skipped when absent",
    ("cli/options.py", "param._usage_display_name"): "set only where callable(getattr(...)) finds it",
    ("cli/options.py", "getattr(param, '_usage_display_name', None)"): "that getattr",
    ("train/run.py", "from torch.utils.data._utils"): "imported in a try: ImportError skips the marking",
    ("train/run.py", "getattr(signal_handling, '_SIGCHLD_handler_set', None)"): "getattr, tested above",
    ("train/run.py", "signal_handling._SIGCHLD_handler_set"): "written only after the getattr found it",
    ("train/step.py", "torch._dynamo"): "config.patch, for one compiled call (step.with_autograd_traced)",
    ("timm.py", "from timm.models._builder"): "imported in _features: features_only alone needs it",
    ("timm.py", "from timm.models._features"): "likewise",
    ("timm.py", "from timm.models import _factory, _hub"): (
        "imported in a try; each loader wrapped only where getattr finds it callable (_create checks "
        "what reaches it either way: test_timm_folder_input.py)"
    ),
}


def private_accesses() -> dict[tuple[str, str], str]:
    """(file, source) of each use of a leading-underscore name of another object than self/cls: an
    attribute, a module imported from, or a getattr/hasattr string."""
    found = {}
    for folder, prefix in ((ROOT / "convit_convert", ""), (ROOT / "train", "train/")):
        for f in folder.rglob("*.py"):
            name = prefix + str(f.relative_to(folder))
            for n in ast.walk(ast.parse(f.read_text())):
                text = None
                if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                    root = n.value
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if not (isinstance(root, ast.Name) and root.id in ("self", "cls", "os")):
                        text = ast.unparse(n)  # os._exit: public, documented
                elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module != "__future__":
                    if any(part.startswith("_") for part in (n.module or "").split(".")):
                        text = f"from {n.module}"
                    elif any(a.name.startswith("_") for a in n.names):  # from timm.models import _hub
                        text = f"from {n.module} import {', '.join(a.name for a in n.names)}"
                elif isinstance(n, ast.Call) and getattr(n.func, "id", "") in (
                    "getattr",
                    "hasattr",
                    "setattr",
                ):
                    key = n.args[1] if len(n.args) > 1 else None
                    if isinstance(key, ast.Constant) and str(key.value).startswith("_"):
                        text = ast.unparse(n)
                if text is not None and not text.startswith("callable(") and "__" not in text:
                    found[(name, text)] = GUARDED.get((name, text), "unguarded")
    return found


@pytest.mark.parametrize("kind", ["ENOTDIR", "ELOOP", "ENAMETOOLONG"])
def test_every_os_error_of_a_path_is_bad_input(tmp_path: Path, attn_model: Path, kind: str) -> None:
    # was: a symlink loop gave exit 3 (RuntimeError from pathlib); every path error is exit 2, one line
    (tmp_path / "afile").write_text("x")
    (tmp_path / "loop").symlink_to("loop")
    base = {
        "ENOTDIR": tmp_path / "afile" / "x",
        "ELOOP": tmp_path / "loop" / "x",
        "ENAMETOOLONG": tmp_path / ("d" * 300) / "x",
    }[kind]
    before = snapshot(tmp_path)
    for args in (
        ["convert", FIXTURE, "-o", f"{base}.safetensors"],
        ["convert", FIXTURE, "-o", tmp_path / "o.safetensors", "--report", f"{base}.json"],
        ["verify", FIXTURE, attn_model, "--report", f"{base}.json"],
        ["export", attn_model, "-o", f"{base}.onnx"],
        ["inspect", f"{base}.safetensors"],
        ["verify", FIXTURE, f"{base}.safetensors"],
        ["eval", f"{base}.safetensors", "--data", "digits"],
        ["plot", base],
        ["attention", attn_model, "--data", "digits", "--images", "10", "-o", base],
        ["train", "phase1", *TINY, "-o", base],
        ["train", "phase2", *TINY, "--init", f"{base}.safetensors", "-o", tmp_path / "r"],
        ["eval", attn_model, "--data", "imagefolder", "--data-dir", base],
    ):
        refused(invoke(*args))
    assert snapshot(tmp_path) == before


# issue 48: files from elsewhere ------------------------------------------------------------------
# Each test below failed on main 939d132 (the behaviour it names in a comment).


def dead_pids(n: int) -> list[int]:
    """Process numbers of processes that have exited (each reaped, so not running)."""
    pids = []
    for _ in range(n):
        p = subprocess.Popen(["true"])
        p.wait()
        pids.append(p.pid)
    return pids


JOURNAL_KINDS = (
    "absolute pair",
    "relative pair",
    "dot-dot pair",
    "not a temp",
    "linked temp",
    "foreign temp",
    "foreign journal",
    "link to /dev/zero",
    "FIFO",
    "folder",
    "huge PID",
    "deep nesting",
    "too deep within the size",
    "millions of pairs",
    "old format",
)


def plant_journal(folder: Path, kind: str, pid: int, victim: Path) -> Path:
    """A `.cmhsa-commit.*.json` in `folder` that cmhsa did not write, of `kind`, aimed at `victim` (a
    file outside `folder`) or at the model files beside it; its path."""
    journal = folder / f".cmhsa-commit.{pid}.json"
    temp = f".m.safetensors.{pid}.abcdefgh.tmp"
    payload = folder / "payload"
    payload.write_bytes(b"ATTACKER\n")

    def write(doc: object) -> Path:
        journal.write_text(json.dumps(doc))
        return journal

    if kind == "absolute pair":
        return write({"pairs": [[str(payload), str(victim)]]})
    if kind == "relative pair":
        return write({"pairs": [["payload", os.path.relpath(victim, folder)]]})
    if kind == "dot-dot pair":
        return write({"pairs": [["payload", ".."]]})
    if kind == "not a temp":
        return write({"pairs": [["payload", "m.safetensors"]]})
    if kind == "linked temp":
        (folder / temp).symlink_to(victim)
        return write({"pairs": [[temp, "m.safetensors"]]})
    if kind == "foreign temp":  # a valid pair, but another user's temp (cmhsa runs as this user)
        (folder / temp).write_bytes(b"ATTACKER\n")
        os.chown(folder / temp, 4242, 4242)
        return write({"pairs": [[temp, "m.safetensors"]]})
    if kind == "foreign journal":
        (folder / temp).write_bytes(b"ATTACKER\n")
        write({"pairs": [[temp, "m.safetensors"]]})
        os.chown(journal, 4242, 4242)
        return journal
    if kind == "link to /dev/zero":
        journal.symlink_to("/dev/zero")
        return journal
    if kind == "FIFO":
        os.mkfifo(journal)
        return journal
    if kind == "folder":
        journal.mkdir()
        return journal
    if kind == "huge PID":
        journal = folder / ".cmhsa-commit.99999999999999999999999.json"
        journal.write_text(json.dumps({"pairs": [[str(payload), str(victim)]]}))
        return journal
    if kind == "deep nesting":
        journal.write_text("[" * 100_000)
        return journal
    if kind == "too deep within the size":
        journal.write_text('{"pairs": [[[[[["payload", "m.safetensors"]]]]]]}')
        return journal
    if kind == "millions of pairs":  # the size alone refuses it: 5 M pairs, sparse, never read
        with open(journal, "wb") as f:
            f.write(b'{"pairs": [')
            f.truncate(5_000_000 * 24)
        return journal
    if kind == "old format":  # main 939d132's journal: a list of absolute pairs
        return write([[str(payload), str(victim)]])
    raise AssertionError(kind)


def tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, object]:
    """Every entry under `root` (links and special files by kind, files by content hash), but the
    relative paths in `skip` and anything under them."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if any(rel == s or rel.startswith(s + "/") for s in skip):
            continue
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            out[rel] = (st.st_uid, hashlib.sha256(p.read_bytes()).hexdigest())
        elif stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", os.readlink(p))
        else:
            out[rel] = stat.S_IFMT(st.st_mode)
    return out


def planted_everywhere(folders: list[Path], victim: Path) -> None:
    """Every kind of hostile journal in each of `folders` (that can be made here: chown needs root)."""
    kinds = [k for k in JOURNAL_KINDS if os.geteuid() == 0 or "foreign" not in k]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        for kind, pid in zip(kinds, dead_pids(len(kinds)), strict=True):
            plant_journal(folder, kind, pid, victim)  # all kinds side by side: one command meets them all


def ends_in_seconds(run: Any, seconds: int = 120) -> Any:
    """`run()`, failed (not hung) if it takes more than `seconds`: a FIFO must never block it."""

    def hung(signum: int, frame: object) -> None:
        raise AssertionError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        return run()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def only_notes_and_one_error(r) -> None:
    """Exit 0 or 2; stderr: notes naming what was ignored, and at most one error line."""
    assert r.exit_code in (0, 2), (r.exit_code, r.output[-3000:])
    assert "Traceback" not in r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith("note: ")]
    assert len(errors) == (r.exit_code != 0), lines
    assert all("nothing was renamed" in line for line in lines if line.startswith("note: ")), lines


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory, tiny_run: Path) -> Path:
    """What a researcher downloads: a conv checkpoint, its attention conversion, a timm folder and a
    run folder, in one folder (copied per test)."""
    root = tmp_path_factory.mktemp("downloads")
    (root / "m.safetensors").write_bytes(FIXTURE.read_bytes())
    assert invoke("convert", FIXTURE, "-o", root / "vit.safetensors").exit_code == 0
    assert invoke("export", root / "vit.safetensors", "--format", "timm", "-o", root / "timm").exit_code == 0
    copy_run(tiny_run, root / "run")
    return root


def timm_local_dir(folder: Path) -> None:
    import timm

    import convit_convert.timm  # noqa: F401  (registers the architectures)

    timm.create_model(f"local-dir:{folder}", pretrained=True)


# (command, what it writes, relative to the test's folder); dl/ holds the downloads, out/ is new
JOURNAL_COMMANDS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "inspect": (["inspect", "dl/m.safetensors"], ()),
    "verify": (["verify", "dl/m.safetensors", "dl/vit.safetensors"], ()),
    "eval": (["eval", "dl/vit.safetensors", "--data", "digits", "--workers", "0"], ()),
    "attention": (
        ["attention", "dl/vit.safetensors", "--data", "digits", "--images", "10", "-o", "out/att"],
        ("out/att",),
    ),
    "export": (
        ["export", "dl/vit.safetensors", "-o", "out/v.onnx"],
        ("out/v.onnx", "out/v.onnx.report.json"),
    ),
    "export timm": (["export", "dl/vit.safetensors", "--format", "timm", "-o", "out/timm"], ("out/timm",)),
    "convert": (
        ["convert", "dl/m.safetensors", "-o", "out/v.safetensors"],
        ("out/v.safetensors", "out/v.report.json"),
    ),
    "convert into dl": (
        ["convert", "dl/m.safetensors", "-o", "dl/v.safetensors"],
        ("dl/v.safetensors", "dl/v.report.json"),
    ),
    "resume": (
        ["train", "phase1", *TINY, "--epochs", "2", "--resume", "-o", "dl/run"],
        tuple(
            f"dl/run/{n}"
            for n in ("checkpoint-last.pt", "metrics.csv", "config.json", "conv.safetensors", ".cmhsa.lock")
        ),
    ),
    "init": (["train", "phase2", *TINY, "--init", "dl/m.safetensors", "-o", "out/run"], ("out/run",)),
    "plot": (["plot", "dl/run", "-o", "out/c.png"], ("out/c.png",)),
}


# the default tier meets every hostile journal through a reader, a writer into the journal's
# folder, a resume and timm's loader; the full tier through every command
QUICK_JOURNAL_COMMANDS = ("inspect", "convert into dl", "resume", "timm local-dir")


@pytest.mark.parametrize(
    "command",
    [
        c if c in QUICK_JOURNAL_COMMANDS else pytest.param(c, marks=pytest.mark.slow)
        for c in (*JOURNAL_COMMANDS, "timm local-dir")
    ],
)
def test_a_journal_cmhsa_did_not_begin_is_never_acted_on(
    tmp_path: Path, downloads: Path, monkeypatch, command: str
) -> None:
    # was: `inspect dl/m.safetensors` beside a journal naming [payload, victim] replaced the victim
    # (exit 0); a FIFO journal hung; /dev/zero grew without end; a huge PID or deep nesting: exit 3
    monkeypatch.chdir(tmp_path)
    shutil.copytree(downloads, tmp_path / "dl", symlinks=True)
    (tmp_path / "victim").mkdir()
    victim = tmp_path / "victim" / "bashrc"
    victim.write_text("ORIGINAL\n")
    args, writes = JOURNAL_COMMANDS.get(command, ([], ()))
    planted_everywhere(
        [tmp_path / "dl", tmp_path / "dl" / "run", tmp_path / "dl" / "timm", tmp_path / "out"], victim
    )
    before = tree(tmp_path, writes)
    if command == "timm local-dir":
        ends_in_seconds(lambda: timm_local_dir(tmp_path / "dl" / "timm"))
    else:
        only_notes_and_one_error(ends_in_seconds(lambda: invoke(*args)))
    assert victim.read_text() == "ORIGINAL\n"
    assert tree(tmp_path, writes) == before


@pytest.mark.parametrize("kind", JOURNAL_KINDS)
def test_each_hostile_journal_alone_is_ignored_by_a_writer_into_its_folder(tmp_path: Path, kind: str) -> None:
    # a writer into the folder is the one command that may roll a commit forward: it must not
    if "foreign" in kind and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    dl = tmp_path / "dl"
    dl.mkdir()
    (dl / "m.safetensors").write_bytes(FIXTURE.read_bytes())
    victim = tmp_path / "victim"
    victim.write_text("ORIGINAL\n")
    journal = plant_journal(dl, kind, dead_pids(1)[0], victim)
    before = tree(tmp_path, ("dl/v.safetensors", "dl/v.report.json"))
    r = ends_in_seconds(lambda: invoke("convert", dl / "m.safetensors", "-o", dl / "v.safetensors"))
    assert r.exit_code == 0, r.output[-2000:]
    assert tree(tmp_path, ("dl/v.safetensors", "dl/v.report.json")) == before
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and journal.name in notes[0] and "nothing was renamed" in notes[0], r.stderr


def test_a_pending_commit_is_rolled_forward_only_within_its_folder_by_a_writer(tmp_path: Path) -> None:
    """The journal a killed cmhsa leaves (bare names, its own temps) is finished by the next writer;
    the same journal is ignored once its temp is not this user's or its target not a file."""
    from convit_convert.io import journal as jr

    pid = dead_pids(1)[0]
    (tmp_path / "a.json").write_text("old a\n")
    tmp = f".a.json.{pid}.k2_9xz0q.tmp"
    (tmp_path / tmp).write_text("new a\n")
    name = f".cmhsa-commit.{pid}.json"
    (tmp_path / name).write_text(json.dumps({"pairs": [[tmp, "a.json"]]}))
    scan = jr.scan(tmp_path)
    assert [j.targets for j in scan.pending] == [("a.json",)] and scan.foreign == ()
    with pytest.raises(jr.CmhsaError, match="cut short"):
        jr.check_settled(tmp_path / "a.json")
    jr.check_settled(tmp_path / "b.json")  # a file the commit does not name reads as it is
    from convit_convert.io.atomic import atomic_write_text

    atomic_write_text(tmp_path / "b.json", "b\n")  # a writer into the folder finishes it first
    assert (tmp_path / "a.json").read_text() == "new a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]
    # a temp of another process than the journal's, or a target that is a folder: foreign
    for pairs in ([[f".a.json.{pid + 1}.k2_9xz0q.tmp", "a.json"]], [[f".d.{pid}.k2_9xz0q.tmp", "d"]]):
        (tmp_path / "d").mkdir(exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"pairs": pairs}))
        assert jr.scan(tmp_path).pending == ()


def test_a_pid_no_process_can_have_is_a_dead_writer_never_an_error() -> None:
    # was: OverflowError from os.kill (exit 3)
    from convit_convert.io.journal import alive

    assert not alive(10**23) and not alive(0) and not alive(-1) and alive(os.getpid())


# cmhsa with os.unlink wrapped: the first removal of a file whose name holds KILL_NAME first sends
# KILL_SIG to the process itself, deterministically in the middle of `--overwrite`'s removal
AT_UNLINK = """
import os, sys
real = os.unlink
def unlink(path, *a, **k):
    if os.environ["KILL_NAME"] in str(path):
        os.kill(os.getpid(), int(os.environ["KILL_SIG"]))
    return real(path, *a, **k)
os.unlink = unlink
from convit_convert.cli import main
sys.argv = ["cmhsa", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def exported_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-epoch phase-1 run with numbered checkpoints and a timm folder."""
    out = tmp_path_factory.mktemp("exported") / "run"
    r = invoke("train", "phase1", *TINY, "--epochs", "2", "--keep", "2", "--export-timm", "-o", out)
    assert r.exit_code == 0, r.output
    assert (out / "timm" / "model.safetensors").is_file() and (out / "checkpoint-epoch0002.pt").is_file()
    return out


def copy_tree(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns(".cmhsa.lock"))
    return to


def old_files_left(run: Path) -> list[str]:
    return sorted(
        str(p.relative_to(run))
        for p in run.rglob("*")
        if p.name.startswith("checkpoint-epoch") or p.parent.name == "timm" or p.name == "timm"
    )


def test_overwrite_cut_short_after_the_first_checkpoint_is_finished_by_resume(
    tmp_path: Path, exported_run: Path
) -> None:
    # was: `--resume` finished with the new conv.safetensors beside the old run's timm/ and
    # checkpoint-epoch*.pt, for good
    run = copy_tree(exported_run, tmp_path / "run")
    args = ["train", "phase1", *TINY, "--epochs", "2", "--seed", "3", "--overwrite", "-o", run]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILL_NAME": "model.safetensors"}
    env["KILL_SIG"] = str(int(signal.SIGKILL))  # killed at the timm folder's first removal
    r = subprocess.run(
        [sys.executable, "-c", AT_UNLINK, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert json.loads((run / "config.json").read_text())["seed"] == 3  # the new run's first checkpoint
    assert old_files_left(run)  # killed mid-removal
    r = invoke("train", "phase1", *TINY, "--epochs", "2", "--seed", "3", "--resume", "-o", run)
    assert r.exit_code == 0, r.output[-2000:]
    assert old_files_left(run) == [] and not (run / "overwrite-pending.json").exists()


@pytest.mark.parametrize(
    "sig",
    [
        None,
        pytest.param(signal.SIGINT, marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
    ],
)
def test_overwrite_leaves_no_empty_timm_folder(tmp_path: Path, exported_run: Path, sig: int | None) -> None:
    # was: an empty timm/ after every --overwrite of a run that had exported one
    run = copy_tree(exported_run, tmp_path / "run")
    args = ["train", "phase1", *TINY, "--epochs", "2", "--seed", "3", "--overwrite", "-o", run]
    if sig is None:
        assert invoke(*args).exit_code == 0
    else:  # the signal comes at the first save's first rename: the run saves, removes, and stops
        r = cmhsa_signalled_at_rename(args, 1, sig)
        assert r.returncode == 128 + sig, r.stderr[-2000:]
    assert old_files_left(run) == [] and not (run / "overwrite-pending.json").exists()


def test_a_pending_removal_list_is_checked_before_anything_is_removed(tmp_path: Path, tiny_run: Path) -> None:
    """The list is a file in a folder anyone may have written: only a previous run's removable
    files are taken from it, never the checkpoint being resumed or a path out of the folder."""
    run = copy_run(tiny_run, tmp_path / "run")
    (tmp_path / "victim").write_text("kept\n")
    for names in (["../victim"], ["checkpoint-last.pt"], "conv.safetensors", [["conv.safetensors"]]):
        (run / "overwrite-pending.json").write_text(json.dumps(names))
        before = tree(tmp_path)
        refused(
            invoke("train", "phase1", *TINY, "--epochs", "2", "--resume", "-o", run), "overwrite-pending.json"
        )
        assert tree(tmp_path) == before


def test_init_naming_a_file_the_run_writes_is_refused(tmp_path: Path, attn_model: Path) -> None:
    # was: `phase2 --init I2/vit.safetensors -o I2 --overwrite` replaced the starting weights with the
    # trained model, though --help says the --init file is never removed
    run = tmp_path / "I2"
    run.mkdir()
    start = run / "vit.safetensors"
    start.write_bytes(attn_model.read_bytes())
    args = [
        *"train phase2 --data digits --train-samples 64 --val-samples 32 --batch-size 32 --epochs 1".split(),
        *"--warmup-epochs 0 --workers 0 --device cpu".split(),
    ]
    refused(invoke(*args, "--init", start, "--overwrite", "-o", run), "--init", "a file this run writes")
    assert start.read_bytes() == attn_model.read_bytes() and sorted(os.listdir(run)) == ["vit.safetensors"]
    r = invoke(*args, "--init", start, "-o", tmp_path / "other")
    assert r.exit_code == 0, r.output[-2000:]
    info = json.loads((tmp_path / "other" / "config.json").read_text())["init_info"]
    assert info["init_sha256"] == hashlib.sha256(attn_model.read_bytes()).hexdigest()


def crafted_timm_folder(folder: Path, source: Path, change: Any) -> Path:
    """A copy of the timm folder `source` whose config.json `change` edits."""
    shutil.copytree(source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _top_num_classes(c: dict) -> None:
    c["num_classes"] = c["pretrained_cfg"]["num_classes"] = 5


def _input_size(c: dict) -> None:
    c["pretrained_cfg"]["input_size"] = [3, 224, 224]


def _million_classes(c: dict) -> None:
    for d in (c, c["pretrained_cfg"], c["model_args"]["cmhsa_config"]):
        d["num_classes"] = 10**6


def _huge(c: dict) -> None:  # 650 bytes, each size within its own bound: ~540 GB of parameters
    cc = c["model_args"]["cmhsa_config"]
    cc.update(embed_dim=4096, hidden_chans=4096 // cc["patch_size"] ** 2, mlp_hidden_dim=16384, depth=1024)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (_top_num_classes, "says num_classes 5 but its model_args"),
        (_input_size, "says input_size [3, 224, 224]"),
        (_million_classes, "size mismatch for head"),
        (_huge, "more than cmhsa loads"),
    ],
    ids=["top-level num_classes", "input_size", "10^6 classes", "600 GB"],
)
def test_a_timm_folder_whose_config_is_not_its_model_is_one_line(
    tmp_path: Path, downloads: Path, change: Any, fragment: str
) -> None:
    # was: top-level num_classes 5 loaded with a random head (max |Δlogits| 6.57, no error); 10^6 classes
    # built a random 10^6-class head; the 650-byte config asked for ~540 GB before any weight was read
    import timm

    import convit_convert.timm  # noqa: F401
    from convit_convert.errors import CmhsaError

    folder = crafted_timm_folder(tmp_path / "f", downloads / "timm", change)
    with pytest.raises(CmhsaError) as e:
        timm.create_model(f"local-dir:{folder}", pretrained=True)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_checkpoint_claiming_a_model_larger_than_memory_is_refused_before_it_is_built(
    tmp_path: Path,
) -> None:
    cfg = json.loads(fixture_parts()[0]["__metadata__"]["cmhsa.config"])
    cfg.update(embed_dim=4096, hidden_chans=4096 // cfg["patch_size"] ** 2, mlp_hidden_dim=16384, depth=1024)
    bad = metadata_variant(tmp_path, json.dumps(cfg))
    for args in (["inspect", bad], ["convert", bad, "-o", tmp_path / "v.safetensors"]):
        refused(invoke(*args), "more than cmhsa loads")


def value_dependent_expand(path: Path) -> Path:
    """A few hundred bytes: an Expand whose shape is computed from the input's values (max × 10^5)."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, 8, 8])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [])
    nodes = [
        helper.make_node("ReduceMax", ["pixel_values"], ["m"], keepdims=0),
        helper.make_node("Mul", ["m", "big"], ["mb"]),
        helper.make_node("Cast", ["mb"], ["n"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["n", "one_shape"], ["n1"]),
        helper.make_node("Concat", ["n1", "n1"], ["shape"], axis=0),
        helper.make_node("Expand", ["one", "shape"], ["e"], name="grow"),
        helper.make_node("ReduceSum", ["e"], ["logits"], keepdims=0),
    ]
    inits = [
        helper.make_tensor("big", TensorProto.FLOAT, [], [1e5]),
        helper.make_tensor("one_shape", TensorProto.INT64, [1], [1]),
        helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], inits), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def test_an_onnx_shape_that_depends_on_the_input_s_values_is_refused_before_onnxruntime(
    tmp_path: Path, monkeypatch
) -> None:
    # was: onnxruntime ran it (39 s at 13.2 GB for the reporter's file), then "tensor 'pixel_values'
    # has no known type"
    from convit_convert.onnx import read

    def never(*a, **k):
        raise AssertionError("onnxruntime was given the graph")

    monkeypatch.setattr(read, "ort_session", never)
    path = value_dependent_expand(tmp_path / "dyn.onnx")
    for args in (["inspect", path], ["convert", path, "-o", tmp_path / "v.safetensors"]):
        refused(invoke(*args), "node 'grow' (Expand)", "depends on the input's values")


def test_onnx_metadata_props_are_bounded(tmp_path: Path, conv_onnx: Path) -> None:
    # was: 210 MB of metadata_props accepted
    import onnx

    model = onnx.load(conv_onnx)
    entry = model.metadata_props.add()
    entry.key, entry.value = "note", "x" * (2 * 2**20)
    onnx.save(model, tmp_path / "meta.onnx")
    refused(invoke("inspect", tmp_path / "meta.onnx"), "metadata_props entry 'note'")


def test_compile_says_it_is_compiling_before_the_first_step(tmp_path: Path, monkeypatch) -> None:
    # was: nothing for over 90 s on 2 cores, then a raw torch log line
    import torch

    monkeypatch.setattr(torch, "compile", lambda fn, **k: fn)  # the line, not the compile, is tested
    r = invoke("train", "phase1", *TINY, "--compile", "-o", tmp_path / "run")
    assert r.exit_code == 0, r.output[-2000:]
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("compile: torch.compile builds"))
    assert "about 70 s the first time" in lines[at]
    assert at < next(i for i, line in enumerate(lines) if line.startswith("epoch 1/1"))
