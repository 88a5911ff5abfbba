"""Atomic output directories: a conversion writes into a temporary sibling of ``--out`` and renames it
into place only when everything succeeded, under a lock against other conversions. No torch here, so
a command refuses an existing ``--out`` before it loads torch, transformers or the source."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvconvert.errors import KVConvertError

# Every directory kvconvert writes holds this file: what wrote it and the files it wrote. ``--force``
# replaces only directories that have it, and ``push`` uploads only the files it lists. Hidden, so it
# is never uploaded itself.
MARKER = ".kvconvert-output.json"
# What marked a kvconvert directory before MARKER existed (conversions, analyses, plans).
_LEGACY_MARKERS = ("kvconvert.json", "analysis.json", "frontier.json")
# Written into a kvconvert directory after the conversion by kvconvert itself: eval --json, push's card. ``push``
# uploads them, and ``--force`` replaces them with the output.
ADDED_LATER = ("eval.json", "README.md")


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker of a directory kvconvert wrote, or None (absent, unreadable, or not ours)."""
    try:
        data = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == "kvconvert" else None


def is_kvconvert_output(directory: Path) -> bool:
    """True for a real directory (not a link) that kvconvert wrote: its marker, or an older output's
    report file."""
    if directory.is_symlink() or not directory.is_dir():
        return False
    return read_marker(directory) is not None or any((directory / name).is_file() for name in _LEGACY_MARKERS)


def foreign_files(directory: Path) -> list[str]:
    """Files in a directory kvconvert wrote that it did not write: not in its marker's list, and not what kvconvert
    itself adds to an output later (``eval --json``'s eval.json, ``push``'s card) or Python's bytecode caches; and its
    model card if the user edited it (``card_edited``). A user's notes, plots, links or card edits there: ``--force``
    would delete them with the output, so it refuses instead. An output from before the marker (a legacy report file
    only) records no list: nothing is reported for it."""
    from kvconvert.io.model_card import is_eval_result

    marker = read_marker(directory)
    if marker is None:
        return []
    ours = {str(name) for name in marker.get("files", [])} | {MARKER, "README.md"}
    found = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if (path.is_dir() and not path.is_symlink()) or "__pycache__" in relative.split("/") or relative in ours:
            continue
        if relative == "eval.json" and not path.is_symlink() and is_eval_result(_json_or_none(path)):
            continue
        found.append(relative)
    return found + (["README.md (edited since kvconvert wrote it)"] if card_edited(directory) else [])


