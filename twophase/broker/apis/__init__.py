"""One module per Kafka API, each registering its ``handle`` with the key and versions it serves.

Importing this package imports every handler module, which fills the registry
(:data:`twophase.broker.protocol.API_BY_KEY`); :data:`APIS` is the result, by key. A new API is a
new module here, with ``@handles(ApiKey.X, min, max)`` on its ``handle``, added to the import
below. Handlers build their response with :func:`twophase.wire.codec.build`, which keeps the
fields the requested version has. Modules starting with ``_`` are helpers, not handlers.

Example::

    from twophase.broker.apis import APIS
    [(api.name, api.min_version, api.max_version) for api in APIS]   # [("Produce", 3, 9), ...]
"""

from ..protocol import Api, served
from . import (  # noqa: F401  (importing a handler module registers it)
    add_offsets_to_txn,
    add_partitions_to_txn,
    api_versions,
    create_topics,
    delete_topics,
    describe_configs,
    describe_groups,
    describe_producers,
    describe_transactions,
    end_txn,
    fetch,
    find_coordinator,
    heartbeat,
    init_producer_id,
    join_group,
    leave_group,
    list_groups,
    list_offsets,
    list_transactions,
    metadata,
    offset_commit,
    offset_fetch,
    produce,
    sasl_authenticate,
    sasl_handshake,
    sync_group,
    txn_offset_commit,
    write_txn_markers,
)

APIS: tuple[Api, ...] = served()
