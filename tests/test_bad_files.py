"""Input files that lie, through every command that reads them: mutated safetensors headers and
bodies, mutated ONNX protos and external data, renamed formats, configs no parser should meet,
sizes no machine holds, malformed datasets, crafted metrics and timm folders, FIFOs and link loops.

Each case ends with exit 1 or 2 (never 3, an internal error; 0 where the mutation left a valid
file), exactly one line on stderr, no traceback, no new file beside the inputs, and the inputs
unchanged. Hypothesis drives the mutations, derandomized and bounded, so a run is the same every
time.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    FIXTURE,
    ROOT,
    check_outcome,
    in_a_process,
    invoke,
    one_error_line,
    snapshot,
    special_files,
)
from convit_convert.errors import CmhsaError

SETTINGS = settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def fresh(tmp_path: Path) -> Path:
    """A new folder per Hypothesis example (tmp_path is shared by all of a test's examples)."""
    return Path(tempfile.mkdtemp(dir=tmp_path))


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


@pytest.mark.parametrize("command", ["predict", "inspect", "convert", "export", "export-timm"])
def test_a_safetensors_header_over_the_one_bound_is_refused_by_every_reader(
    tmp_path: Path, command: str
) -> None:
    """17 MiB of metadata (the safetensors library itself takes headers to 100 MB): every command
    refuses it in one line naming the file, before it reads a tensor, and writes nothing."""
    from convit_convert.io.safetensors_writer import HEADER_BYTES

    header, body = fixture_parts()
    header["__metadata__"]["cmhsa.trained"] = "x" * (HEADER_BYTES + 2**20)
    path = tmp_path / "big.safetensors"
    path.write_bytes(pack(header, body))
    out = tmp_path / "out"
    args = {
        "predict": ["predict", path, FIXTURE.parent / "digits" / "3.png"],
        "inspect": ["inspect", path],
        "convert": ["convert", path, "-o", tmp_path / "v.safetensors"],
        "export": ["export", path, "-o", tmp_path / "v.onnx"],
        "export-timm": ["export", path, "--format", "timm", "-o", out],
    }[command]
    one_error_line(invoke(*args), 2, str(path), f"at most {HEADER_BYTES:,} bytes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


def test_the_writer_refuses_a_header_its_readers_would_refuse_before_writing(tmp_path: Path) -> None:
    """The same bound for the writer: metadata that would make a header over it is refused naming
    the file it would become, with nothing written."""
    import io

    import torch

    from convit_convert.io.safetensors_writer import HEADER_BYTES, write_safetensors

    sink = io.BytesIO()
    with pytest.raises(
        CmhsaError, match=r"^out.safetensors: its safetensors header .* more than cmhsa reads"
    ):
        write_safetensors(sink, {"w": torch.zeros(2)}, {"m": "x" * HEADER_BYTES}, "out.safetensors")
    assert sink.getvalue() == b""


def test_a_timm_folder_refused_on_reading_back_names_the_user_s_folder_and_goes(
    tmp_path: Path, monkeypatch
) -> None:
    """Had the export's read-back and its writer disagreed (a reader's bound below the writer's),
    the refusal names the folder the user gave, not the descriptor it is read through
    (/proc/self/fd/N), and the folder the export made is gone with the files written into it."""
    from convit_convert.api import load_checkpoint
    from convit_convert.io import checkpoint
    from convit_convert.timm import export_timm_folder

    ckpt = load_checkpoint(FIXTURE)
    monkeypatch.setattr(checkpoint, "HEADER_BYTES", 64)
    out = tmp_path / "made" / "timm"
    with pytest.raises(CmhsaError) as e:
        export_timm_folder(ckpt, out)
    assert e.value.path == str(out / "model.safetensors"), e.value
    assert not (tmp_path / "made").exists()


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
            # the reader is under test, not the sweep: 8 images each, not the default 256 and 512
            ["heads", "--checkpoint", f, "--calib-images", "8", "--heldout-images", "8"],
            ["eval", f, "--data", "synthetic"],
        ):
            r = invoke(*args)
            check_outcome(r, folder, before)  # 0 where the content is valid whatever the name


# mutated ONNX ------------------------------------------------------------------------------------


@pytest.fixture
def conv_onnx(shipped: Callable[[str], Path]) -> Path:
    return shipped("conv.onnx")


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


def test_an_input_that_is_a_fifo_or_device_is_refused_without_blocking(tmp_path: Path) -> None:
    for kind, node in special_files(tmp_path).items():
        if kind != "symbolic link":  # a link to a model file is read as that file
            for args in (["inspect", node], ["verify", FIXTURE, node], ["eval", node, "--data", "digits"]):
                one_error_line(invoke(*args), 2, kind)


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
    # catches: RecursionError and int-digits ValueError as internal errors; img_size 0 accepted
    # (inspect exit 0)
    cfg = json.loads(fixture_parts()[0]["__metadata__"]["cmhsa.config"])
    text = {
        "nesting": "[" * 100_000 + "]" * 100_000,
        "digits": json.dumps(cfg).replace('"depth": 4', '"depth": ' + "9" * 5000),
        "zero": json.dumps({**cfg, "img_size": [0, 0]}),
        "negative": json.dumps({**cfg, "img_size": [-32, 32]}),
    }[name]
    bad = metadata_variant(tmp_path, text)
    for args in (["inspect", bad], ["convert", bad, "-o", tmp_path / "v.safetensors"]):
        one_error_line(invoke(*args), 2, fragment)


def test_a_file_claiming_a_huge_attention_model_builds_no_position_index_to_check_it() -> None:
    # catches: a 450-byte file (image 256, P 4, depth 24) made inspect build every block's (4096, 4096)
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
    # catches: odd column names (int('X')) and ±1e308 (matplotlib's overflow) as internal errors
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_bytes(content)
    r = invoke("plot", run, "-o", tmp_path / "c.png")
    if outcome:
        one_error_line(r, 2, "metrics.csv")
    else:
        assert r.exit_code == 0 and r.stderr == "", r.output


def test_plot_refuses_a_huge_metrics_file_without_reading_it(tmp_path: Path) -> None:
    # catches: a 1 GB one-line metrics.csv read whole
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.csv", "wb") as f:
        f.truncate(2**30)  # sparse: no disk used
    one_error_line(invoke("plot", run, "-o", tmp_path / "c.png"), 2, "more than cmhsa reads")


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
    bad = {  # each made only when asked for: the bomb is 300 MiB before compression
        "rank": ("train-images-idx3-ubyte", lambda: idx_bytes([20 * 28 * 28], bytes(20 * 784))),
        "overflowing dims": ("train-images-idx3-ubyte", lambda: idx_bytes([2**31, 2**31, 2**31], b"")),
        "label shape": ("train-labels-idx1-ubyte", lambda: idx_bytes([20, 1], bytes(20))),
        "label values": ("train-labels-idx1-ubyte", lambda: idx_bytes([20], bytes([200] * 20))),
        "0x0 images": ("train-images-idx3-ubyte", lambda: idx_bytes([20, 0, 0], b"")),
        "truncated": ("train-images-idx3-ubyte", lambda: good["train-images-idx3-ubyte"][:1000]),
        "bomb": ("t10k-labels-idx1-ubyte", None),
    }
    name, make = bad.get(broken, (None, None))
    for n, content in good.items():
        if n == name and make is None:  # the bomb: 10 labels, then 300 MiB of zeros, streamed
            with gzip.open(folder / (n + ".gz"), "wb", compresslevel=1) as f:
                f.write(idx_bytes([10], bytes(range(10))))
                for _ in range(300):
                    f.write(bytes(2**20))
            continue
        payload = gzip.compress(make() if n == name else content, compresslevel=1)
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
    # catches: internal errors (reshape, prod overflow, 0x0 images), 'error: aborted' exit 1 (a truncated
    # gzip's EOFError became click's Abort), and a gzip bomb decompressed whole
    folder = fashion_folder(tmp_path, broken)
    one_error_line(invoke("eval", FIXTURE, "--data", "fashion-mnist", "--data-dir", folder), 2, fragment)


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


@pytest.mark.parametrize(
    ("broken", "loader"),
    [
        ("undecodable", "device"),
        ("empty", "device"),
        ("truncated", "device"),
        ("bomb", "device"),
        ("fifo", "device"),
        pytest.param("truncated", "workers", marks=pytest.mark.slow),  # a process of its own: 16 s
    ],
)
def test_a_bad_image_in_an_image_folder_is_one_line_never_a_hang(
    tmp_path: Path, broken: str, loader: str
) -> None:
    # catches: internal errors from PIL, a decompression bomb decoded, a FIFO named x.png hanging
    # eval and train
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
        one_error_line(invoke(*args), 2, "x.png", "FIFO" if broken == "fifo" else "")
        return
    one_error_line(in_a_process("-m", "convit_convert", *args), 2, "x.png")


def test_a_symlink_loop_anywhere_is_bad_input(tmp_path: Path, attn_model: Path) -> None:
    # catches: `internal error: RuntimeError: Symlink loop from ...` (exit 3) for -o and --report
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
        one_error_line(invoke(*args), 2)
    assert not ok.exists() and not (tmp_path / "ok.onnx").exists()


def test_a_huge_conversion_is_sized_before_it_is_made(tmp_path: Path, monkeypatch) -> None:
    # catches: `train phase2 --init conv --heads 4096` converted and verified the model (3.6 GB, 36 s) first
    from convit_convert.train import phases

    def never(*a, **k):
        raise AssertionError("converted before the memory estimate")

    monkeypatch.setattr(phases, "convert_checkpoint", never)
    for flag in (["--heads", "4096"], ["--qk-dim", "65536"]):
        r = invoke("train", "phase2", "--data", "digits", "--init", FIXTURE, *flag, "-o", tmp_path / "r")
        one_error_line(r, 2, "would need about")


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
    # catches: a 171-byte Expand to (30000, 30000) took 4.3 GB in `inspect`; a Loop of 10^12 trips ran
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
            one_error_line(invoke(*command), 2, fragment)


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
    session = ort_session(model, tmp_path / "slow.onnx", threads=1, batch=1)
    with pytest.raises(CmhsaError, match=r"more than 0\.5 s"):
        run_session(session, None, {"x": np.ones((n, n), np.float32)}, tmp_path / "slow.onnx", seconds=0.5)


def test_onnx_external_data_in_every_part_of_a_model_is_checked(tmp_path: Path) -> None:
    # catches: a Constant's sparse_value and a local function's tensors were not checked, and
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
        one_error_line(invoke("inspect", path), 2, "leaves the model's folder")


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
        (_million_classes, "says num_classes 1000000 but model.safetensors holds"),  # before timm builds
        (_huge, "more than cmhsa loads"),
    ],
    ids=["top-level num_classes", "input_size", "10^6 classes", "600 GB"],
)
def test_a_timm_folder_whose_config_is_not_its_model_is_one_line(
    tmp_path: Path, downloads: Path, change: Any, fragment: str
) -> None:
    # catches: top-level num_classes 5 loaded with a random head (max |Δlogits| 6.57, no error); 10^6 classes
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
        one_error_line(invoke(*args), 2, "more than cmhsa loads")


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
    # catches: onnxruntime ran it (39 s at 13.2 GB for the reporter's file), then "tensor 'pixel_values'
    # has no known type"
    import onnxruntime

    def never(*a, **k):
        raise AssertionError("onnxruntime was given the graph")

    monkeypatch.setattr(onnxruntime, "InferenceSession", never)  # ort_session sizes the graph first
    path = value_dependent_expand(tmp_path / "dyn.onnx")
    for args in (["inspect", path], ["convert", path, "-o", tmp_path / "v.safetensors"]):
        one_error_line(invoke(*args), 2, "node 'grow' (Expand)", "depends on the input's values")


