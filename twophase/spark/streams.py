"""The batch path's entry points: ``register``, ``write_stream``, ``await_committed``.

- :func:`register` adds twophase's data sources to a session (``twophase-kafka``: Spark's Kafka
  source and sink contract; ``twophase``: any TwoPhaseCommitSink) and starts the session's
  :class:`~twophase.spark.discovery.WriterDiscovery`, which gives each query written through them
  its app's driver hook (publisher, embedded coordinator).
- :func:`write_stream` returns a ``DataStreamWriter`` that writes ``df`` through any sink, an Arrow
  batch at a time, exactly once.
- :func:`await_committed` blocks until every epoch a batch-path query completed is committed.

Example::

    from twophase.spark import await_committed, register, write_stream
    register(spark)
    query = (df.writeStream.format("twophase-kafka")
             .option("kafka.bootstrap.servers", "127.0.0.1:9092").option("topic", "out")
             .option("twophase.zk", "127.0.0.1:2181").option("twophase.app", "orders")
             .option("checkpointLocation", "/data/ck/orders").start())
    query = write_stream(df, FileSink("/data/out"), app="files", zk="127.0.0.1:2181") \\
        .option("checkpointLocation", "/data/ck/files").start()
    await_committed(query)
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql.streaming import DataStreamWriter, StreamingQuery

from coordinator.app import CommitPolicy
from coordinator.layout import DEFAULT_ROOT, AppPaths
from coordinator.zk import shared_client
from twophase.signing import load_secret
from twophase.sink import TwoPhaseCommitSink
from twophase.spark.discovery import WriterDiscovery, write_options
from twophase.spark.driver import DriverHook, HookConfig
from twophase.spark.kafka_sink import kafka_hook
from twophase.spark.queries import QueryWatcher
from twophase.spark.sink_options import ExactlyOnce, check_app_settings, check_sink, exactly_once
from twophase.spark.source import KafkaSource
from twophase.spark.stream_sink import SINK_DIGEST, SINK_FORMAT, SinkFormat, arrow_schema, sink_digest
from twophase.spark.waiter import await_watermark
from twophase.supervisor import Supervision


def register(spark) -> None:
    """Register twophase's data sources (``twophase-kafka``, ``twophase``) on ``spark`` and start its
    writer discovery. Idempotent: a source this function registered is kept (registering again would log
    Spark's "replaced" WARNING); one registered by ``spark.dataSource.register`` is registered again."""
    manager = spark._jsparkSession.sessionState().dataSourceManager()  # no Python API asks whether one exists
    for source in (KafkaSource, SinkFormat):
        if not manager.dataSourceExists(source.name()) or not _shares_environment_safely(manager, source.name()):
            _register_with_shared_environment(spark, source)
    WriterDiscovery.start(spark, {KafkaSource.name(): kafka_hook, SINK_FORMAT: lambda options: None})


def _shares_environment_safely(manager, name: str) -> bool:
    environment = manager.lookupDataSource(name).dataSourceCls().envVars()
    return environment.getClass().getName() == "java.util.concurrent.ConcurrentHashMap"


def _register_with_shared_environment(spark, source: type) -> None:
    """``spark.dataSource.register(source)``, with the source's worker environment in a map threads may share.

    Spark keeps one environment map per registered Python data source, in every function it makes for it, and
    its streaming source runner adds its settings to that map in place (``PythonStreamingSourceRunner.init``,
    PySpark 4.3), on the thread of each query that starts, while other queries serialize the same map into their
    tasks. With Spark's ``java.util.HashMap``, two queries starting together on one source can corrupt it, and
    then every task of both fails to deserialize (``java.io.OptionalDataException``; seen once in the demo's
    restart, which starts two queries on one ``twophase-kafka`` DataFrame). A ``ConcurrentHashMap`` takes
    concurrent writes and serializes whole. Otherwise this is what ``DataSourceRegistration.register`` does.
    """
    from pyspark.core.rdd import _prepare_for_python_RDD

    sc = spark.sparkContext
    jvm = sc._jvm
    pickled, broadcast_vars, environment, includes = _prepare_for_python_RDD(sc, source)
    function = jvm.SimplePythonFunction(bytearray(pickled), jvm.java.util.concurrent.ConcurrentHashMap(environment),
                                        includes, sc.pythonExec, sc.pythonVer, broadcast_vars, sc._javaAccumulator)
    data_source = getattr(jvm, "org.apache.spark.sql.execution.datasources.v2.python.UserDefinedPythonDataSource")
    spark._jsparkSession.dataSource().registerPython(source.name(), data_source(function))


def write_stream(df: DataFrame, sink: TwoPhaseCommitSink, app: str, zk: str, *, root: str = DEFAULT_ROOT,
                 coordinator: str = "embedded", policy: CommitPolicy | None = None,
                 supervision: Supervision | None = None) -> DataStreamWriter:
    """``df.writeStream`` set up to write through ``sink`` exactly once, an Arrow batch at a time.

    Stores the sink (signed) for ``app`` and starts its driver hook, as ``TwoPhaseSink`` does; add
    the checkpoint location, trigger and so on, then ``start()``. The secret comes from
    :func:`twophase.signing.load_secret`'s usual places, in the driver and on the executors::

        query = write_stream(df, FileSink("/data/out", format="parquet"), app="orders", zk="zk:2181") \\
            .option("checkpointLocation", "/data/ck/orders").start()
    """
    check_sink(sink, takes_rows=True)
    check_app_settings(app, root, coordinator)
    sink.check_target(arrow_schema(df.schema))
    spark = df.sparkSession
    register(spark)
    config = HookConfig(zk, root, app, load_secret(), coordinator, policy or CommitPolicy(), supervision or Supervision())
    hook = DriverHook.acquire(config, sink, spark)
    WriterDiscovery.start(spark, {}).hold(hook)
    return (df.writeStream.format(SINK_FORMAT).option("twophase.zk", zk).option("twophase.app", app)
            .option("twophase.root", root).option("twophase.coordinator", coordinator)
            .option(SINK_DIGEST, stored_digest(hook)))


def stored_digest(hook: DriverHook) -> str:
    """The digest of the sink ``hook`` stored for its app: the ``twophase`` format's writers check it."""
    return sink_digest(hook.client.retry(hook.client.get, hook.paths.sink)[0])


def await_committed(query: StreamingQuery, timeout: float = 60.0) -> int | None:
    """Block until every epoch Spark completed for a batch-path ``query`` is committed; return it.

    None if the query completed no epoch. TimeoutError after ``timeout``; HookFailed at once if the
    app's driver hook stopped for good; ValueError for a query twophase refuses (async progress tracking).
    """
    last = QueryWatcher.snapshot_of(query._jsq).accepted().last_batch
    if last is None:
        return None
    planned = write_options(query._jsq)
    if planned is not None:
        where = exactly_once(planned[1], also=planned[1])
        hook = DriverHook.current((where.zk, where.root, where.app))
    else:  # a restarted run that planned no batch yet (no new input): its epochs are earlier runs'
        holding = DriverHook.holding(str(query.id))
        if len(holding) != 1:
            raise ValueError(f"query {query.id} has planned no batch in this run, and {len(holding)} twophase apps "
                             "of this driver hold its state: cannot tell which one to wait for")
        hook = holding[0]
        where = ExactlyOnce(hook.config.zk, hook.config.app, hook.config.root)
    watermark = AppPaths(where.root, where.app).query(str(query.id)).watermark
    # Its own client: the discovery releases the hook (closing the hook's client) the moment all is committed.
    return await_watermark(shared_client(where.zk), watermark, last, timeout, where.app,
                           failure=lambda: hook.failure if hook is not None else None)
