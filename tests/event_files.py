"""The tests' one reader of a run's TensorBoard event files: scalars as TensorBoard shows them."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator


def read_events(path: Path) -> Iterator:
    """The events of one file, from the TFRecord framing (length, crc, data, crc); a record cut short (a
    SIGKILL mid-write) ends the file, as TensorBoard skips it too."""
    from tensorboardX.proto import event_pb2

    data, offset = path.read_bytes(), 0
    while offset + 12 <= len(data):
        length = int.from_bytes(data[offset:offset + 8], "little")
        if offset + 12 + length + 4 > len(data):
            return
        yield event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
        offset += 12 + length + 4


def event_files(run_dir) -> list[Path]:
    """The run directory's event files (not its subfolders', e.g. hparams) in name order, which is the order
    TensorBoard reads them in and the order they were written (``train_math.open_writer`` names each by
    the second it was opened and a nanosecond suffix); not the file system's listing order, which can
    put a resumed run's file first."""
    return sorted(Path(run_dir).glob("events.out.tfevents.*"))


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of a run directory as TensorBoard shows them: the event files in the order they
    were written, and a SessionLog START at step s (a resumed writer's purge_step) drops the points read
    so far at steps >= s."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in event_files(run_dir):
        for event in read_events(path):
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                scalars = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in scalars.items()}
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
