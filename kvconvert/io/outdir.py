"""Atomic output directories: a conversion writes into a temporary sibling of ``--out`` and renames it
into place only when everything succeeded, under a lock against other conversions. No torch here, so
a command refuses an existing ``--out`` before it loads torch, transformers or the source."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvconvert.errors import KVConvertError


def refuse_overlap(out: Path, sources: Sequence[Path]) -> None:
    """``out`` must not be, contain or lie inside an input directory: replacing it would destroy the
    input (``--force`` does not change that)."""
    out = out.resolve()
    for source in sources:
        source = source.resolve()
        if out == source or source in out.parents or out in source.parents:
            relation = "is" if out == source else "is inside" if source in out.parents else "contains"
            raise KVConvertError(f"--out {out} {relation} the input {source}; choose a directory outside it")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold ``.NAME.lock`` beside ``out`` (created atomically, holding our pid) for the block, so two
    conversions to one output cannot both succeed. A lock whose process is gone is taken over."""
    lock = out.parent / f".{out.name}.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            text = lock.read_text().strip() if lock.exists() else ""
            if text.isdigit() and _pid_alive(int(text)) and int(text) != os.getpid():
                raise KVConvertError(
                    f"another kvconvert process (pid {text}) is writing {out}; wait for it or choose another --out"
                ) from None
            lock.unlink(missing_ok=True)  # stale: its process is gone
    else:
        raise KVConvertError(f"cannot lock {out}: {lock} keeps reappearing")
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        yield
    finally:
        lock.unlink(missing_ok=True)


def refuse_existing(out: Path, replace: bool) -> None:
    """An existing ``out`` is refused unless ``replace`` (checked again under the lock when writing)."""
    if out.exists() and not replace:
        raise KVConvertError(f"output directory {out.resolve()} already exists; choose another --out or pass --force")


@contextlib.contextmanager
def atomic_output_dir(out: Path, replace: bool, sources: Sequence[Path] = ()) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` only if the block succeeds.

    An existing ``out`` is refused unless ``replace``; an ``out`` that is, contains or lies inside one
    of ``sources`` always. While the block runs, ``out`` is locked against other conversions. On any
    failure (including Ctrl-C and SIGTERM, see ``cli``) the temporary directory is removed and ``out``
    is left exactly as it was.
    """
    out = out.resolve()
    refuse_overlap(out, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out):
        refuse_existing(out, replace)
        remove_stale_temporaries(out)
        with _temporary_sibling(out) as tmp:
            yield tmp


@contextlib.contextmanager
def _temporary_sibling(out: Path) -> Iterator[Path]:
    """A fresh ``.NAME.tmp-PID-*`` directory beside ``out``, renamed onto ``out`` when the block ends
    normally and removed whatever else happens."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; the output should look like any other directory
    try:
        yield tmp
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(trash / out.name)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temporaries(out: Path) -> None:
    """Delete ``.NAME.tmp-PID-*`` siblings left by conversions that were killed (SIGKILL cannot be
    caught, so their cleanup never ran). Directories of live processes are left alone."""
    for candidate in out.parent.glob(f".{out.name}.tmp-*-*"):
        pid_text = candidate.name.removeprefix(f".{out.name}.tmp-").split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(candidate, ignore_errors=True)
        except PermissionError:
            pass  # someone else's live process