# foreign values, each through its one reader --------------------------------------------------------


def blank_png(path: Path, width: int, height: int) -> Path:
    """A valid bilevel PNG of ``width`` x ``height`` black pixels, a few KB to a few hundred (PIL's
    own encoder takes seconds for 80 million rows; zlib streams them in a fraction of one)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (width + 7) // 8)  # filter type 0, then the row's bits
    z = zlib.compressobj(9)
    block = row * max(1, 2**20 // len(row))
    rows_per_block = len(block) // len(row)
    idat = [z.compress(block) for _ in range(height // rows_per_block)]
    idat += [z.compress(row * (height % rows_per_block)), z.flush()]
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1 bit, grey
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(idat)) + chunk(b"IEND", b"")
    )
    return path


@pytest.mark.parametrize(
    ("size", "words"),
    [
        ((1, 1_000_000), "one side more than 100 times the other"),  # was: predict took 4 GB
        ((1, 80_000_000), "one side more than 100 times the other"),  # was: OverflowError, exit 3
        ((10_000, 10_000), "exceeds limit of 89478485 pixels"),
    ],
)
def test_an_image_is_sized_from_its_header_before_it_is_decoded(
    tmp_path: Path, conv_onnx: Path, size: tuple[int, int], words: str
) -> None:
    image = blank_png(tmp_path / "strip.png", *size)
    for model in (FIXTURE, conv_onnx):
        one_error_line(invoke("predict", model, image), 2, str(image), words)


def test_a_resize_to_the_model_s_input_is_sized_before_it_is_allocated() -> None:
    from convit_convert.io.images import UnreadableImage, check_size

    check_size(100, 9_000, "ok.png", resize_to=36)  # 36 x 3,240 pixels
    with pytest.raises(UnreadableImage, match="would be 134,218,240 pixels"):
        check_size(100, 8_192, "wide.png", resize_to=1_280)  # 1,280 x 104,858


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_an_image_of_a_format_no_classifier_takes_is_never_decoded(tmp_path: Path) -> None:
    """An EPS file named .png: PIL would run Ghostscript (`gs` from PATH) to decode it;
    the fake `gs` below never runs."""
    bin_dir, ran = tmp_path / "bin", tmp_path / "gs-ran"
    bin_dir.mkdir()
    (bin_dir / "gs").write_text(f"#!/bin/sh\necho ran > {ran}\nexit 1\n")
    (bin_dir / "gs").chmod(0o755)
    image = tmp_path / "eps.png"
    image.write_text("%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    r = in_a_process("-m", "convit_convert", "predict", FIXTURE, image, env=env)
    one_error_line(r, 2, str(image), "not an image of a format cmhsa reads")
    assert not ran.exists()


def test_a_sixteen_bit_image_is_scaled_not_clipped(tmp_path: Path) -> None:
    """A 16-bit grey PNG of value 32,896 is the 8-bit image of 128 (32,896 / 257), not white
    (PIL's own conversion clips it to 255)."""
    import numpy as np
    from PIL import Image

    from convit_convert.api.predict import predict_files
    from convit_convert.io.images import read_image

    Image.fromarray(np.full((32, 32), 32_896, dtype=np.uint16)).save(tmp_path / "deep.png")
    Image.new("L", (32, 32), 128).save(tmp_path / "flat.png")
    assert np.asarray(read_image(tmp_path / "deep.png", "L")).tolist() == [[128] * 32] * 32
    deep, flat = (predict_files(FIXTURE, [tmp_path / n]).predictions[0].top for n in ("deep.png", "flat.png"))
    assert deep == flat


def with_props(src: Path, dst: Path, **props: str) -> Path:
    """``src`` (an ONNX file cmhsa exported) with some metadata_props replaced."""
    import onnx

    model = onnx.load(src)
    kept = [(p.key, p.value) for p in model.metadata_props if p.key not in props]
    del model.metadata_props[:]
    for key, value in [*kept, *props.items()]:
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, dst)
    return dst


