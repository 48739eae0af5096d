"""Where the coordinator keeps its state in ZooKeeper.

::

    <root>/apps/<app>                            {"coordinator": "embedded" | "daemon"}
    <root>/apps/<app>/sink                       the sink, signed cloudpickle
    <root>/apps/<app>/fence                      its version is the current owner's token
    <root>/apps/<app>/queries/<query>            {"checkpoint": path}
    <root>/apps/<app>/queries/<query>/runs/<run>     {"started", "driver", "in_order"}; child "alive" ephemeral
    <root>/apps/<app>/queries/<query>/runs/<run>/halted  reason the driver stopped phase two; tasks refuse
    <root>/apps/<app>/queries/<query>/barrier    {"epoch": N, "run": R}  Spark reported N done
    <root>/apps/<app>/queries/<query>/watermark  {"epoch": N}  every epoch <= N is committed
    <root>/apps/<app>/queries/<query>/replay     {"epoch": N}  `twophase replay` of N is unfinished
    <root>/apps/<app>/queries/<query>/epochs/<N:019d>                     epoch record
    <root>/apps/<app>/queries/<query>/epochs/<N>/intents/<run>.<N>.<p>.<a>    a task began a transaction
    <root>/apps/<app>/queries/<query>/epochs/<N>/attempts/<run>.<N>.<p>.<a>   signed pre-commit
    <root>/apps/<app>/queries/<query>/epochs/<N>/winners/<run>.<p>        winning attempt name
    <root>/apps/<app>/queries/<query>/epochs/<N>/failures/<attempt>       last phase-two error
    <root>/apps/<app>/queries/<query>/epochs/<N>/failed_writes/<run>      {"error": why}  the run's write failed
    <root>/apps/<app>/queries/<query>/slots/<p>/<slot>    {"attempt": name, "epoch": N}  the slot's holder
    <root>/daemon/election                       leader election of the HA daemons

Attempt and intent names are :attr:`TxnContext.name <twophase.sink.TxnContext.name>`.

Usage::

    qp = AppPaths("/twophase", "orders").query(query_id)
    client.get_children(qp.attempts(7))
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ROOT = "/twophase"


@dataclass(frozen=True)
class AppPaths:
    """The znodes of one app under ``root``."""

    root: str
    app: str

    @property
    def base(self) -> str:
        """The app's znode: its coordinator mode."""
        return f"{self.root}/apps/{self.app}"

    @property
    def sink(self) -> str:
        """The app's sink, signed."""
        return f"{self.base}/sink"

    @property
    def fence(self) -> str:
        """Its version is the current owner's fencing token."""
        return f"{self.base}/fence"

    @property
    def queries(self) -> str:
        """Parent of the app's queries."""
        return f"{self.base}/queries"

    def query(self, query_id: str) -> QueryPaths:
        """The znodes of one query of the app."""
        return QueryPaths(f"{self.queries}/{query_id}", self.app, query_id)


@dataclass(frozen=True)
class QueryPaths:
    """The znodes of one streaming query of an app (``base`` is the query's own znode)."""

    base: str
    app: str
    query_id: str

    @property
    def runs(self) -> str:
        """Parent of the query's runs, in start order."""
        return f"{self.base}/runs"

    def run(self, run_id: str) -> str:
        """One run (driver start) of the query."""
        return f"{self.runs}/{run_id}"

    def halted(self, run_id: str) -> str:
        """Exists once the driver stopped phase two for the run; holds the reason."""
        return f"{self.run(run_id)}/halted"

    @property
    def barrier(self) -> str:
        """The last epoch Spark reported complete."""
        return f"{self.base}/barrier"

    @property
    def ready(self) -> str:
        """The batch path's hint that Spark is about to record an epoch complete (``commits/N``): the
        coordinator then looks at the checkpoint every few ms for a while. Never proof of anything."""
        return f"{self.base}/ready"

    @property
    def watermark(self) -> str:
        """Every epoch at or below it is committed."""
        return f"{self.base}/watermark"

    @property
    def replay(self) -> str:
        """Exists while ``twophase replay`` of the epoch it names is unfinished: phase two waits."""
        return f"{self.base}/replay"

    @property
    def epochs(self) -> str:
        """Parent of the epoch records."""
        return f"{self.base}/epochs"

    def epoch(self, epoch: int) -> str:
        """One epoch's record (zero-padded, so names sort as numbers)."""
        return f"{self.epochs}/{epoch:019d}"

    def intents(self, epoch: int) -> str:
        """Attempts of the epoch that began a transaction."""
        return f"{self.epoch(epoch)}/intents"

    def attempts(self, epoch: int) -> str:
        """The epoch's registered pre-commits."""
        return f"{self.epoch(epoch)}/attempts"

    def winners(self, epoch: int) -> str:
        """One winning attempt per (run, partition)."""
        return f"{self.epoch(epoch)}/winners"

    def failures(self, epoch: int) -> str:
        """The last phase-two failure per attempt."""
        return f"{self.epoch(epoch)}/failures"

    def failed_writes(self, epoch: int) -> str:
        """One child per run whose write of the epoch failed (``TwoPhaseBatchSink.write``): the coordinator
        never commits the epoch for that run."""
        return f"{self.epoch(epoch)}/failed_writes"

    @property
    def slots(self) -> str:
        """Parent of the query's slot pools, one per partition."""
        return f"{self.base}/slots"

    def partition_slots(self, partition: int) -> str:
        """One partition's slots held now: each child is a slot number, its data the holder."""
        return f"{self.slots}/{partition}"


def election_path(root: str) -> str:
    """The kazoo Election path the HA daemons contend on."""
    return f"{root}/daemon/election"


def app_names(root: str) -> str:
    """The znode whose children are the app names."""
    return f"{root}/apps"
