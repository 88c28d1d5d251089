"""The storage engine: schemas, configs, tiers, the buffer file and the tiered buffer.

numpy and the standard library only; knows nothing of gRPC, protobuf or sessions.
"""

from .buffer import TieredBuffer
from .config import BufferConfig, Prioritized
from .info import BufferInfo
from .schema import Field, Schema

__all__ = ["BufferConfig", "BufferInfo", "Field", "Prioritized", "Schema", "TieredBuffer"]