@pytest.mark.parametrize(
    ("props", "words"),
    [
        ({"classes": "zero,one"}, "metadata_props' classes is not valid JSON"),  # was: exit 3
        ({"classes": "[" + "9" * 5000 + "]"}, "metadata_props' classes is not valid JSON"),  # was: exit 3
        ({"classes": "[" * 5000 + "]" * 5000}, "metadata_props' classes nests deeper than 64 levels"),
        ({"classes": json.dumps(["bad\udcff", *map(str, range(1, 10))])}, "class name 0 holds U+DCFF"),
        ({"classes": json.dumps(["one\u200b", *map(str, range(1, 10))])}, "class name 0 holds U+200B"),
        # was: an 8x8 image resized to 2.5 GB
        ({"input_size": "[1, 4096, 4096]", "resize_shorter_to": "40960"}, "is not the graph's input 1x32x32"),
        ({"std": "[1e-45]"}, "preprocessing is not one cmhsa export writes"),  # was: nan% with exit 0
        ({"mean": "[NaN]"}, "preprocessing is not one cmhsa export writes"),
        ({"resize_shorter_to": "321"}, "preprocessing is not one cmhsa export writes"),
    ],
)
def test_onnx_metadata_is_read_as_untrusted_input_by_predict(
    tmp_path: Path, conv_onnx: Path, props: dict[str, str], words: str
) -> None:
    from PIL import Image

    Image.new("L", (8, 8), 90).save(tmp_path / "pic.png")
    model = with_props(conv_onnx, tmp_path / "forged.onnx", **props)
    one_error_line(invoke("predict", model, tmp_path / "pic.png"), 2, str(model), words)


