"""Counted progress for long steps (encoding, precompute): a bar on a terminal; in a log (a Ray job's
output, CI) one line every `every_s` seconds with the count, the rate and an ETA, and one at the end."""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from tqdm.auto import tqdm


class Progress:
    def __init__(self, total: int, label: str, unit: str = "sentences", every_s: float = 10.0,
                 stream: TextIO | None = None, emit: Callable[[str], None] | None = None) -> None:
        """emit: where the lines go (a caller's progress printer) instead of `stream`; never a bar."""
        self.total, self.label, self.unit, self.every_s = total, label, unit, every_s
        self.stream = stream or sys.stderr
        self.emit = emit or (lambda line: print(line, file=self.stream, flush=True))
        self.done, self.t0 = 0, time.perf_counter()
        self._last = self.t0
        self._bar = None
        if emit is None and getattr(self.stream, "isatty", lambda: False)():
            self._bar = tqdm(total=total, desc=label, unit=unit[:4], mininterval=1.0, file=self.stream)

    def line(self) -> str:
        el = time.perf_counter() - self.t0
        rate = self.done / el if el > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        speed = f"{rate:.0f}/s" if rate >= 10 else f"{rate:.2g}/s"  # slow work (a teacher's batches): 0.37/s, not 0/s
        return (f"{self.label}: {self.done}/{self.total} {self.unit} ({100 * self.done / max(self.total, 1):.0f}%), "
                f"{speed}, " + (f"ETA {eta:.0f}s" if self.done < self.total else f"done in {el:.0f}s"))

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            self.emit(self.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif time.perf_counter() - self.t0 >= self.every_s:  # short steps stay quiet
            self.emit(self.line())
