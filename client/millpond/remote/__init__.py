"""The remote backend: a buffer on a millpond daemon, and the transports that reach it.

``buffer.py``: :class:`RemoteBuffer` (``writes.py``: the writes it shares with the
sharded backend; ``batcher.py``: single ``push`` calls sent in batches;
``push_window.py``: pushes in flight); ``connection.py``: one process's connection and
its one fallback policy; ``grpc_transport.py``, ``grpc_streams.py``: gRPC;
``shm/``: the same-host shared-memory fast path; ``security.py``: tokens and TLS.

Nothing is imported here: the daemon uses ``shm.protocol``, ``shm.memfd`` and
``malloc`` without loading the client library.
"""
