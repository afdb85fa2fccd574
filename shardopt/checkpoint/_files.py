"""The files of a checkpoint directory (manifest, completion marker, atomic commit, listing), and
the agreement of ranks on errors around them.

Knows nothing of torch.distributed: every function but ``agree`` and ``claim`` runs in one
process (the converter uses them with no process group at all); those two go through the
optimizer's ``Comm``.

[Note: a checkpoint is complete only when its marker says so]
A checkpoint is written into ``PATH.tmp-TOKEN`` (TOKEN shared by all ranks). Every rank writes
its tensor files there and a CRC-32 of each (streamed, right after writing); when all have
finished, rank 0 writes ``complete.json`` last, listing every file of the checkpoint with its
size, those CRCs and a SHA-256 of the small metadata files, fsyncs it, and renames the directory
to ``PATH`` in one ``rename``. So:

* a save that dies at any point (a rank killed, a full disk, a power cut) leaves at most a
  ``*.tmp-*`` directory that nothing mistakes for a checkpoint, and ``PATH`` untouched if it held
  an earlier checkpoint;
* ``check_complete`` refuses a directory without the marker, or whose listed files are missing
  or have another size, naming the file; ``verify_data`` (which ``load_checkpoint`` runs, each
  rank on its share of the files, before anything is modified) refuses a tensor file whose
  content no longer matches its CRC, so flipped bytes of the same size are caught;
* overwriting an existing ``PATH`` moves the old one to ``PATH.old-TOKEN`` just before the
  final rename and deletes it just after. See [Note: a kill between the renames of a commit].

[Note: a kill between the renames of a commit]
A directory cannot replace a non-empty one in one ``rename``, so an overwrite has an instant at
which ``PATH`` does not exist: after ``PATH -> PATH.old-TOKEN``, before ``PATH.tmp-TOKEN -> PATH``.
A process killed there leaves two complete checkpoints under names that are not checkpoints.
``recover(PATH)`` finishes such a commit: where ``PATH`` is missing and a complete ``PATH.tmp-*``
or ``PATH.old-*`` exists, it renames the new one (a complete ``tmp``: its marker was written
before the first rename), or else the old one, to ``PATH``. ``list_checkpoints``,
``latest_checkpoint``, ``load_checkpoint`` and ``save_checkpoint`` run it first, so at every
instant a process can be killed, the names they find hold a complete checkpoint. It is safe from
several processes at once (every rank of a restarted job lists the same directory): each step is
one ``rename``, which fails when its source is gone or ``PATH`` exists (another process was
first), and a failed one is taken as that. Where the rename cannot be made (a read-only
directory), the complete leftover itself is listed and loaded. A save that commits also finds
commits that are in flight from another process's view: its own final rename, done by another
process, counts as done (the marker names its token). The next successful save removes the
leftovers of interrupted saves: every ``*.tmp-*`` and ``*.old-*`` beside its ``PATH`` that no
save is writing (older than this save), and that is not the only copy of a checkpoint. Two jobs
must not save into one directory at once.

[Note: how a checkpoint path is written]
A checkpoint is a directory named by the path's last component: a save writes beside it
(``PATH.tmp-TOKEN``) and renames that to ``PATH``; listing finds it by that name. So every public
function that takes a path (``save_checkpoint``, ``load_checkpoint``, ``list_checkpoints``,
``latest_checkpoint``) first writes it one way (``checkpoint_path``), and returns paths in that
form. ``~`` is expanded: these functions create directories, and a directory named ``~`` in the
working directory is never what was meant (fsspec, under Lightning's checkpoint IO, expands it
too; ``open`` and ``torch.save`` do not, but they create no parents). The components are kept as
``pathlib`` keeps them: a trailing ``/``, ``./`` and a doubled ``/`` go, ``..`` stays (where ``a``
is a symlink, ``a/..`` is not where dropping both would lead), a relative path stays relative. A
path that ends in ``.`` or ``..`` names no directory of its own and is made absolute. Taken as
written, ``ckpt/step_1/`` made a save write into ``ckpt/step_1/.tmp-TOKEN``, which cannot be
renamed into its own parent; a directory holding nothing but such leftovers is replaced by the
next save to it (``check_replaceable``) instead of being refused as foreign.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import time
import zlib
from typing import TYPE_CHECKING, Any

import torch

from shardopt.core._compat import default_store

if TYPE_CHECKING:
    from shardopt.comm._collectives import Comm

FORMAT = "shardopt.checkpoint.v1"
MANIFEST = "shardopt.json"  # step, hyperparameters, parameter table (JSON, human-readable)
MARKER = "complete.json"  # written last; its presence makes the directory a checkpoint
EXTRA = "extra.pt"  # the caller's ``extra`` object (torch.save), optional
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of every tensor chunk
_HASHED = (MANIFEST, DCP_METADATA, EXTRA)  # small files whose content the marker pins down
_TEMP = re.compile(r"\.(tmp|old)-[0-9a-f]+$")


# what a peer's error is raised as here: the nearest of these classes its class derives from (any
# other: RuntimeError); an OSError keeps its errno (see ``restated``)
_ERRORS = {cls.__name__: cls for cls in (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                                         NotADirectoryError, OSError, ValueError, TypeError, TimeoutError,
                                         torch.OutOfMemoryError, RuntimeError, MemoryError)}


def described(error: BaseException) -> tuple[str, str, int | None]:
    """What a peer needs to raise ``error`` again (``restated``): the name of the nearest class of
    ``_ERRORS`` it is an instance of (else ``"RuntimeError"``), ``"Class: message"``, and its errno
    (an OSError's; else None). Picklable. Local."""
    kind = next((c.__name__ for c in type(error).__mro__ if _ERRORS.get(c.__name__) is c), "RuntimeError")
    errno = error.errno if isinstance(error, OSError) and isinstance(error.errno, int) else None
    return kind, f"{type(error).__name__}: {error}", errno


def restated(info: tuple[str, str, int | None], message: str) -> Exception:
    """The exception to raise here for another rank's error ``info`` (``described``) with ``message``:
    of its class, and an OSError with its errno (a plain OSError of a known errno as its subclass:
    ``ENOSPC`` stays ``OSError``, ``EACCES`` becomes ``PermissionError``), so that a caller's
    ``except OSError`` and checks of ``e.errno`` see on every rank what the failing rank saw. Local."""
    kind, _, errno = info
    cls = _ERRORS.get(kind, RuntimeError)
    if cls is OSError and errno is not None:
        cls = type(OSError(errno, ""))  # Python's own subclass for that errno, if it has one
    error = cls(message)
    if isinstance(error, OSError):
        error.errno = errno
    return error


def agree(comm: Comm, error: BaseException | None, payload: Any = None) -> list:
    """Every rank's ``payload``, unless some rank had an error: then every rank raises (its own
    error, or the first peer's, naming that rank, as ``restated`` makes it: of the nearest class of
    ``_ERRORS``, an OSError with its errno).

    One small all-gather through ``comm`` (a ``shardopt.comm._collectives.Comm``); all ranks must call
    it. A rank's local error thus never leaves its peers waiting in the next collective. A rank
    that gave up on the others (``Comm.gave_up``: a collective failed, and its error says so)
    raises its error without a message: it can no longer agree with them."""
    if error is not None and comm.gave_up():
        raise error
    info = None if error is None else described(error)
    gathered = comm.all_gather_objects((payload, info))
    if error is not None:
        raise error
    for r, (_, e) in enumerate(gathered):
        if e is not None:
            raise restated(e, f"on rank {r}: {e[1]}")
    return [p for p, _ in gathered]


def claim(path: str, comm: Comm) -> None:
    """Claim ``path`` for the ranks of ``comm`` (the group that saves there), in the default store,
    for the rest of the job; raises ValueError naming both groups when another group of ranks
    claimed it (see checkpoint [Note: one checkpoint for every part of the model]), and as
    ``Comm.collective_failed`` when the store cannot be reached (its host, rank 0 under a plain
    launch, died). Every rank of the group; does nothing without a default store."""
    store = default_store()
    if store is None:
        return
    mine = ",".join(map(str, comm.global_ranks))
    try:
        held = store.compare_set(f"shardopt-save/{os.path.abspath(path)}", "", mine)
    except RuntimeError as e:  # torch's DistNetworkError (a connection reset), or the store's timeout
        comm.collective_failed(e, "the default store, claiming the checkpoint's path", source="store")
    held = held.decode() if isinstance(held, bytes) else str(held)
    if held != mine:
        raise ValueError(f"save_checkpoint({path!r}) on ranks [{mine}], but ranks [{held}] saved to this path "
                         "before in this job: two groups of ranks would replace each other's checkpoint (each "
                         "data-parallel group of a model split over tensor- or pipeline-parallel ranks holds only "
                         "its part). Pass model_parallel_group= (or use DTensor parameters) so that every rank "
                         "saves into one checkpoint, or give each group its own path")


def checkpoint_path(path: str | os.PathLike) -> str:
    """``path`` as every checkpoint function takes it (see [Note: how a checkpoint path is written]).
    Local."""
    written = pathlib.PurePath(os.path.expanduser(os.fspath(path)))
    if written.name in ("", ".."):  # ".", "..", "a/..", "/": no name of its own for the checkpoint
        written = pathlib.PurePath(os.path.abspath(written))
    return str(written)


def find_checkpoint(path: str | os.PathLike) -> str:
    """Where the checkpoint that ``path`` names is: ``path`` written as ``checkpoint_path`` writes
    it, after finishing a commit to it that a kill interrupted (``recover``). Raises
    FileNotFoundError, naming the latest, when ``path`` is a directory that holds checkpoints
    rather than one (``ckpt`` for ``ckpt/step_000200``). What ``load_checkpoint`` and the
    converter read; checking the result is ``check_complete``'s. Local."""
    path = checkpoint_path(path)
    found = recover(path) or path
    if os.path.isdir(found) and not os.path.exists(os.path.join(found, MARKER)):
        latest = latest_checkpoint(found)
        if latest is not None:
            raise FileNotFoundError(f"{path} is not a checkpoint but a directory of {len(list_checkpoints(found))} "
                                    f"(no {MARKER} of its own): pass one of them, e.g. the latest, {latest} "
                                    f"(shardopt.latest_checkpoint({path!r}))")
    return found


def temp_path(path: str, token: str) -> str:
    """Where a save to ``path`` writes before it commits."""
    return f"{path}.tmp-{token}"


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` durably: temporary file, fsync, rename."""
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def crc32(path: str) -> int:
    """CRC-32 of the file at ``path``, streamed in 4 MiB blocks."""
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def data_checksums(tmp: str, rank: int) -> dict[str, int]:
    """CRC-32 of each tensor file rank ``rank`` wrote into ``tmp`` (DCP names them ``__RANK_*``)."""
    return {name: crc32(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))
            if name.startswith(f"__{rank}_") and name.endswith(".distcp")}


def verify_data(path: str, info: dict, rank: int = 0, world_size: int = 1) -> None:
    """Raise ValueError naming the first tensor file of the checkpoint at ``path`` (``info``: its
    marker) whose content does not match its recorded CRC; this rank checks every
    ``world_size``-th file, starting at its ``rank``. Checkpoints saved without CRCs pass."""
    crcs = sorted(dict(info.get("crc32", {})).items())
    for name, value in crcs[rank::world_size]:
        full = os.path.join(path, name)
        if crc32(full) != value:
            raise ValueError(f"checkpoint {path} is corrupt: {full} does not match the checksum recorded when it "
                             "was saved (its size is unchanged: the content was altered); load an earlier checkpoint")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_replaceable(path: str) -> None:
    """Raise FileExistsError unless ``path`` is absent, a checkpoint (which a save may replace), or
    a directory that holds nothing but leftovers of saves to ``path/`` (see [Note: how a checkpoint
    path is written]), or nothing at all: a save never deletes anything else."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and (os.path.isfile(os.path.join(path, MARKER)) or all(
            _TEMP.fullmatch(name) and os.path.isdir(os.path.join(path, name)) for name in os.listdir(path))):
        return
    raise FileExistsError(f"{path} exists and is not a shardopt checkpoint; refusing to replace it")


def commit(tmp: str, path: str, token: str, crcs: dict[str, int] | None = None, started: float | None = None) -> None:
    """Mark ``tmp`` complete (with every rank's ``data_checksums``, merged), rename it to ``path``
    and remove the leftovers of earlier interrupted saves beside it that are older than
    ``started`` (``time.time()`` when this save began). Rank 0 only, after every rank has written.

    See [Note: a checkpoint is complete only when its marker says so]."""
    files = {}
    for name in sorted(os.listdir(tmp)):
        full = os.path.join(tmp, name)
        if os.path.isfile(full) and name != MARKER and not name.endswith(".partial"):
            files[name] = os.path.getsize(full)
    if DCP_METADATA not in files or MANIFEST not in files:
        raise RuntimeError(f"checkpoint {tmp} lacks {DCP_METADATA} or {MANIFEST} after every rank finished writing")
    sha = {name: _sha256(os.path.join(tmp, name)) for name in _HASHED if name in files}
    recover(path)  # an earlier commit to path that a kill interrupted is finished first (tmp is not complete yet)
    write_json(os.path.join(tmp, MARKER), {"format": FORMAT, "files": files, "sha256": sha, "crc32": crcs or {},
                                           "token": token})
    _fsync_dir(tmp)
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except FileNotFoundError:  # another process's recover() made this rename: see the Note
        if _token(path) != token:
            raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    remove_leftovers(os.path.dirname(os.path.abspath(path)), time.time() if started is None else started)


def _token(path: str) -> str | None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f).get("token")
    except (OSError, ValueError, AttributeError):
        return None


def _leftovers(path: str) -> list[str]:
    """The ``*.tmp-*`` and ``*.old-*`` directories beside ``path`` left by saves to it, by name."""
    parent, base = os.path.split(os.path.abspath(path))
    if not os.path.isdir(parent):
        return []
    return sorted(os.path.join(parent, n) for n in os.listdir(parent)
                  if n.startswith(base + ".") and _TEMP.fullmatch(n[len(base):]) and os.path.isdir(os.path.join(parent, n)))


def _saved_step(path: str) -> int:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return int(json.load(f).get("step", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return -1


def recover(path: str) -> str | None:
    """Where the checkpoint of ``path`` is after finishing a commit to ``path`` that a kill
    interrupted between its renames: ``path`` itself, or (where the rename cannot be made) the
    complete leftover that holds it; None where there is none. Local; safe from several processes
    at once. See [Note: a kill between the renames of a commit]."""
    if os.path.isdir(path):
        return path
    complete = [c for c in _leftovers(path) if is_complete(c)]
    if not complete:
        return None
    # The save being committed (tmp) before the checkpoint it replaces (old); then the newest step.
    chosen = max(complete, key=lambda c: (".tmp-" in os.path.basename(c), _saved_step(c), c))
    try:
        os.rename(chosen, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError:
        pass  # another process was first, or the directory cannot be written
    return path if os.path.isdir(path) else chosen


def remove_leftovers(parent: str, before: float) -> list[str]:
    """Remove from ``parent`` the ``*.tmp-*`` / ``*.old-*`` directories of interrupted saves last
    changed before ``before`` (seconds since the epoch) that hold no checkpoint found nowhere else
    (incomplete ones, and complete ones beside their committed checkpoint); returns their paths.
    Local: rank 0 of a save that just committed."""
    removed = []
    for name in sorted(os.listdir(parent)):
        full, m = os.path.join(parent, name), _TEMP.search(name)
        if m is None or not os.path.isdir(full):
            continue
        try:
            if os.path.getmtime(full) >= before:
                continue  # a save in flight (another job's): not ours to touch
        except OSError:
            continue
        if is_complete(full) and recover(os.path.join(parent, name[:m.start()])) in (None, full):
            continue  # the only copy of that checkpoint
        shutil.rmtree(full, ignore_errors=True)
        removed.append(full)
    return removed


def missing_checkpoint_message(path: str) -> str:
    """Why ``path`` is not a checkpoint, naming what is missing and what else is there."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    base = os.path.basename(os.path.abspath(path))
    leftovers = sorted(n for n in os.listdir(parent) if n.startswith(base + ".")) if os.path.isdir(parent) else []
    msg = f"no checkpoint at {path}: the directory does not exist"
    old = [n for n in leftovers if ".old-" in n and is_complete(os.path.join(parent, n))]
    if old:
        msg += f"; an overwrite was interrupted and left the previous checkpoint at {os.path.join(parent, old[-1])}"
    elif leftovers:
        msg += f" (only incomplete saves: {', '.join(leftovers)})"
    return msg


def check_complete(path: str) -> dict:
    """The marker of the checkpoint at ``path``; raises if the checkpoint is partial or corrupt.

    FileNotFoundError names the missing directory or file (a save that did not finish lacks
    ``complete.json``); ValueError names a file whose size or checksum differs from the marker's."""
    if not os.path.isdir(path):
        raise FileNotFoundError(missing_checkpoint_message(path))
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise FileNotFoundError(f"checkpoint {path} is incomplete: {marker} is missing (its save was interrupted "
                                "or is still running); load an earlier checkpoint, e.g. "
                                "shardopt.latest_checkpoint(<its parent directory>)")
    try:
        with open(marker) as f:
            info = json.load(f)
        files, sha = dict(info["files"]), dict(info.get("sha256", {}))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {path} is corrupt: cannot read {marker}: {e}") from e
    if info.get("format") != FORMAT:
        raise ValueError(f"{path} is not a shardopt checkpoint of format {FORMAT!r} (its marker says "
                         f"{info.get('format')!r})")
    for name, size in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"checkpoint {path} is incomplete: {full} is missing")
        if os.path.getsize(full) != size:
            raise ValueError(f"checkpoint {path} is corrupt: {full} has {os.path.getsize(full)} bytes, the marker "
                             f"recorded {size}")
    for name, digest in sha.items():
        if _sha256(os.path.join(path, name)) != digest:
            raise ValueError(f"checkpoint {path} is corrupt: {os.path.join(path, name)} does not match its checksum")
    return info


def read_manifest(path: str, marker: dict | None = None) -> dict:
    """The manifest of the complete checkpoint at ``path`` (raises as ``check_complete`` does,
    unless its ``marker`` from ``check_complete`` is given)."""
    if marker is None:
        check_complete(path)
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} has a manifest of format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def is_complete(path: str) -> bool:
    """True when ``path`` is a complete, uncorrupted checkpoint (see ``check_complete``)."""
    try:
        check_complete(path)
    except (FileNotFoundError, ValueError):
        return False
    return True


def list_checkpoints(root: str | os.PathLike) -> list[str]:
    """Complete checkpoints directly under ``root``, oldest first (by saved step, then name), as
    ``os.path.join(root, name)`` with ``root`` written as in [Note: how a checkpoint path is written].

    A commit that a kill interrupted between its renames is finished first (see [Note: a kill
    between the renames of a commit]); then interrupted saves (``*.tmp-*``), leftovers of
    overwrites (``*.old-*``) and anything without a valid marker are skipped. Local; no
    communication; every rank may call it at once."""
    root = checkpoint_path(root)
    if not os.path.isdir(root):
        return []
    held = set()  # leftovers that hold a checkpoint they could not be renamed back to
    for name in sorted(os.listdir(root)):
        m = _TEMP.search(name)
        if m is not None and not os.path.exists(os.path.join(root, name[:m.start()])):
            where = recover(os.path.join(root, name[:m.start()]))
            if where is not None and _TEMP.search(where):
                held.add(os.path.basename(where))
    found = []
    for name in os.listdir(root):
        full = os.path.join(root, name)
        if (_TEMP.search(name) and name not in held) or not os.path.isdir(full) or not is_complete(full):
            continue
        step = _saved_step(full)
        if step >= 0:
            found.append((step, name, full))
    return [full for _, _, full in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The complete checkpoint under ``root`` with the highest step, or None. Local; no communication."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_extra(path: str) -> Any:
    """The ``extra`` object saved with the checkpoint at ``path`` (None when none was); ValueError
    when ``torch.load(weights_only=True)`` cannot read it back. Local."""
    import pickle

    extra_path = os.path.join(path, EXTRA)
    if not os.path.exists(extra_path):
        return None
    try:
        return torch.load(extra_path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{extra_path} cannot be read back with torch.load(weights_only=True) ({first}); nothing "
                         "was loaded") from None
