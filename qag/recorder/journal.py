"""The run journal: a local, append-only, size-bounded spill of runs the run store cannot take now.

When the store cannot be written, the recorder keeps draining the rings into this journal (so the
workers' rings never fill and no call waits), and drains the journal into the store, oldest first,
when the store is back. Format (see README.md in this folder, "The run journal"):

  <dir>/ID                       the journal's identity: 32 hex digits, made once with the directory
  <dir>/LOCK                     flock()ed by the one recorder using the directory
  <dir>/<start:016x>.qj          files, each a 32-byte header then frames; `start` is the journal
                                 position of its first frame (positions only increase, across files)

  file header  magic b"QAGJRNL1" | journal id (16 bytes) | start position (u64 LE)
  frame        u32 magic 0x4652514A ("JQRF") | u32 body length | u32 runs | u32 crc32(length, runs, body)
               | body = msgpack [source, {slot: ring position journaled so far},
                                 [[slot, [[pos_after, payload], ...]], ...], replay]
               replay: null, or (ClickHouse) the store's own inserts of a batch whose outcome was unknown
               when it was spilled, replayed as they were sent (same ids and deduplication tokens)

A frame is whole when its length fits in the file and its crc matches: a torn tail (a crash while
appending) fails one of the two and is cut off at open, never misread. Runs are payloads exactly as
the rings held them (msgpack run records).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import uuid
import zlib

import msgpack

log = logging.getLogger("qag.recorder.journal")

FILE_MAGIC = b"QAGJRNL1"
FILE_HEADER = struct.Struct("<8s16sQ")          # 32 bytes
FRAME_MAGIC = 0x4652514A                        # "JQRF" little-endian
FRAME_HEADER = struct.Struct("<IIII")           # magic, length, runs, crc
_LEN_RUNS = struct.Struct("<II")
FILE_BYTES = 64 << 20                           # a file is closed for appends past this size
FSYNC_POLICIES = ("batch", "off")

_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack


class JournalError(RuntimeError):
    """The journal directory cannot be used (locked by another recorder, not writable, foreign files)."""


class JournalFull(RuntimeError):
    """Appending this frame would take the journal past its bound (QAG_JOURNAL_MAX_BYTES)."""


class _File:
    __slots__ = ("end", "fd", "path", "start")

    def __init__(self, path: str, fd: int, start: int, end: int):
        self.path, self.fd, self.start, self.end = path, fd, start, end


class Journal:
    """One directory, one writer (the recorder's main thread appends; its writer thread reads).

    Positions: `start` (oldest byte not yet drained), `end` (after the last whole frame). `pending_bytes`
    is end - drained; `pending_runs` the runs in frames past the drained position."""

    def __init__(self, directory: str, max_bytes: int = 1 << 30, fsync: str = "batch", file_bytes: int = FILE_BYTES):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"journal fsync policy must be one of {', '.join(FSYNC_POLICIES)}")
        self.dir = os.path.abspath(directory)
        self.max_bytes = int(max_bytes)
        self.fsync = fsync
        self.file_bytes = int(file_bytes)
        self.torn_bytes = 0        # bytes cut off at open: torn tails and frames failing their crc
        self._lock = threading.Lock()
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            self._lockfd = os.open(os.path.join(self.dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise JournalError(f"journal directory {self.dir} is not usable: {e}") from None
        try:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lockfd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise JournalError(f"journal {self.dir} is in use by another recorder") from None
            raise
        self.id = self._identity()
        self.source = f"journal:{self.id.hex()}"
        self.files: list[_File] = []
        self._runs: list[tuple[int, int]] = []   # (frame end, runs) of every frame past `drained`, in order
        self.drained = 0
        self.last_positions: tuple[str, dict[int, int]] | None = None  # the last frame's source and ring positions
        self._open_files()

    # -- opening -------------------------------------------------------------------------------------
    def _identity(self) -> bytes:
        path = os.path.join(self.dir, "ID")
        try:
            with open(path) as f:
                return bytes.fromhex(f.read().strip())
        except FileNotFoundError:
            ident = uuid.uuid4().bytes
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(ident.hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._sync_dir()
            return ident

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _open_files(self) -> None:
        names = sorted(n for n in os.listdir(self.dir) if n.endswith(".qj"))
        for name in names:
            path = os.path.join(self.dir, name)
            fd = os.open(path, os.O_RDWR)
            head = os.pread(fd, FILE_HEADER.size, 0)
            if len(head) < FILE_HEADER.size:
                os.close(fd)
                log.warning("journal file %s has no whole header; removing it", path)
                os.unlink(path)
                continue
            magic, ident, start = FILE_HEADER.unpack(head)
            if magic != FILE_MAGIC or ident != self.id:
                os.close(fd)
                raise JournalError(f"{path} is not a file of journal {self.id.hex()}")
            if self.files and start != self.files[-1].end:
                log.error("journal file %s starts at %d, after a gap from %d: the gap's runs are gone",
                          path, start, self.files[-1].end)
            f = _File(path, fd, start, start)
            self._scan(f)
            self.files.append(f)
        if self.files:
            self.drained = self.files[0].start

    def _scan(self, f: _File) -> None:
        """Walk every frame; keep the whole ones, cut the file after the last (a torn tail)."""
        size = os.fstat(f.fd).st_size
        off = FILE_HEADER.size
        last_body = None
        while off + FRAME_HEADER.size <= size:
            magic, n, runs, crc = FRAME_HEADER.unpack(os.pread(f.fd, FRAME_HEADER.size, off))
            if magic != FRAME_MAGIC or off + FRAME_HEADER.size + n > size:
                break
            body = os.pread(f.fd, n, off + FRAME_HEADER.size)
            if zlib.crc32(body, zlib.crc32(_LEN_RUNS.pack(n, runs))) != crc:
                break
            off += FRAME_HEADER.size + n
            self._runs.append((f.start + off - FILE_HEADER.size, runs))
            last_body = body
        if off < size:
            self.torn_bytes += size - off
            log.warning("journal file %s: %d bytes after the last whole frame (a torn tail) cut off",
                        f.path, size - off)
            os.ftruncate(f.fd, off)
            os.fsync(f.fd)
        f.end = f.start + off - FILE_HEADER.size
        if last_body is not None:
            source, positions = msgpack.unpackb(last_body, raw=False, strict_map_key=False)[:2]
            self.last_positions = (source, {int(k): int(v) for k, v in positions.items()})

    # -- state ---------------------------------------------------------------------------------------
    @property
    def end(self) -> int:
        return self.files[-1].end if self.files else self.drained

    @property
    def pending_bytes(self) -> int:
        return self.end - self.drained

    @property
    def pending_runs(self) -> int:
        with self._lock:
            return sum(r for _e, r in self._runs)

    def ring_positions(self, source: str) -> dict[int, int]:
        """How far into each ring of `source` the journal holds runs (empty: none of that source's)."""
        if self.last_positions and self.last_positions[0] == source:
            return dict(self.last_positions[1])
        return {}

    # -- appending (the recorder's main thread) ---------------------------------------------------------
    def append(self, source: str, positions: dict[int, int], chunks, replay=None) -> int:
        """Append one frame (the runs of `chunks`, [(slot, [(pos_after, payload), ...])]); `positions` is
        how far into each ring of `source` the journal holds runs once this frame is in. Durable per the
        fsync policy when it returns. Returns the journal position after the frame."""
        runs = 0
        for _slot, recs in chunks:
            runs += len(recs)
        body = _pack((source, positions, chunks, replay))
        n = len(body)
        need = FRAME_HEADER.size + n
        if self.pending_bytes + need > self.max_bytes:
            raise JournalFull(f"the journal holds {self.pending_bytes} bytes; {need} more would pass "
                              f"QAG_JOURNAL_MAX_BYTES={self.max_bytes}")
        frame = FRAME_HEADER.pack(FRAME_MAGIC, n, runs, zlib.crc32(body, zlib.crc32(_LEN_RUNS.pack(n, runs)))) + body
        f = self.files[-1] if self.files else None
        if f is None or (f.end - f.start) + need > self.file_bytes and f.end > f.start:
            f = self._new_file(f.end if f is not None else self.drained)
        off = FILE_HEADER.size + (f.end - f.start)
        written = os.pwrite(f.fd, frame, off)
        if written != len(frame):
            os.ftruncate(f.fd, off)  # a short write (disk full): leave no partial frame behind
            raise OSError(errno.ENOSPC, f"short write to {f.path}")
        if self.fsync == "batch":
            os.fdatasync(f.fd)
        with self._lock:
            f.end += need
            self._runs.append((f.end, runs))
        self.last_positions = (source, dict(positions))
        return f.end

    def _new_file(self, start: int) -> _File:
        path = os.path.join(self.dir, f"{start:016x}.qj")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(fd, FILE_HEADER.pack(FILE_MAGIC, self.id, start), 0)
        if self.fsync == "batch":
            os.fsync(fd)
            self._sync_dir()
        f = _File(path, fd, start, start)
        with self._lock:
            self.files.append(f)
        return f

    # -- reading (the recorder's writer thread) -------------------------------------------------------
    def read(self, pos: int, max_runs: int) -> list[tuple[int, str, list, object]]:
        """Whole frames from `pos` (a frame boundary): [(position after the frame, source, chunks, replay)],
        at least one frame if any, then more while their runs fit in max_runs."""
        out: list = []
        runs = 0
        with self._lock:
            files = list(self.files)
        for f in files:
            if f.end <= pos:
                continue
            off = max(pos, f.start)
            while off < f.end:
                hdr = os.pread(f.fd, FRAME_HEADER.size, FILE_HEADER.size + off - f.start)
                magic, n, nr, _crc = FRAME_HEADER.unpack(hdr)
                if magic != FRAME_MAGIC:
                    raise JournalError(f"{f.path}: no frame at position {off}")
                if out and runs + nr > max_runs:
                    return out
                body = os.pread(f.fd, n, FILE_HEADER.size + off - f.start + FRAME_HEADER.size)
                t = msgpack.unpackb(body, raw=False, strict_map_key=False)
                off += FRAME_HEADER.size + n
                out.append((off, t[0], t[2], t[3] if len(t) > 3 else None))
                runs += nr
        return out

    def mark_drained(self, pos: int) -> None:
        """Everything before `pos` is in the store: forget it, and delete files wholly before it. The
        last file is never deleted while it holds the newest position: once wholly drained it is
        replaced by an empty one starting there, so positions only increase across restarts."""
        with self._lock:
            if pos <= self.drained:
                return
            self.drained = pos
            i = 0
            while i < len(self._runs) and self._runs[i][0] <= pos:
                i += 1
            del self._runs[:i]
            files = self.files
        if files and files[-1].end == pos and files[-1].end > files[-1].start:
            self._new_file(pos)
        with self._lock:
            while len(self.files) > 1 and self.files[0].end <= pos:
                f = self.files.pop(0)
                os.close(f.fd)
                os.unlink(f.path)

    def restart_at(self, pos: int) -> None:
        """An empty journal whose store holds positions up to `pos` (its files were removed by hand):
        continue from there, so new frames are never taken for drained ones."""
        if self.pending_bytes or pos <= self.end:
            return
        log.warning("journal %s: the store has drained it up to %d, past its end %d; continuing from there",
                    self.dir, pos, self.end)
        with self._lock:
            self.drained = pos
        self._new_file(pos)
        with self._lock:
            while len(self.files) > 1:
                f = self.files.pop(0)
                os.close(f.fd)
                os.unlink(f.path)

    def close(self, remove_if_empty: bool = False) -> None:
        """Close the files; with remove_if_empty, an empty journal's directory goes too (the store has
        every run, so a new journal, with a new identity, starts afresh next time)."""
        empty = remove_if_empty and self.pending_bytes == 0
        if empty:
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)
        with self._lock:
            for f in self.files:
                try:
                    os.close(f.fd)
                except OSError:
                    pass
            self.files = []
        try:
            os.close(self._lockfd)
        except OSError:
            pass


__all__ = ["FSYNC_POLICIES", "Journal", "JournalError", "JournalFull"]