def _write_marker(directory: Path, command: str) -> None:
    from kvconvert import __version__

    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    marker = {"tool": "kvconvert", "version": __version__, "command": command, "files": files}
    if (digest := _card_digest(directory)) is not None:
        marker["card_sha256"] = digest
    (directory / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


# The model card kvconvert writes (README.md) is its own file, but a user may edit it before ``push``; the marker
# keeps the digest of the card as kvconvert last wrote it, so that push uploads an edited card as it is instead of
# replacing it with a fresh one (here and on the Hub).
def _card_digest(directory: Path) -> str | None:
    card = directory / "README.md"
    if card.is_symlink() or not card.is_file():
        return None
    return hashlib.sha256(card.read_bytes()).hexdigest()


def card_edited(directory: Path) -> bool:
    """README.md differs from the card kvconvert last wrote there (False for an output whose marker predates the
    digest: its card cannot be told from an edited one, and is treated as kvconvert's)."""
    marker = read_marker(directory)
    recorded = None if marker is None else marker.get("card_sha256")
    return isinstance(recorded, str) and _card_digest(directory) not in (recorded, None)


def record_card(directory: Path) -> None:
    """After kvconvert rewrote README.md (``push``'s refreshed card): the marker's digest follows it."""
    marker = read_marker(directory)
    if marker is not None and (digest := _card_digest(directory)) is not None:
        write_text_atomic(directory / MARKER, json.dumps({**marker, "card_sha256": digest}, indent=1) + "\n")


_SIZE_UNITS = {"KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4, "KIB": 1024, "MIB": 1024**2,
               "GIB": 1024**3, "TIB": 1024**4, "B": 1}  # fmt: skip


def parse_size(text: str, option: str = "--max-shard-size") -> int:
    """'5GB' / '500MB' / '1.5GiB' / '1024' → bytes (positive), or one line saying what is accepted."""
    upper = text.strip().upper()
    unit = next((u for u in sorted(_SIZE_UNITS, key=len, reverse=True) if upper.endswith(u)), "")
    try:
        size = int(float(upper[: len(upper) - len(unit)]) * _SIZE_UNITS.get(unit, 1))
    except (ValueError, OverflowError):
        size = 0
    if size < 1:
        raise KVConvertError(f"{option} takes a positive size like 5GB, 500MB, 2GiB or 1000000; got {text!r}")
    return size


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary sibling renamed over it. A full disk or a kill
    leaves the old file (or none), never a truncated one, and no temporary file behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _json_or_none(path: Path) -> Any:
    """``path`` parsed as JSON, or None where it is not readable JSON text."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def refuse_foreign_file(path: Path, option: str, ours: Callable[[Any], bool], what: str) -> None:
    """A file ``option`` would write may replace only a file of the same kind that kvconvert wrote
    (``ours(parsed JSON)``): never a directory, another program's file, or a checkpoint's own config."""
    if path.is_dir():
        raise KVConvertError(f"{option} {path} is a directory; give a file path")
    if not path.parent.is_dir():
        raise KVConvertError(f"{option} {path}: the directory {path.parent} does not exist")
    if not path.exists():
        return
    if not ours(_json_or_none(path)):
        raise KVConvertError(f"{option} {path} exists and is not {what}; kvconvert replaces only its own: choose "
                             "another path")  # fmt: skip


def refuse_overlap(out: Path, sources: Sequence[Path]) -> None:
    """``out`` must not be, contain or lie inside an input (a directory, or a file such as an imported checkpoint):
    replacing it would destroy the input (``--force`` does not change that)."""
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


def refuse_existing(out: Path, replace: bool, option: str = "--out") -> None:
    """An existing ``out`` is refused unless ``replace`` and kvconvert wrote it (checked again under the
    lock when writing). A file, a directory of someone else's files, or the current directory (or one
    above it) is never replaced: ``--force`` must not be able to delete what kvconvert did not write."""
    if not out.exists() and not out.is_symlink():
        return
    where = out.resolve()
    if not where.is_dir():
        kind = "a dangling link" if not where.exists() else "a file"
        raise KVConvertError(f"{option} {out} is {kind}, not a directory; choose another {option}")
    if not replace:
        raise KVConvertError(f"output directory {where} already exists; choose another {option} or pass --force")
    cwd = Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        raise KVConvertError(f"{option} {out} is or contains the current directory; kvconvert will not replace it")
    if not is_kvconvert_output(where):
        raise KVConvertError(
            f"{option} {where} exists and was not written by kvconvert; --force replaces only kvconvert's own "
            f"outputs: choose another {option} or remove it yourself"
        )
    extra = foreign_files(where)
    if extra:
        shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        raise KVConvertError(
            f"{option} {where} holds files kvconvert did not write ({shown}); --force replaces only kvconvert's own "
            f"files: move them away or choose another {option}"
        )


@contextlib.contextmanager
def atomic_output_dir(
    out: Path, replace: bool, sources: Sequence[Path] = (), command: str = "convert"
) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` only if the block succeeds.

    An existing ``out`` is refused unless ``replace`` and kvconvert wrote it (``refuse_existing``); an
    ``out`` that is, contains or lies inside one of ``sources`` always. While the block runs, ``out`` is
    locked against other conversions. The finished directory gets kvconvert's marker listing the files
    the block wrote. On any failure (including Ctrl-C and SIGTERM, see ``cli``) the temporary directory
    is removed and ``out`` is left exactly as it was.
    """
    refuse_existing(out, replace)
    out = out.resolve()
    refuse_overlap(out, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out):
        refuse_existing(out, replace)
        remove_stale_temporaries(out)
        with _temporary_sibling(out) as tmp:
            yield tmp
            _write_marker(tmp, command)


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
