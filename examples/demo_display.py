"""The exactly-once demo's progress: a live table refreshed in place (rich), or plain lines for CI logs.

Usage::

    with Display(plain=not sys.stdout.isatty()) as display:
        display.event("kill -9 of the broker")          # a line that stays, in both modes
        display.update(Progress(rows_in=100, rows_committed=80, fault="broker down"))
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table

PLAIN_EVERY_S = 2.0


@dataclass
class Progress:
    """One snapshot of the demo: input written, output visible, epochs committed, the fault under way."""

    rows_in: int = 0            # committed by the input producer
    rows_aborted: int = 0       # aborted by it on purpose
    rows_committed: int = 0     # enriched rows visible to a read_committed reader
    epochs: dict[str, int] = field(default_factory=dict)   # query -> coordinator watermark
    driver: str = "-"
    fault: str = "none"

    @property
    def lag(self) -> int:
        """Committed input rows not yet visible downstream."""
        return max(self.rows_in - self.rows_committed, 0)


class Display:
    """Shows Progress: in place with rich's Live, or a line every few seconds with ``plain``."""

    def __init__(self, plain: bool, t0: float | None = None) -> None:
        self.plain, self.t0 = plain, t0 or time.monotonic()
        self.console = Console(highlight=False)
        self._live: Live | None = None
        self._last_line = 0.0

    def __enter__(self) -> Display:
        if not self.plain:
            self._live = Live(self._table(Progress()), console=self.console, refresh_per_second=4,
                              transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def elapsed(self) -> str:
        """Seconds since the demo started, as a log prefix."""
        return f"[{time.monotonic() - self.t0:6.1f}s]"

    def event(self, text: str) -> None:
        """Something that happened (a fault injected, a check passed): printed once, kept on screen."""
        if self.plain:
            print(f"{self.elapsed()} {text}", flush=True)
        else:
            self.console.print(f"[dim]{self.elapsed()}[/dim] {text}")

    def update(self, progress: Progress) -> None:
        """Show the newest snapshot (plain mode: at most one line every PLAIN_EVERY_S)."""
        if self._live is not None:
            self._live.update(self._table(progress))
        elif time.monotonic() - self._last_line >= PLAIN_EVERY_S:
            self._last_line = time.monotonic()
            epochs = ", ".join(f"{q} {e + 1}" for q, e in progress.epochs.items()) or "-"
            print(f"{self.elapsed()} rows in {progress.rows_in} (+{progress.rows_aborted} aborted), "
                  f"committed {progress.rows_committed}, lag {progress.lag}, epochs committed: {epochs}, "
                  f"driver {progress.driver}, fault: {progress.fault}", flush=True)

    def _table(self, progress: Progress) -> Table:
        table = Table(title=f"twophase exactly-once demo {self.elapsed()}", show_header=False, min_width=60)
        table.add_column(style="bold")
        table.add_column()
        table.add_row("rows in (committed input)", f"{progress.rows_in}  (+{progress.rows_aborted} aborted)")
        table.add_row("rows committed (enriched, visible)", str(progress.rows_committed))
        table.add_row("lag (rows)", str(progress.lag))
        for query, epoch in progress.epochs.items():
            table.add_row(f"epochs committed: {query}", str(epoch + 1))
        table.add_row("driver", progress.driver)
        table.add_row("current fault", f"[red]{progress.fault}[/red]" if progress.fault != "none" else "none")
        return table