def test_outputs_that_are_not_numbers_are_an_error_not_nan(tmp_path: Path, conv_onnx: Path) -> None:
    import numpy as np
    import onnx
    from onnx import numpy_helper
    from PIL import Image

    model = onnx.load(conv_onnx)
    head = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))  # the largest weight
    head.CopyFrom(numpy_helper.from_array(np.full(tuple(head.dims), 3e38, dtype=np.float32), head.name))
    onnx.save(model, tmp_path / "overflow.onnx")
    Image.new("L", (8, 8), 90).save(tmp_path / "pic.png")
    r = invoke("predict", tmp_path / "overflow.onnx", tmp_path / "pic.png")
    one_error_line(r, 2, "outputs for", "pic.png", "are not finite")
    assert "nan" not in r.stdout


def test_json_from_a_file_is_read_by_one_bounded_parser(tmp_path: Path) -> None:
    """A checkpoint's cmhsa.result nested 5,000 deep: one line where it is read, never
    a RecursionError in `export --format timm`, and no folder left."""
    from safetensors import safe_open

    from convit_convert.api import load_checkpoint, save_checkpoint
    from convit_convert.io.paths import parse_json

    ckpt = load_checkpoint(FIXTURE)
    path = tmp_path / "deep.safetensors"
    save_checkpoint(path, ckpt.config, ckpt.tensors, {"cmhsa.result": "[" * 5000 + "]" * 5000})
    for args in (("inspect", path), ("export", path, "--format", "timm", "-o", tmp_path / "timm")):
        one_error_line(invoke(*args), 2, str(path), "metadata cmhsa.result nests deeper than 64 levels")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.safetensors"]
    with safe_open(str(FIXTURE), "pt") as f:
        assert parse_json(f.metadata()["cmhsa.config"])["depth"] == ckpt.config.depth
    for text, words in [("1" * 1001, "integer of 1,001 digits"), ('{"a": ' * 65 + "0" + "}" * 65, "deeper")]:
        with pytest.raises(CmhsaError, match=words):
            parse_json(text, "x.json")


