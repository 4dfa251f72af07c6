"""The ``cmhsa`` command line: one thin module per command group, rendering the library's reports
(`convert.py`: convert, verify, inspect, heads; `export.py`; `train.py`: train; `evaluate.py`:
eval, attention, plot; `predict.py`), with the one error boundary (`boundary.py`), the numeric
flags' checks (`bounds.py`), the console and renderers (`common.py`), the shared options
(`options.py`) and the progress bars (`progress.py`).

Start-up matters: nothing here imports torch or timm at import time, so ``cmhsa --help`` and
``cmhsa heads`` stay fast; each command imports what it needs when it runs.
"""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from ..version import __version__
from . import convert, evaluate, export, predict, train
from .boundary import BoundaryGroup, set_debug
from .bounds import bound_all
from .common import console

app = typer.Typer(
    cls=BoundaryGroup,
    name="cmhsa",
    help="Turn trained convolutional ViTs into exactly equivalent self-attention ViTs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for group in (convert, export, train, evaluate, predict):
    app.registered_commands += group.app.registered_commands
    app.registered_groups += group.app.registered_groups
bound_all(app)  # every numeric flag checked against its declared range (cli/bounds.py)


def version_callback(value: bool) -> None:
    if value:
        console.print(f"cmhsa {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=version_callback, is_eager=True, help="Print the version.")
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the full traceback of an error (also: CMHSA_DEBUG=1).")
    ] = False,
) -> None:
    """cmhsa: exact conv -> self-attention conversion ("Can Vision Transformers Perform Convolution?")."""
    set_debug(debug)


def main() -> None:
    """The ``cmhsa`` program: the app, then an exit whose code says whether SIGINT or SIGTERM came."""
    from .boundary import exit_on_sigterm, exit_status, output_lost, tolerate_gone_readers

    tolerate_gone_readers()  # a broken pipe ends quietly; other output lost is said once, at the end
    exit_on_sigterm()  # a killed convert/export unwinds and removes its temp files (training traps it first)
    code: object = 0
    try:
        app()
    except SystemExit as e:
        code = e.code
    code = output_lost(exit_status(code))
    import atexit
    import os
    import sys

    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)  # private: os._exit would skip them
    if run_exit_handlers is not None:
        run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)  # not the interpreter's teardown: a signal there would kill it with no code of ours
