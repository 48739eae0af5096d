"""One module per Kafka API; each has ``async def handle(broker, request)``.

The version ranges live in :mod:`twophase.broker.protocol`. Handlers build their response with
:func:`twophase.broker.codec.build`, which keeps the fields the requested version has.
"""
