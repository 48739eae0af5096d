"""examples.file_sink_query with a partition that can never be written, for chaos case 10.

Run it exactly like the example::

    TWOPHASE_TEST_POISON=1 python -m tests.driver_job --zk ... --input ... --output ... --checkpoint ...

With TWOPHASE_TEST_POISON=1 the sink raises on every attempt of partition
POISON_PARTITION of epoch POISON_EPOCH, so that task fails past its retries
(local[2,4]: 4 attempts), the query fails and the process exits non-zero.
Without it this is examples.file_sink_query.main, unchanged.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from examples import file_sink_query
from examples.file_sink_query import FaultyFileSink

POISON_ENV = "TWOPHASE_TEST_POISON"
POISON_EPOCH = 1
POISON_PARTITION = 0


class PoisonedFileSink(FaultyFileSink):
    """Every attempt of (POISON_EPOCH, POISON_PARTITION) dies after its first row."""

    def begin_transaction(self, ctx):
        txn = super().begin_transaction(ctx)
        txn.poisoned = (ctx.epoch, ctx.partition) == (POISON_EPOCH, POISON_PARTITION)
        return txn

    def write(self, txn, row: Any) -> None:
        super().write(txn, row)
        if txn.poisoned:
            raise RuntimeError(
                f"poisoned: epoch {POISON_EPOCH} partition {POISON_PARTITION} "
                f"attempt {txn.ctx.attempt} always fails")


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(POISON_ENV) == "1":
        # main() builds its sink from this module global; the poisoned class is
        # then pickled by value to the workers, so they need no env var.
        file_sink_query.FaultyFileSink = PoisonedFileSink
    return file_sink_query.main(argv)


if __name__ == "__main__":
    sys.exit(main())
