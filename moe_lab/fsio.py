"""Files of a report: folders checked before anything starts (one line naming the path, the flag the user gave and
why it cannot be used — never a traceback), the one writer of its record files, a reader that never blocks, and
which file a failed write was for. No torch here."""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from pathlib import Path

STOPPED_TAKING_WRITES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""The errors of a file system that stops taking writes: full, over quota, over the file size limit (`ulimit -f`),
read-only. A write that fails with one of them often names no file (it fails on write, not on open)."""
REFUSED_WRITE = STOPPED_TAKING_WRITES | {errno.EACCES, errno.EPERM, errno.EISDIR}
"""The errors of a write a notebook kernel reports back (as text) that mean the report's folder refused the file."""


def writable_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create `path` (parents too) and prove a file can be written there; raise ValueError in one line otherwise
    (a path under a file, /proc, no permission, a read-only mount)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".moe_lab-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{flag} ({p}) is not a writable directory: {e.strerror or e}; choose another {flag}") \
            from None
    return p


def check_writable(path: str | os.PathLike, flag: str = "--out") -> Path:
    """`writable_dir`'s test without its trace: the folders it had to create are removed again, so input refused
    later (a bad parameter, a missing release) leaves nothing behind. Same one-line ValueError."""
    p = Path(path)
    missing = []
    for d in (p, *p.parents):
        if d.exists() or d == d.parent:
            break
        missing.append(d)
    try:
        return writable_dir(p, flag)
    finally:
        for d in missing:  # deepest first: each is empty again once the probe file is gone
            try:
                d.rmdir()
            except OSError:
                break


def check_writable_file(path: str | os.PathLike, flag: str) -> Path:
    """A file the command writes at its end (`bench --json OUT`), proved writable before any work: its folder
    exists, it is no directory, and it can be opened for writing (a file that did not exist is removed again).
    ValueError in one line otherwise."""
    p = Path(path)
    if not p.parent.is_dir():
        raise ValueError(f"{flag} {p}: its folder {p.parent} does not exist; give a path in an existing folder")
    existed = p.exists() or p.is_symlink()
    if existed and not p.is_file():
        raise ValueError(f"{flag} {p}: {_kind(p)} is there, not a file; give another path")
    try:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
        os.close(fd)
    except OSError as e:
        raise ValueError(f"{flag} {p}: cannot be written ({e.strerror or type(e).__name__}); give another path") \
            from None
    if not existed:
        p.unlink()
    return p


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """The one writer of a report's record files (results.json, cases-NN.json): `data` goes to a temporary file
    beside `path`, is flushed to disk, then renamed over `path`, so a crash or a full disk leaves the old file or
    the new one, never part of one. The file gets ordinary permissions (mkstemp makes 0600; the umask applies).
    A failure is the OSError with `path` as its file name: a write that fails once the temporary file is open names
    no file otherwise, and the temporary file is not what the user knows."""
    p = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
        tmp = None
    except OSError as e:
        if e.errno is None or e.filename == str(p) and e.filename2 is None:
            raise
        raise OSError(e.errno, e.strerror, str(p)) from e  # its subclass by errno (IsADirectoryError, ...)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of the regular file at `path`. Anything else is an OSError naming it without waiting on it: a FIFO
    (whose read waits for a writer that may never come), a socket, a device, a directory. Opened non-blocking, so
    even the open of a FIFO returns at once."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file: {_kind_of_mode(mode)}", str(path))
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind_of_mode(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _kind(p: Path) -> str:
    try:
        return _kind_of_mode(p.stat().st_mode)
    except OSError:
        return "a broken link"


class ReportWriteError(RuntimeError):
    """A file of the report could not be written once the run had started (the folder made read-only, a full disk, a
    path taken by a directory): the CLI says it in one line and exits 3; what was written before is kept."""

    def __init__(self, path: str | os.PathLike, error: OSError, kept: str = ""):
        self.path, self.error = str(path), error
        why = error.strerror or type(error).__name__
        super().__init__(f"cannot write {path} ({why}) during the run, so it stopped there" + (f"; {kept}" if kept
                         else "") + "; make the folder writable (a read-only or full file system, a directory where the "
                         "file goes) or give another --out, and run again: finished cases are reused")


def write_failure(e: BaseException, folder: str | os.PathLike) -> tuple[str, OSError] | None:
    """(the path under `folder`, the OSError) when `e` — or an exception that caused it — is a failed write into
    `folder`, else None:
    - an OSError naming a file under `folder`;
    - an OSError of a file system that stops taking writes (`STOPPED_TAKING_WRITES`) that names no file: the file
      the innermost frame of its traceback was writing (a path under `folder` among that frame's variables), or
      `folder` itself when no frame holds one;
    - a notebook kernel's error (papermill's `ename` / `evalue`) that is an OSError of `REFUSED_WRITE` naming a file
      under `folder`: a record the notebook could not write."""
    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, OSError):
            if e.filename and _under(e.filename, folder):
                return str(e.filename), e
            if e.errno in STOPPED_TAKING_WRITES and not e.filename:
                return _written_in(e.__traceback__, folder) or str(folder), e
        kernel = _kernel_write_error(e, folder)
        if kernel:
            return kernel
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def failed_write(e: BaseException, folder: str | os.PathLike) -> str | None:
    """The path under `folder` an OSError (or an exception caused by one) failed to write, else None."""
    found = write_failure(e, folder)
    return found[0] if found else None


