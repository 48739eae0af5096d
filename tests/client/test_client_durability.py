"""The client across broker restarts: a prepared 2PC transaction outlives the ordinary timeout and a
restart and is then committed from its handle; an idempotent producer rides out a restart."""

from __future__ import annotations

import threading

from tests.waiting import wait_for
from twophase.client import Admin, Consumer, Producer
from twophase.zkserver import free_port

from .conftest import drain


def test_prepared_transaction_survives_timeout_and_restart(broker_factory, tmp_path, topic):
    port, data = free_port(), tmp_path / "data"
    options = dict(port=port, data_dir=data, transaction_check_interval_ms=100)
    broker = broker_factory(**options)
    prepared = Producer(broker.bootstrap, transactional_id="two-phase", enable_2pc=True, transaction_timeout_ms=500)
    prepared.init_transactions()
    prepared.begin_transaction()
    for i in range(10):
        prepared.send(topic, value=b"%d" % i, partition=0)
    handle = prepared.prepare_transaction()
    prepared.close()
    ordinary = Producer(broker.bootstrap, transactional_id="one-phase", transaction_timeout_ms=500)
    ordinary.init_transactions()
    ordinary.begin_transaction()
    ordinary.send(topic, value=b"times out", partition=0)
    ordinary.flush()
    with Admin(broker.bootstrap) as admin:
        wait_for(lambda: admin.describe_transactions(["one-phase"])[0].state == "CompleteAbort",
                 what="the broker aborting the ordinary transaction after its timeout")
        assert admin.describe_transactions(["two-phase"])[0].state == "Ongoing"  # 2PC never times out
    ordinary.close()
    broker.stop()

    broker = broker_factory(**options)
    with Admin(broker.bootstrap) as admin:
        assert admin.describe_transactions(["two-phase"])[0].state == "Ongoing"
    Producer.complete_prepared(broker.bootstrap, handle, commit=True)
    with Consumer(broker.bootstrap, isolation_level="read_committed") as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 10)] == [b"%d" % i for i in range(10)]


def test_producer_and_consumer_ride_out_a_broker_restart(broker_factory, tmp_path, topic):
    port, data = free_port(), tmp_path / "data"
    broker = broker_factory(port=port, data_dir=data)
    consumer = Consumer(broker.bootstrap)
    consumer.assign([(topic, 0)])
    with Producer(broker.bootstrap, linger_ms=0) as p:
        for i in range(20):
            p.send(topic, value=b"%d" % i, partition=0)
        p.flush()
        before = drain(consumer, 20, settle_s=0)
        broker.stop()
        for i in range(20, 40):
            p.send(topic, value=b"%d" % i, partition=0)
        restarting = threading.Event()  # set before the broker starts: no flush can succeed before

        def restart_broker() -> None:
            restarting.set()
            broker_factory(port=port, data_dir=data)

        restart = threading.Timer(1.0, restart_broker)
        restart.start()
        p.flush()  # connection errors are retried until the broker is back
        assert restarting.is_set()
        restart.join()
    after = drain(consumer, 20)  # the same consumer reconnects and goes on from its position
    consumer.close()
    assert [m.value for m in before + after] == [b"%d" % i for i in range(40)]
