"""The same-host fast path: bulk data through sealed memfd segments, control over a Unix socket.

Negotiated over gRPC (``Negotiate``); when client and server share a host,
a user and a network namespace, the client opens a ``SOCK_SEQPACKET`` Unix
socket (abstract namespace: nothing on any file system, gone when the server
dies) and moves batches through memory both sides map:

* push: the client writes the batch once into its own sealed memfd, which the
  server maps read-only and copies once into the buffer;
* sample: the server gathers the batch once into a sealed memfd it owns,
  which the client maps read-only and hands out as numpy arrays, no copy.

See :mod:`.protocol` for the messages and :mod:`.memfd` for the segments.
"""
