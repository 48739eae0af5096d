"""The Kafka wire format, shared by the broker (:mod:`twophase.broker`) and the client
(:mod:`twophase.client`); it imports neither, so a client never loads the broker.

- :mod:`.codec` - request/response frames on top of kio, with bounds-checked request decoding;
- :mod:`.records` - RecordBatch v2: batch headers, validation, control markers, whole records;
- :mod:`.varint` - the zigzag varints inside records;
- :mod:`.api_keys` - the Kafka API keys (:class:`~.api_keys.ApiKey`);
- :mod:`.errors` - :class:`~.errors.KafkaError`, the base of every error with a Kafka error code.

Import the module you need (``from twophase.wire.records import iter_batches``); this package
re-exports nothing.
"""
