"""Every private name of another library cmhsa touches is guarded and listed (GUARDED), so a release
of that library without it is survived.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from conftest import (
    ROOT,
    in_a_process,
)


def test_private_attributes_cmhsa_uses_are_guarded(tmp_path: Path, monkeypatch) -> None:
    # catches: `from typer._click.core import Context` (typer 0.12 to 0.20: ModuleNotFoundError for every
    # command, --help included); atexit._run_exitfuncs and torch's _SIGCHLD_handler_set unguarded
    code = (
        "import atexit, sys\ndel atexit._run_exitfuncs\nfrom convit_convert.cli import main\n"
        "sys.argv = ['cmhsa', 'heads', '--kernel-size', '3', '--patch-size', '2']\nmain()\n"
    )
    r = in_a_process("-c", code, env={**os.environ, "PYTHONPATH": str(ROOT)})
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
    ("cli/common.py", "super()._render_buffer"): (
        "an override rich alone calls: a release without it never calls it (the console's guard is then "
        "lost, which test_foreign_text.py's corpus test says)"
    ),
    ("cli/options.py", "param._usage_display_name"): "set only where callable(getattr(...)) finds it",
    ("cli/options.py", "getattr(param, '_usage_display_name', None)"): "that getattr",
    ("train/run.py", "from torch.utils.data._utils"): "imported in a try: ImportError skips the marking",
    ("train/run.py", "getattr(signal_handling, '_SIGCHLD_handler_set', None)"): "getattr, tested above",
    ("train/run.py", "signal_handling._SIGCHLD_handler_set"): "written only after the getattr found it",
    ("train/step.py", "torch._dynamo"): "config.patch, for one compiled call (step.with_autograd_traced)",
    ("train/mixing.py", "getattr(mixup, '_params_per_batch', None)"): (
        "drawable(): without it a stack mixes each seed by timm's own call (test_stacked.py)"
    ),
    ("train/mixing.py", "getattr(mixup, '_params_per_batch')"): "called only where drawable() found it",
    ("timm.py", "from timm.models._builder"): "imported in _features: features_only alone needs it",
    ("train/profiling.py", "from torch.utils._python_dispatch"): (
        "imported in a try; only the tests and bench/ count ops with it (no command imports it)"
    ),
    ("shipped/modeling_cmhsa.py", "getattr(p, '_is_hf_initialized', False)"): (
        "getattr with a default: under a transformers without the flag a tensor the weights lack is "
        "initialised, then transformers' own report refuses it (the early refusal alone is lost)"
    ),
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