_KERNEL_OSERROR = re.compile(r"^\[Errno (\d+)\] (.+?): '(.+?)'(?: -> .*)?$")


def _kernel_write_error(e: BaseException, folder) -> tuple[str, OSError] | None:
    ename, evalue = getattr(e, "ename", None), getattr(e, "evalue", None)
    if not isinstance(ename, str) or not isinstance(evalue, str) or not ename.endswith("Error"):
        return None
    m = _KERNEL_OSERROR.match(evalue.strip())
    if not m or int(m.group(1)) not in REFUSED_WRITE or not _under(m.group(3), folder):
        return None
    return m.group(3), OSError(int(m.group(1)), m.group(2), m.group(3))


def _written_in(tb, folder) -> str | None:
    """The path under `folder` (not the folder itself, absolute) that the innermost frame of `tb` holding one has among
    its variables."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    top = os.path.abspath(folder)
    for frame in reversed(frames):
        for value in list(frame.f_locals.values()):
            try:
                path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
            except TypeError:
                continue
            # absolute paths only: a relative one, or any other text (a page being written), is no file of it
            if isinstance(path, str) and len(path) < 4096 and os.path.isabs(path) and "\n" not in path:
                path = os.path.normpath(path)
                if path != top and _under(path, folder):
                    return path
    return None


def _under(path, folder) -> bool:
    try:
        return Path(os.path.abspath(path)).is_relative_to(Path(os.path.abspath(folder)))
    except (TypeError, ValueError):
        return False


__all__ = ["writable_dir", "check_writable", "check_writable_file", "write_atomic", "read_regular", "read_json",
           "ReportWriteError", "write_failure", "failed_write", "STOPPED_TAKING_WRITES"]


def read_json(p) -> tuple[object, str | None]:
    """A report file's JSON, read without blocking (`read_regular`): (data, None), or (None, what is wrong with it —
    'cannot be read (…)', 'is not UTF-8 text (…)', 'is not valid JSON (…)') for a message that names the file."""
    import json

    try:
        return json.loads(read_regular(p).decode()), None
    except OSError as e:
        return None, f"cannot be read ({e.strerror or type(e).__name__})"
    except UnicodeDecodeError as e:
        return None, f"is not UTF-8 text ({e})"
    except (json.JSONDecodeError, RecursionError) as e:
        return None, f"is not valid JSON ({e})"

