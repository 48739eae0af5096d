"""The independent reader's verdict: every input row visible exactly once?"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Report:
    """What :func:`count_rows` found: rows in and out, and how many were lost, duplicated or unexpected.

    Usage::

        report = count_rows(range(1000), ids_a_reader_saw)
        report.exact          # True when nothing was lost, duplicated or unexpected
        print(report)         # rows in 1000, rows out 1000, lost 0, ...: EXACTLY ONCE
    """
    rows_in: int
    rows_out: int
    lost: int
    duplicated: int
    unexpected: int

    @property
    def exact(self) -> bool:
        """Whether every row arrived exactly once and nothing else did."""
        return self.lost == self.duplicated == self.unexpected == 0

    def __str__(self) -> str:
        verdict = "EXACTLY ONCE" if self.exact else "NOT EXACTLY ONCE"
        return (f"rows in {self.rows_in}, rows out {self.rows_out}, lost {self.lost}, "
                f"duplicated {self.duplicated}, unexpected {self.unexpected}: {verdict}")


def count_rows(expected: Iterable, observed: Iterable) -> Report:
    """Compare the ids that went in with every id a reader saw, counting copies."""
    want = set(expected)
    seen = Counter(observed)
    return Report(
        rows_in=len(want),
        rows_out=sum(seen.values()),
        lost=len(want - seen.keys()),
        duplicated=sum(n - 1 for k, n in seen.items() if n > 1),
        unexpected=sum(n for k, n in seen.items() if k not in want),
    )
