"""The layering docs/ARCHITECTURE.md describes, checked on the code: imports flow one way (no
cycles), nothing below the CLI imports it, and library errors name parameters, not flags."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import ROOT, in_a_process, invoke
from convit_convert.api import load_checkpoint
from convit_convert.config import ViTConfig
from convit_convert.errors import CmhsaError
from convit_convert.model import VisionTransformer

PACKAGES = {"convit_convert": ROOT / "convit_convert", "convit_convert.train": ROOT / "train"}


def module_imports() -> dict[str, set[str]]:
    """Every package module and the package modules it imports, at any level (function bodies too)."""
    files = {}
    for prefix, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = [prefix, *f.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = f
    graph: dict[str, set[str]] = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                # `from pkg import mod` imports pkg.mod (and runs pkg's __init__, which imports
                # only `version`); `from mod import name` imports mod
                candidates = [
                    f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names
                ]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            deps |= {c for c in candidates if c in files and c != name}
        graph[name] = deps | (string_imports(f) & files.keys())
    return graph


DYNAMIC = ("import_module", "spec_from_file_location", "__import__", "module_from_spec")


def string_imports(f: Path) -> set[str]:
    """What a module imports by name at run time: the package's ``_EXPORTS`` (module names, imported
    on first use of one of their names) and its loader of ``train/`` (``_checkout_train``). Only the
    package's ``__init__.py`` may import that way (test_only_the_package_imports_by_string)."""
    tree = ast.parse(f.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            found |= {f"convit_convert.{k.value}" for k in node.value.keys}  # type: ignore[attr-defined]
        if isinstance(node, ast.FunctionDef) and node.name == "_checkout_train":
            found.add("convit_convert.train")
    return found


def test_only_the_package_imports_by_string() -> None:
    """importlib's run-time imports appear in the package's __init__.py alone, whose string imports
    module_imports reads (so the layer test sees them); that it reads them is checked here too."""
    users = []
    for folder in PACKAGES.values():
        for f in folder.rglob("*.py"):
            calls = {
                n.attr if isinstance(n, ast.Attribute) else n.id
                for n in ast.walk(ast.parse(f.read_text()))
                if isinstance(n, (ast.Attribute, ast.Name))
            }
            if calls & set(DYNAMIC):
                users.append(str(f.relative_to(ROOT)))
    assert users == ["convit_convert/__init__.py"], users
    seen = module_imports()["convit_convert"]
    assert {"convit_convert.api", "convit_convert.train", "convit_convert.model"} <= seen, seen


def test_the_import_graph_has_no_cycles() -> None:
    graph, done, path = module_imports(), set(), []

    def visit(m: str) -> None:
        if m in path:
            pytest.fail("import cycle: " + " -> ".join([*path[path.index(m) :], m]))
        if m in done:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert len(graph) > 30  # the walk saw the whole package, train/ included


def documented_layers() -> list[list[str]]:
    """docs/ARCHITECTURE.md's ```layers block: per layer, its module patterns (``x.*``: a subpackage)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("```layers\n", 1)[1].split("```", 1)[0]
    layers = []
    for i, line in enumerate(block.strip().splitlines()):
        number, rest = line.split(" ", 1)
        assert int(number) == i, line
        layers.append([m.strip() for m in rest.split(":", 1)[1].split(",")])
    return layers


def layer_of(module: str, layers: list[list[str]]) -> int:
    short = module.removeprefix("convit_convert.") if module != "convit_convert" else module
    for i, patterns in enumerate(layers):
        for p in patterns:
            if short == p or (p.endswith(".*") and (short == p[:-2] or short.startswith(p[:-1]))):
                return i
    raise AssertionError(f"{module} is in no layer of docs/ARCHITECTURE.md")


def test_every_import_follows_the_documented_layers() -> None:
    layers = documented_layers()
    graph = module_imports()
    upward = sorted(
        f"{m} (layer {layer_of(m, layers)}) imports {d} (layer {layer_of(d, layers)})"
        for m, deps in graph.items()
        for d in deps
        if layer_of(d, layers) > layer_of(m, layers)
    )
    assert not upward, upward
    used = {layer_of(m, layers) for m in graph}
    assert used == set(range(len(layers))), "a documented layer holds no module"


def test_the_experiments_runner_and_reports_start_without_torch() -> None:
    """train/arms.py (the launcher of an experiment's arms) and the experiments' report scripts import
    no torch, timm or torchvision (train/names.py holds the run's file names they need): a report
    reads its raw runs in a fraction of a second, where importing torch alone takes two."""
    code = (
        "import sys; sys.path.insert(0, 'experiments')\n"
        "import convit_convert.train.arms, plateau_stacked, crossover, gpu_60k_report\n"
        "print(sorted({'torch', 'timm', 'torchvision'} & set(sys.modules)))"
    )
    r = in_a_process("-c", code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]


def test_only_the_cli_imports_the_cli() -> None:
    """And the program's entry point (convit_convert.main, run by `cmhsa` and __main__) that runs it."""
    offenders = {
        m: sorted(d for d in deps if d.startswith("convit_convert.cli"))
        for m, deps in module_imports().items()
        if not m.startswith("convit_convert.cli") and m not in ("convit_convert.__main__", "convit_convert")
    }
    assert not {m: d for m, d in offenders.items() if d}


def test_only_the_cli_renders_and_picks_exit_codes() -> None:
    """rich and typer are imported only under cli/ (training reports progress through
    train.progress's events; the CLI draws them), and no library module raises SystemExit or
    carries exit codes."""
    offenders = []
    for prefix, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            if prefix == "convit_convert" and f.relative_to(folder).parts[0] in ("cli", "__main__.py"):
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                offenders += [
                    f"{f.name} imports {n}" for n in names if n.split(".")[0] in ("rich", "typer", "click")
                ]
                if isinstance(node, ast.Name) and node.id == "SystemExit":
                    offenders.append(f"{f.name} uses SystemExit")
                if isinstance(node, (ast.Name, ast.Attribute)) and "exit_code" in ast.unparse(node):
                    offenders.append(f"{f.name} mentions exit_code")
    assert not offenders, offenders


def test_library_errors_name_parameters_and_the_cli_names_flags(tmp_path: Path) -> None:
    """A bare state dict without geometry: the library says `img_size`, the CLI --img-size."""
    model = VisionTransformer(ViTConfig.build(img_size=16, patch_size=4, depth=1, num_classes=3))
    path = tmp_path / "bare.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with pytest.raises(CmhsaError, match="give `img_size` and `patch_size`"):
        load_checkpoint(path)
    r = invoke(["convert", str(path), "-o", str(tmp_path / "v.safetensors")])
    assert r.exit_code == 2 and "give --img-size and --patch-size" in r.stderr, r.output


def test_pinned_heads_are_counted_from_the_conversion(tmp_path: Path) -> None:
    """On a 1×2 patch grid a 5×5 kernel's 9 offsets include 6 that leave the image in every
    direction: the file pins 3 heads, and convert says so (it used to print "9 pinned")."""
    cfg = ViTConfig.build(img_size=(4, 8), patch_size=4, depth=2, num_classes=3, kernel_size=5)
    conv = tmp_path / "conv.safetensors"
    from convit_convert.api import save_checkpoint

    save_checkpoint(conv, cfg, VisionTransformer(cfg).state_dict())
    out = tmp_path / "vit.safetensors"
    r = invoke(["convert", str(conv), "-o", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "9 heads (3 pinned)" in " ".join(r.output.split()), r.output
    # independent count: heads whose bias table has a non-zero (pinned) entry, in the written file
    written = load_checkpoint(out).tensors
    for i in range(cfg.depth):
        table = written[f"blocks.{i}.attn.rel_pos_bias"]
        assert int((table.flatten(1) != 0).any(dim=1).sum()) == 3
    import json

    report = json.loads(out.with_name("vit.report.json").read_text())
    assert report["conversion"]["pinned_heads"] == 3
    assert sum(o is not None for o in report["conversion"]["offsets"]) == 3
    assert torch.isfinite(written["blocks.0.attn.sink"]).all()


def _modules(folder: Path) -> list[str]:
    """The module files of a package folder (no __init__ / __main__), their stems."""
    return sorted(f.stem for f in folder.glob("*.py") if f.stem not in ("__init__", "__main__"))


def test_architecture_md_table_is_the_layers_block() -> None:
    """Each row of docs/ARCHITECTURE.md's table names, in its first column, the layer the ```layers
    block puts its module in, and the rows come in the block's layer order: the prose cannot say
    one thing and the checked block another."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    names = [
        line.split(" ", 2)[1].rstrip(":")
        for line in doc.split("```layers\n", 1)[1].split("```")[0].strip().splitlines()
    ]
    layers = documented_layers()
    start = doc.index("| layer | module | owns |")
    rows = [line.split(" | ")[:2] for line in doc[start:].split("\n\n", 1)[0].splitlines()[2:]]
    assert len(rows) > 40
    wrong, last = [], 0
    for layer, cell in rows:
        path = cell.strip("`")
        module = (
            "convit_convert"
            if path == "convit_convert/__init__.py"
            else "convit_convert."
            + (path[:-1] + ".x" if path.endswith("/") else path.removesuffix(".py").replace("/", "."))
        )
        where = layer_of(module, layers)
        if layer.lstrip("| ") != names[where]:
            wrong.append(f"{cell} is under {layer.lstrip('| ')!r}; the block puts it in {names[where]!r}")
        if where < last:
            wrong.append(f"{cell} comes after a row of a later layer")
        last = max(last, where)
    assert not wrong, wrong


def test_the_version_is_pyprojects() -> None:
    import tomllib

    from convit_convert import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["version"] == __version__


def test_architecture_md_and_the_package_docstrings_name_every_module() -> None:
    """docs/ARCHITECTURE.md's table has a row naming each module (top-level ones as `x.py`, those of
    io/ and onnx/ as `io/x.py`, those of api/, train/ and cli/ in their package's row), and each
    subpackage's docstring names each of its modules and none that is not there."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    table = [line for line in doc.splitlines() if line.startswith("| ")]
    row = {p: next(r for r in table if f"| `{p}/` |" in r) for p in ("api", "train", "cli")}
    missing = [f"{m}.py" for m in _modules(ROOT / "convit_convert") if f"`{m}.py`" not in doc]
    missing += [
        f"{p}/{m}.py"
        for p in ("io", "onnx")
        for m in _modules(ROOT / "convit_convert" / p)
        if f"`{p}/{m}.py`" not in doc
    ]
    folders = {
        "api": ROOT / "convit_convert" / "api",
        "train": ROOT / "train",
        "cli": ROOT / "convit_convert" / "cli",
    }
    for p, folder in folders.items():
        missing += [
            f"{p}/{m}.py" for m in _modules(folder) if f"`{m}.py`" not in row[p] and f"`{m}`" not in row[p]
        ]
    assert not missing, f"docs/ARCHITECTURE.md's table lacks {missing}"
    wrong = []
    for folder in [ROOT / "train", *(ROOT / "convit_convert" / p for p in ("api", "io", "onnx", "cli"))]:
        text = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
        named = {a or b for a, b in re.findall(r":mod:`\.(\w+)`|`(\w+)\.py`", text)}  # how they name modules
        wrong += [f"{folder.name}/__init__.py names {n}.py" for n in sorted(named - set(_modules(folder)))]
        wrong += [f"{folder.name}/__init__.py omits {m}.py" for m in sorted(set(_modules(folder)) - named)]
    assert not wrong, wrong


def test_the_step_in_reading_order_names_code_that_exists() -> None:
    """train/__init__.py walks one training step through the functions that run it: each name it
    gives (``module.name``, ``module.Class.method``) is in that module."""
    import importlib

    text = ast.get_docstring(ast.parse((ROOT / "train" / "__init__.py").read_text(encoding="utf-8"))) or ""
    names = re.findall(r"``([a-z_]+(?:\.[A-Za-z_]+)+)``", text.split("One step", 1)[1])
    assert len(names) >= 9, names
    for name in (n for n in names if not n.endswith(".py")):
        module, *attrs = name.split(".")
        obj = importlib.import_module(f"convit_convert.train.{module}")
        for a in attrs:
            assert hasattr(obj, a), name
            obj = getattr(obj, a)