def test_a_timm_folder_whose_label_names_are_not_its_weights_is_refused(tmp_path: Path) -> None:
    """One source of the names: config.json's label_names (what timm and transformers' pipeline
    show) must be those model.safetensors records (what predict shows), or the folder is refused."""
    import timm

    import convit_convert.timm  # noqa: F401  (registers cmhsa's architectures)
    from convit_convert.api import load_checkpoint, save_checkpoint
    from convit_convert.labels import KEY

    ckpt = load_checkpoint(FIXTURE)
    named = tmp_path / "named.safetensors"
    save_checkpoint(named, ckpt.config, ckpt.tensors, {KEY: json.dumps([f"d{i}" for i in range(10)])})
    assert invoke("export", named, "--format", "timm", "-o", tmp_path / "t").exit_code == 0
    config = tmp_path / "t" / "config.json"
    doc = json.loads(config.read_text())
    for label_names in ([f"d{i}" for i in range(9)] + ["cat"], None):
        edited = (
            {**doc, "label_names": label_names}
            if label_names
            else {k: v for k, v in doc.items() if k != "label_names"}
        )
        config.write_text(json.dumps(edited))
        (tmp_path / "pic.png").write_bytes((ROOT / "fixtures" / "digits" / "0.png").read_bytes())
        r = invoke("predict", tmp_path / "t", tmp_path / "pic.png")
        one_error_line(r, 2, str(config), "are not the class names model.safetensors records")
        with pytest.raises(CmhsaError, match=r"are not the class names model\.safetensors records"):
            timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True)


