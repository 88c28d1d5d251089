"""The storage engine: schemas, tiers, the cold file and the tiered buffer.

numpy and the standard library only; knows nothing of gRPC or sessions.
"""

from .buffer import TieredBuffer
from .schema import Field, Schema

__all__ = ["Field", "Schema", "TieredBuffer"]
