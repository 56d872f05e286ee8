"""File helpers shared by the disk and shared-directory tiers (blocking; run them in a thread).

Directory layout::

    <root>/<group>/<chunk key hex>.kvc       one encoded chunk per file
    <root>/<group>/.tmp-<host>-<pid>-<rand>  a write in progress (ignored by readers)

Writes go to a unique temporary name in the destination directory and are renamed into place,
so readers on any host see either no file or a complete one. Readers never trust a file beyond
what its checksum proves; a torn or truncated file is caught by the codec.

Chunk files are never changed in place (written once, replaced by a rename, removed by an unlink),
so a reader may map one instead of copying it (:func:`map_or_none`): the mapping keeps the file's
pages even after it is replaced or removed. A read through a mapping cannot fail softly, though: a
file truncated in place by something else, or an I/O error of the disk under it, is a ``SIGBUS``
that ends the process, where a copying read raises an error the store turns into a miss. Mapping is
therefore the default only on memory-backed file systems (:func:`is_memory_fs`: ``/dev/shm``, the
common home of one host's shared directory), whose pages have no disk to fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import socket
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path

from kvmesh.core.hashing import hex_key
from kvmesh.store.keys import StoreKey, is_group

SUFFIX = ".kvc"
TMP_PREFIX = ".tmp-"
_HOST = socket.gethostname().replace("/", "_")


def chunk_path(root: Path, key: StoreKey) -> Path:
    return root / key.group / f"{hex_key(key.chunk)}{SUFFIX}"


def parse_chunk_path(group_dir: Path, name: str) -> StoreKey | None:
    """The key a file name encodes, or ``None`` for anything that is not a chunk file."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return StoreKey.parse(f"{group_dir.name}/{name[: -len(SUFFIX)]}")
    except ValueError:
        return None


def write_atomic(path: Path, data: bytes | bytearray | memoryview, *, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{_HOST}-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_or_none(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


MAP_MIN_BYTES = 1 << 20
"""Files smaller than this are copied: their allocation is cheap, and mappings are a bounded resource
(``vm.max_map_count``, 65,530 by default), one held for as long as its chunk is."""

_MAPPINGS: weakref.WeakValueDictionary[int, ctypes.Array[ctypes.c_char]] = weakref.WeakValueDictionary()
"""Live mappings by ``id`` (ctypes arrays are not hashable)."""


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(fd: int, size: int) -> memoryview | None:
    """A read-only mapping of ``size`` bytes of ``fd``, unmapped when the last view of it is gone;
    ``None`` when the system refuses one (then the caller copies).

    ``mmap.mmap`` keeps a duplicate of the file descriptor open for as long as the mapping lives
    (before Python 3.13), so every chunk on its way to a request would hold a descriptor too: the
    mapping is made through libc and the descriptor closed at once.
    """
    if _LIBC is None:
        return None
    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    region = (ctypes.c_char * size).from_address(addr)
    # Not at interpreter exit: daemon threads may still read the mapping then; the system unmaps
    # everything when the process ends.
    weakref.finalize(region, _LIBC.munmap, addr, size).atexit = False
    _MAPPINGS[id(region)] = region
    return memoryview(region).cast("B").toreadonly()


def is_mapping(value: bytes | memoryview) -> bool:
    """Whether ``value`` is a view of a chunk file mapped by :func:`map_or_none`."""
    return isinstance(value, memoryview) and value.readonly and _MAPPINGS.get(id(value.obj)) is value.obj


def map_or_none(path: Path) -> bytes | memoryview | None:
    """The file's bytes, mapped rather than copied where it is large (``None``: no such file).

    Reading a chunk through a copy costs a fresh allocation per chunk, whose page faults cost more
    than the copy itself; a mapping reads the page cache where it lies. Pages are mapped as they are
    first read (by the checksum, which the store runs on several threads): populating the mapping
    up front serializes that work in the ``mmap`` call. A file under :data:`MAP_MIN_BYTES`, or one
    the system will not map, is copied.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            view = _map(f.fileno(), size) if size >= MAP_MIN_BYTES else None
            return view if view is not None else f.read()
    except FileNotFoundError:
        return None


_MEMORY_FS = ("tmpfs", "ramfs", "hugetlbfs")
_MOUNTINFO_ESCAPE = re.compile(r"\\([0-7]{3})")


def filesystem_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the file system holding ``path``, from Linux's ``/proc/self/mountinfo`` (or the
    ``mountinfo`` text given); ``None`` where that cannot be read or nothing matches."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount_point = _MOUNTINFO_ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[4])
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        # ">=": of stacked mounts on one point, the later line is the one on top
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, right.split()[0]
    return best_type


def is_memory_fs(path: Path, mountinfo: str | None = None) -> bool:
    """Whether ``path`` lies on a memory-backed file system (tmpfs, ramfs, hugetlbfs)."""
    return filesystem_type(path, mountinfo) in _MEMORY_FS


def read_chunk(path: Path, *, mapped: bool) -> bytes | memoryview | None:
    """The file's bytes, mapped (:func:`map_or_none`) or copied (:func:`read_or_none`)."""
    return map_or_none(path) if mapped else read_or_none(path)


def unlink_quiet(path: Path) -> bool:
    """Delete ``path``; ``False`` when it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def group_dirs(root: Path, group: str | None = None) -> Iterator[Path]:
    """Group directories under ``root`` (only ``group`` when given); foreign entries are skipped."""
    if group is not None:
        candidate = root / group
        if candidate.is_dir():
            yield candidate
        return
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            if entry.is_dir(follow_symlinks=False) and is_group(entry.name):
                yield Path(entry.path)


def scan(root: Path, group: str | None = None) -> Iterator[tuple[StoreKey, Path, os.stat_result]]:
    """Every chunk file under ``root``: key, path and stat."""
    for gdir in group_dirs(root, group):
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(gdir):
                key = parse_chunk_path(gdir, entry.name)
                if key is None or not entry.is_file(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    yield key, Path(entry.path), entry.stat(follow_symlinks=False)


def remove_temporaries(root: Path, *, older_than_s: float | None = None, now: float = 0.0) -> int:
    """Delete leftover temporary files (from writers that died); returns how many."""
    removed = 0
    for gdir in group_dirs(root):
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(gdir):
                if not entry.name.startswith(TMP_PREFIX):
                    continue
                if older_than_s is not None:
                    try:
                        if now - entry.stat().st_mtime < older_than_s:
                            continue
                    except FileNotFoundError:
                        continue
                removed += unlink_quiet(Path(entry.path))
    return removed
