"""``--report-to tensorboard``: a run's numbers as TensorBoard event files in its folder's
``tensorboard/``, for ``tensorboard --logdir RUN`` (a ``--seeds`` run: one folder per seed, each a
run that TensorBoard overlays).

    step/loss, step/lr, step/images_per_s      at each read-out (x: the optimizer's update)
    epoch/<every metrics.csv column>            at each epoch's end: train_loss, val_loss, top1,
                                                top5, lr, the EMA's, each block's gate and attention
                                                distance (attn_*)
    config                                      the run's config.json, as text, at its first step

The events are tensorboard's own protocol buffers in its record format (tensorboard's
RecordWriter), written to a file created by name in the held run folder (never through a link, as
every output of a run), flushed at each write. A resumed run writes a new file that begins with a
session start at its step, so TensorBoard drops what an earlier file holds from that step on: the
curves go on without duplicates. Nothing here reads the device: the numbers are the read-outs'.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from ..errors import CmhsaError
from ..io.folder import Folder

EVENTS = "tensorboard"  # the folder in the run's
NAME = re.compile(
    r"events\.out\.tfevents\.\d+\.cmhsa\.\d+"
)  # the files cmhsa writes there (TensorBoard's form)
INSTALL = "`report_to` tensorboard needs tensorboard: pip install tensorboard (cmhsa's `tensorboard` extra)"


def check_installed() -> None:
    """A one-line CmhsaError, before a run starts, where tensorboard cannot be imported."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise CmhsaError(INSTALL)


class Board:
    """One event file of a run, in ``folder``'s ``tensorboard/`` (made by name if missing), its
    first record the file version and, where the run resumes at ``step`` > 0, a session start there."""

    def __init__(self, folder: Folder, step: int, config_json: str) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError:
            raise CmhsaError(INSTALL) from None
        self.event_pb2, self.summary_pb2 = event_pb2, summary_pb2
        with folder.enter(EVENTS, create=True) as events:
            name = (
                f"events.out.tfevents.{time.time_ns() // 1000}.cmhsa.{os.getpid()}"  # microseconds: in order
            )
            self.records = RecordWriter(events.open_append(name))
        self.write(event_pb2.Event(file_version="brain.Event:2"))
        if step > 0:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self.write(event_pb2.Event(step=step, session_log=start))
        self.text("config", f"```json\n{config_json.strip()}\n```", step)

    def write(self, event: Any) -> None:
        event.wall_time = event.wall_time or time.time()
        self.records.write(event.SerializeToString())
        self.records.flush()

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        """``values`` (tag -> number; others left out) at ``step``, one event."""
        summary = self.summary_pb2.Summary(
            value=[
                self.summary_pb2.Summary.Value(tag=tag, simple_value=float(v))
                for tag, v in values.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            ]
        )
        self.write(self.event_pb2.Event(step=step, summary=summary))

    def text(self, tag: str, text: str, step: int) -> None:
        """``text`` (Markdown) under ``tag``, as TensorBoard's text plugin reads it."""
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text import metadata

        shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)])
        tensor = tensor_pb2.TensorProto(dtype="DT_STRING", string_val=[text.encode()], tensor_shape=shape)
        value = self.summary_pb2.Summary.Value(
            tag=tag, metadata=metadata.create_summary_metadata(tag, ""), tensor=tensor
        )
        self.write(self.event_pb2.Event(step=step, summary=self.summary_pb2.Summary(value=[value])))

    def close(self) -> None:
        self.records.close()
