"""The broker is SIGKILLed at each step of EndTxn; after a restart every transaction is committed
everywhere or aborted everywhere, never mixed.

The broker runs as a subprocess with ``TWOPHASE_BROKER_FAILPOINT`` set (twophase.broker.txn.failpoints),
which makes it kill itself at that step. A transaction spans two topics with three partitions each,
so "between_markers" leaves one partition with its marker and five without. After the restart
(without the failpoint) DescribeTransactions shows what recovery did: a logged decision is
completed before the broker accepts connections; a decision that was never logged leaves the
transaction open. The client then retries its EndTxn, as every client does when the connection
drops, and a read_committed consumer must see all of the transaction's records or none.
"""

from __future__ import annotations

import pytest
from kio.schema.errors import ErrorCode

from twophase.broker.txn.failpoints import ENV
from twophase.zkserver import free_port

from .conftest import WireClient, req
from .test_broker_crash import BrokerProcess
from .test_txn_interop import PARTITIONS, create_topics, read_confluent, write_end_markers
from .test_txn_wire import add_partitions, end_txn, init_pid, produce_txn

pytestmark = pytest.mark.chaos

# failpoint -> the state recovery must leave behind (None: the decision was never logged)
RECOVERED = {"before_prepare": None, "after_prepare": "Complete", "between_markers": "Complete",
             "after_markers": "Complete"}


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "abort"])
@pytest.mark.parametrize("failpoint", sorted(RECOVERED))
def test_kill_during_end_txn(tmp_path, topic, monkeypatch, failpoint, commit):
    b = BrokerProcess(str(tmp_path / "data"), free_port(), str(tmp_path))
    try:
        monkeypatch.setenv(ENV, failpoint)
        b.start()
        monkeypatch.delenv(ENV)
        topics = [topic + "-a", topic + "-b"]
        create_topics(b.bootstrap, *topics)
        w = WireClient(b.port)
        r = init_pid(w, "crashy")
        pid, epoch = r.producer_id, r.producer_epoch
        everywhere = {t: list(range(PARTITIONS)) for t in topics}
        assert set(add_partitions(w, "crashy", pid, epoch, everywhere).values()) == {ErrorCode.none}
        values = []
        for t in topics:
            for p in range(PARTITIONS):
                value = f"{t}-{p}".encode()
                assert produce_txn(w, "crashy", t, p, pid, epoch, 0, (value,)) == ErrorCode.none
                values.append(value)
        with pytest.raises(ConnectionError):
            end_txn(w, "crashy", pid, epoch, commit)  # the broker dies on the way
        w.close()
        assert b.proc.wait(timeout=30) == -9
        assert f"failpoint {failpoint}" in b.output()

        b.start()
        w = WireClient(b.port)
        [d] = w.request(req(65, 0, transactional_ids=("crashy",))).transaction_states
        outcome = "Commit" if commit else "Abort"
        assert d.transaction_state == ("Ongoing" if RECOVERED[failpoint] is None else "Complete" + outcome)
        assert end_txn(w, "crashy", pid, epoch, commit) == ErrorCode.none  # the client's retry
        w.close()
        write_end_markers(b.bootstrap, topics)
        seen = read_confluent(b.bootstrap, topics, "read_committed")
        assert sorted(seen) == (sorted(values) if commit else [])
    finally:
        b.stop()
        b.kill()
