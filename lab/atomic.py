"""Atomic writes: every file the harness writes goes through here, so that a full disk is one `WriteFailed`
line (exit 5) with nothing half-written, and an interrupt mid-write leaves the previous version intact.

    atomic_write(path, write)   write(f) into path.tmp, fsync, rename over path
    append_text(path, text)     append and fsync; a failed append is cut back (no torn line)
"""

import os
from pathlib import Path

from cli import WriteFailed, writing


def _open(path: Path, mode: str):
    """Every file this project writes is opened here (tests replace it to simulate a full disk)."""
    return open(path, mode)


def _write_failed(path: Path, error: BaseException) -> WriteFailed:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return WriteFailed(
        f"could not write {path} ({reason}); its previous version is intact: free space and "
        "run again (a run: --resume)"
    )


def atomic_write(path: Path, write) -> None:
    """write(f) into path.tmp (a binary file), fsync, then rename over path: a reader sees the old file or
    the new one, never half of one. A failed write (a full disk: OSError, or RuntimeError from torch.save)
    removes the temporary file, leaves path as it was, and raises WriteFailed naming the file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with writing():
        _write_replace(path, tmp, write)


def _write_replace(path: Path, tmp: Path, write) -> None:
    try:
        with _open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        raise _write_failed(path, e) from e
    except BaseException:  # an interrupt mid-write: no half file either
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """atomic_write of UTF-8 text."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def append_text(path: Path, text: str) -> None:
    """Append and fsync; a failed append is cut back to the file's previous length (no torn line)."""
    path = Path(path)
    with writing():
        _append(path, text)


def _append(path: Path, text: str) -> None:
    size = path.stat().st_size if path.exists() else 0
    try:
        with _open(path, "ab") as f:
            try:
                f.write(text.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                f.truncate(size)
                raise
    except (OSError, RuntimeError) as e:
        if path.exists() and path.stat().st_size != size:
            os.truncate(path, size)
        raise _write_failed(path, e) from e
