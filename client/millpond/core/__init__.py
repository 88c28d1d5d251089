"""The storage engine: schemas, configs, tiers, the buffer file and the tiered buffer.

numpy and the standard library only; knows nothing of gRPC, protobuf or sessions.
"""

from millpond.core.buffer import TieredBuffer
from millpond.core.config import BufferConfig, Prioritized
from millpond.core.info import BufferInfo
from millpond.core.schema import Field, Schema

__all__ = ["BufferConfig", "BufferInfo", "Field", "Prioritized", "Schema", "TieredBuffer"]