@pytest.mark.parametrize("in_chans", [2, 4])
@pytest.mark.parametrize("fmt", ["onnx", "timm"])
def test_a_model_of_other_than_grey_or_rgb_images_is_refused_by_export(
    tmp_path: Path, in_chans: int, fmt: str
) -> None:
    """A valid config of 2 or 4 input channels converts and verifies, but no preprocessing an export
    records (ONNX metadata's channels, timm's and transformers' mean and std) describes its images:
    export refuses it in one line naming the file, and writes nothing."""
    import torch

    from conftest import conv_model
    from convit_convert.api import save_checkpoint

    model = conv_model(dtype=torch.float32, in_chans=in_chans)
    path = tmp_path / "four.safetensors"
    save_checkpoint(path, model.cfg, model.state_dict())
    out = tmp_path / ("m.onnx" if fmt == "onnx" else "timm")
    r = invoke("export", path, "--format", fmt, "-o", out)
    one_error_line(r, 2, str(path), f"takes {in_chans}-channel images", "RGB (3 channels) or grey (1)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["four.safetensors"]


def test_a_tensor_file_is_held_to_memory_by_what_it_holds_before_it_is_read(
    tmp_path: Path, monkeypatch
) -> None:
    """A torch.save zip rewritten with compressed entries (4 MB of zeros in a few KB: what it would
    take is not its size) is refused unread; a safetensors file and a .pt with less memory than
    twice their tensors' bytes are refused before a tensor is read."""
    import zipfile

    import torch

    from convit_convert import resources

    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(2**20)}, plain)
    packed = tmp_path / "packed.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as dst:
        for entry in src.infolist():
            dst.writestr(entry.filename, src.read(entry.filename))
    assert packed.stat().st_size < 2**16
    one_error_line(invoke("inspect", packed), 2, str(packed), "holds compressed entries")
    monkeypatch.setattr(resources, "available_memory", lambda: 2**16)
    for path in (FIXTURE, plain):
        r = invoke("convert", path, "-o", tmp_path / "v.safetensors", "--img-size", "8", "--patch-size", "4")
        one_error_line(r, 2, str(path), "reading its tensors", "would need about")
