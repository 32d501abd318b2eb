"""Reading a W&B offline run back without network: the ``run-<id>.wandb`` transaction log parsed with
wandb's own protobuf records (wandb has no Python reader of its own). ``trainer.wandb_panels`` closes a run
with ``wait_for_transaction_log``: ``wandb.finish()`` returns before the service has written the log out."""
from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path


def _wandb_records(path: Path):
    """Raw records of a ``run-<id>.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log blocks of 32 KiB holding chunks with a 7-byte header (crc32 of type + data, IEEE, unmasked;
    length; type: 1 full, 2 first, 3 middle, 4 last); a block tail shorter than a chunk header is zero
    padding. Stops at the first chunk that is cut short or fails its CRC: the end of a log that is still
    being written (wandb-core writes it in 32 KiB blocks and the rest when the run's stream closes)."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log")
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length or zlib.crc32(bytes([kind]) + chunk) != crc:
            return
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        else:
            raise ValueError(f"{path}: bad chunk type {kind} at byte {pos - 7 - length}")


def _record_kinds(log: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    for raw in _wandb_records(log):
        rec = pb.Record()
        rec.ParseFromString(raw)
        yield rec.WhichOneof("record_type")


def _log_finished(log: Path) -> bool:
    """Whether ``log`` (a ``run-<id>.wandb`` file) holds the run's exit record, its last: written out whole."""
    try:
        return any(kind == "exit" for kind in _record_kinds(log))
    except (OSError, ValueError):
        return False


def wait_for_transaction_log(log: Path, timeout_s: float) -> bool:
    """Wait until W&B's service has written ``log`` out to its exit record (True), or ``timeout_s`` passed.

    ``wandb.finish()`` returns once the service has handled the exit record, but the transaction log is
    written through a buffer of 32 KiB blocks that the service flushes only when it closes the run's stream,
    after the ``inform_finish`` message that ``finish()`` sends without waiting for an answer. So a reader
    right after ``finish()`` can find only the file header (seen under load: 3 of 5 runs). A log the service
    does not write (``x_skip_transaction_log``) is not waited for."""
    end = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        if not log.exists() or _log_finished(log):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(delay)
        delay = min(0.2, delay * 2)


def offline_run_finished(run_dir: str | Path) -> bool:
    """Whether the offline run dir's ``run-<id>.wandb`` is complete (holds its exit record)."""
    files = list(Path(run_dir).glob("run-*.wandb"))
    return len(files) == 1 and _log_finished(files[0])


def read_offline_run(run_dir: str | Path) -> tuple[list[dict], dict]:
    """``(history, summary)`` of an offline run dir (``.../wandb/offline-run-*``): one dict per logged
    step (``_step``, metric names; media such as images as dicts with ``_type`` and ``path``), and the
    final summary. A log still being written (or cut short by a kill) reads up to its last whole record;
    ``offline_run_finished`` says whether the run's exit record is there."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir = Path(run_dir)
    files = list(run_dir.glob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"{run_dir}: expected one run-*.wandb file, found {len(files)}")

    def put(row: dict, item) -> None:
        keys = list(item.nested_key) or [item.key]
        node = row
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = json.loads(item.value_json)

    history, summary = [], {}
    for raw in _wandb_records(files[0]):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in rec.history.item:
                put(row, item)
            history.append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                put(summary, item)
    return history, summary

