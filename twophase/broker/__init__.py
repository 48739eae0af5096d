"""The built-in log broker: a durable partitioned log that speaks the Kafka wire protocol.

Any Kafka client (confluent-kafka/librdkafka, kcat, kafka-python, aiokafka) can produce to it
and consume from it. Layout:

- :mod:`.storage` - partition logs, segments, producer state, aborted-transaction index, topics;
- :mod:`.txn` - the transaction coordinator: transactional ids, state machine, durable transaction log;
- :mod:`.groups` - the consumer-group coordinator and committed offsets;
- :mod:`.server` - asyncio TCP server: framing, size limit, per-connection request loop;
- :mod:`.protocol` - the registry of served APIs and version ranges (each handler registers itself);
- :mod:`.apis` - one module per API (Produce, Fetch, ListOffsets, Metadata, ...);
- :mod:`twophase.wire` (shared with the client) - the wire codec, record batches, API keys, errors;
- :mod:`.broker` - the embeddable :class:`Broker` (start/stop, port, data directory state);
- :mod:`.cli` - the ``twophase broker`` command.

Example::

    from twophase.broker import Broker

    with Broker("/tmp/broker-data", default_partitions=3) as broker:
        print(broker.bootstrap)      # "127.0.0.1:<port>"
"""

from .apis import APIS
from .broker import Broker, BrokerConfig

__all__ = ["APIS", "Broker", "BrokerConfig"]
