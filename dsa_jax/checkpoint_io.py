"""Checkpoint files: atomic orbax writes and per-array checksums (used by `checkpoint.py`).

Atomic: a checkpoint is written complete into a hidden folder beside its destination
(`.<name>.dsa_jax-tmp-<id>`) and only then renamed into place. Replacing an existing one
renames the old aside (`.<name>.dsa_jax-old-<id>`), renames the new into place and only then
deletes the old: a save that fails at any point, or is killed, never costs the old checkpoint
(a kill between the two renames, a window of two system calls, leaves the complete old
checkpoint in its `-old-` folder beside the path). A failed save removes what it wrote.

Checksums: the SHA-256 of every stored array's bytes, keyed by its path in the pytree
(`layers/0/latent`, `extra/lengths`), are stored in the metadata and compared on restore, so
a changed data byte fails the restore with the array's name instead of restoring other values.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import sys
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dsa_jax.errors import CheckpointError

# Extra (host metadata) arrays must be numbers or bools: orbax stores nothing else.
STORABLE_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


@contextlib.contextmanager
def checkpointer():
    """A synchronous composite checkpointer, closed afterwards."""
    ocp = _ocp()
    ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        yield ckptr
    finally:
        ckptr.close()


def leaves(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict of arrays -> {"a/b/c": array}."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(leaves(value, name + "/"))
        else:
            out[name] = value
    return out


def storable(a) -> bool:
    """An array orbax can store bit for bit: numbers or bools."""
    dtype = np.dtype(a.dtype)
    return dtype.kind in "biuf" or dtype.name in STORABLE_DTYPES


def check_live(tree: Mapping[str, Any]) -> None:
    """CheckpointError if any array was donated to a step (its buffer is gone)."""
    for name, a in leaves(tree).items():
        if isinstance(a, jax.Array) and a.is_deleted():
            raise CheckpointError(f"array {name} was donated to a step (or deleted): its "
                                  f"buffer is gone; save a state before passing it to a step "
                                  f"that donates it, or save the state that step returned")


def digest(a) -> str:
    """SHA-256 of an array's bytes (fetched to the host)."""
    host = np.ascontiguousarray(np.asarray(a))
    return "sha256:" + hashlib.sha256(host.view(np.uint8).reshape(-1)).hexdigest()


def _remove(paths) -> None:
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.remove(p)


def write_atomically(path: str, items: Mapping[str, Any]) -> None:
    """Write the orbax composite `items` (name -> `ocp.args.*Save`) as the checkpoint `path`,
    replacing an existing one only once the new one is complete (module docstring)."""
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tag = uuid.uuid4().hex[:12]
    tmp = os.path.join(parent, f".{base}.dsa_jax-tmp-{tag}")
    ocp = _ocp()
    try:
        with checkpointer() as ckptr:
            ckptr.save(tmp, args=ocp.args.Composite(**items))
        if not os.path.lexists(path):
            os.rename(tmp, path)
            return
        old = os.path.join(parent, f".{base}.dsa_jax-old-{tag}")
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
        _remove([old])
    finally:
        # Whatever this save left beside the path (orbax writes its own temporaries under
        # names that start with ours).
        _remove(glob.glob(glob.escape(tmp) + "*"))


def verify(path: str, restored: Mapping[str, Any], checksums: Mapping[str, str] | None
           ) -> None:
    """Every restored array's checksum equals the stored one (None: a version-1 checkpoint,
    written before checksums existed, which has none to compare)."""
    if checksums is None:
        return
    for name, a in leaves(restored).items():
        want = checksums.get(name)
        if want is None:
            raise CheckpointError(f"{path}: array {name} has no stored checksum; the "
                                  f"metadata does not match the arrays")
        got = digest(a)
        if got != want:
            raise CheckpointError(f"{path}: array {name}: checksum mismatch (saved "
                                  f"{want[:19]}..., read {got[:19]}...): its data changed on "
                                  f"disk after it was saved")


def _frames(tb):
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def _from_orbax_read(e: BaseException | None) -> bool:
    """Whether `e` (or what caused it) passed through orbax's code."""
    while e is not None:
        if any(f"{os.sep}orbax{os.sep}" in code.co_filename for code in _frames(e.__traceback__)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _is_stray_read(unraisable) -> bool:
    """What a failed orbax restore leaves behind in Python's unraisable-exception hook: a read
    that finished in a tensorstore thread after orbax closed the restore's event loop
    (asyncio's `RuntimeError('Event loop is closed')`, owned by no object), or one of orbax's
    read coroutines collected with its exception."""
    e, obj = unraisable.exc_value, unraisable.object
    codes = list(_frames(unraisable.exc_traceback))
    if (obj is None and type(e) is RuntimeError and str(e) == "Event loop is closed"
            and codes and codes[-1].co_name == "_check_closed"):
        return True
    code = getattr(obj, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


class _StrayReadFilter:
    """asyncio's "exception was never retrieved" for one of a failed orbax restore's reads."""

    def filter(self, record) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        return not ("never retrieved" in str(record.msg)
                    and (_from_orbax_read(e) or _tensorstore_read_error(e)))


def _tensorstore_read_error(e: BaseException | None) -> bool:
    """A tensorstore read's error set on its future from tensorstore's own threads: no Python
    frames, and the spec of the store it read in the message."""
    return e is not None and e.__traceback__ is None and "tensorstore_spec" in str(e)


def _quiet_stray_reads() -> None:
    """A failed orbax restore raises its first error (a `CheckpointError` here) while its
    other reads are still in flight in tensorstore's threads; as each finishes, Python prints
    it on stderr (a closed event loop, an orbax coroutine's exception, an asyncio future's
    "exception was never retrieved", an orbax coroutine never awaited), long tracebacks after
    the one-line error that already said what is wrong. This wraps `sys.unraisablehook`,
    adds a filter to the `asyncio` logger and one warnings filter for that coroutine, once
    per process, dropping exactly those; every other unraisable exception, asyncio record or
    warning goes where it went before."""
    import logging

    previous = sys.unraisablehook
    if getattr(previous, "_dsa_jax_quiet", False):
        return

    def hook(unraisable):
        if not _is_stray_read(unraisable):
            previous(unraisable)

    hook._dsa_jax_quiet = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_StrayReadFilter())
    # orbax's metadata read, dropped unawaited when the restore failed first (seen under load)
    warnings.filterwarnings("ignore", r"coroutine 'Store\._get_array_metadatas' was never "
                            r"awaited", RuntimeWarning)


def restore(path: str, items: Mapping[str, Any]) -> dict:
    """orbax composite restore of `items`; any failure to read is a CheckpointError (and the
    failed reads' stragglers stay off stderr: `_quiet_stray_reads`)."""
    ocp = _ocp()
    _quiet_stray_reads()  # before the restore: stragglers may arrive before its error does
    try:
        with checkpointer() as ckptr:
            return ckptr.restore(path, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax / tensorstore raise many types for damaged files
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path}: the stored arrays cannot be read "
                              f"({type(e).__name__}: {first[:300]})") from e
