"""When inserts and samples may proceed: Reverb's rate-limiter rule, plus its statistics.

A :class:`RateLimiter` is configuration (immutable, part of a buffer's
config); a :class:`RateState` is one buffer's counters. The rule, for ``n``
records to insert or ``k`` to sample, with ``inserts`` and ``samples``
counted since the buffer was created (or reopened) and ``size`` the records
it holds now::

    insert may proceed  iff  size + n <= min_size_to_sample
                             or (inserts + n) * samples_per_insert - samples <= max_diff
    sample may proceed  iff  size >= min_size_to_sample
                             and inserts * samples_per_insert - (samples + k) >= min_diff

So ``inserts * samples_per_insert - samples`` stays within ``[min_diff,
max_diff]``: learners cannot run ahead of actors, nor actors ahead of
learners, by more than the band. No locking here: the buffer's lock guards
the state; :meth:`RateState.wait_until` makes calls wait on a condition of
that lock, and :meth:`RateState.changed` wakes them.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

from millpond.core.checks import is_integral, is_real
from millpond.errors import InvalidArgumentError, InvalidConfigError, RateLimitTimeoutError


@dataclass(frozen=True)
class RateLimiter:
    """How far samples may run ahead of (or behind) ``samples_per_insert * inserts``.

    Build one with :func:`MinSize`, :func:`SampleToInsertRatio` or :func:`Queue`.
    """

    samples_per_insert: float = 1.0
    min_size_to_sample: int = 1
    min_diff: float = -math.inf
    max_diff: float = math.inf

    def __post_init__(self) -> None:
        spi, size = self.samples_per_insert, self.min_size_to_sample
        if not is_real(spi) or isinstance(spi, bool) or not 0 < spi < math.inf:
            raise InvalidConfigError(f"samples_per_insert must be a finite number > 0, got {spi!r}")
        if not is_integral(size) or isinstance(size, bool) or size < 1:
            raise InvalidConfigError(f"min_size_to_sample must be an integer >= 1, got {size!r}")
        for label in ("min_diff", "max_diff"):
            value = getattr(self, label)
            if not is_real(value) or isinstance(value, bool) or math.isnan(value):
                raise InvalidConfigError(f"{label} must be a number, got {value!r}")
        if not self.min_diff <= self.max_diff:
            raise InvalidConfigError(
                f"min_diff ({self.min_diff}) must be <= max_diff ({self.max_diff})")
        object.__setattr__(self, "samples_per_insert", float(spi))
        object.__setattr__(self, "min_size_to_sample", int(size))
        object.__setattr__(self, "min_diff", float(self.min_diff))
        object.__setattr__(self, "max_diff", float(self.max_diff))

    @property
    def band(self) -> float:
        return self.max_diff - self.min_diff

    @property
    def centre(self) -> float:
        """The diff at the middle of the band (where counters restart after a reopen)."""
        if math.isinf(self.band):  # unbounded on a side: where min size leaves it, within
            at_min_size = self.samples_per_insert * self.min_size_to_sample
            return min(max(at_min_size, self.min_diff), self.max_diff)
        return (self.min_diff + self.max_diff) / 2

    def check_insert(self, n: int) -> None:
        """Reject a batch that could never be admitted, even with no one else around."""
        if n * self.samples_per_insert > self.band and n > self.min_size_to_sample:
            raise InvalidArgumentError(
                f"a batch of {n} records can never pass this buffer's rate limiter: "
                f"{n} x samples_per_insert {self.samples_per_insert:g} exceeds its tolerance "
                f"band of {self.band:g}; push smaller batches"
            )

    def check_sample(self, k: int) -> None:
        if k > self.band:
            raise InvalidArgumentError(
                f"a sample of {k} records can never pass this buffer's rate limiter: it "
                f"exceeds its tolerance band of {self.band:g}; sample smaller batches"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (infinities as None)."""
        return {k: (None if isinstance(v, float) and math.isinf(v) else v)
                for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> "RateLimiter":
        min_diff, max_diff = spec.get("min_diff"), spec.get("max_diff")
        return cls(spec["samples_per_insert"], spec["min_size_to_sample"],
                   -math.inf if min_diff is None else min_diff,
                   math.inf if max_diff is None else max_diff)


def MinSize(min_size_to_sample: int) -> RateLimiter:  # noqa: N802 (a preset, named like Reverb's)
    """Block sampling until the buffer holds ``min_size_to_sample`` records; nothing else."""
    return RateLimiter(1.0, min_size_to_sample)


def SampleToInsertRatio(samples_per_insert: float, min_size_to_sample: int,  # noqa: N802
                        error_buffer: float | tuple[float, float]) -> RateLimiter:
    """Hold sampled records per inserted record near ``samples_per_insert``.

    ``error_buffer`` is the tolerance: a number ``e`` allows the diff
    ``inserts * samples_per_insert - samples`` to stray ``e`` either side of
    ``samples_per_insert * min_size_to_sample``; a pair is ``(min_diff,
    max_diff)`` directly. Keep the band wider than one push batch times
    ``samples_per_insert`` plus one sample batch, or a waiting push and a
    waiting sample can only end by timing out.
    """
    if isinstance(error_buffer, tuple):
        min_diff, max_diff = error_buffer
    else:
        if not is_real(error_buffer) or isinstance(error_buffer, bool) \
                or not error_buffer >= 0:
            raise InvalidConfigError(f"error_buffer must be a number >= 0, got {error_buffer!r}")
        offset = samples_per_insert * min_size_to_sample
        min_diff, max_diff = offset - error_buffer, offset + error_buffer
    return RateLimiter(samples_per_insert, min_size_to_sample, min_diff, max_diff)


def Queue(size: int) -> RateLimiter:  # noqa: N802
    """A queue of at most ``size`` records: inserts wait when full, samples when empty.

    Meant for buffers whose sampling removes what it returns (queue and stack
    modes), where ``inserts - samples`` is the number of records held.
    """
    return RateLimiter(1.0, 1, 0.0, float(size))


class WaitCounts:
    """Waits for a rate limiter, by kind ("insert", "sample"): those that ended, their
    seconds, and those under way; as :class:`~.info.BufferInfo`'s fields. The engine
    counts the waits of its own calls; a server counts those it parks."""

    def __init__(self) -> None:
        self.ended = {"insert": 0, "sample": 0}
        self.seconds = {"insert": 0.0, "sample": 0.0}
        self.now = {"insert": 0, "sample": 0}

    def started(self, kind: str) -> None:
        self.now[kind] += 1

    def finished(self, kind: str, seconds: float) -> None:
        self.now[kind] -= 1
        self.ended[kind] += 1
        self.seconds[kind] += seconds

    def stats(self) -> dict[str, Any]:
        """Finished waits, their total seconds, and the calls waiting now."""
        return {
            "insert_waits": self.ended["insert"],
            "sample_waits": self.ended["sample"],
            "insert_wait_seconds": self.seconds["insert"],
            "sample_wait_seconds": self.seconds["sample"],
            "waiting_inserts": self.now["insert"],
            "waiting_samples": self.now["sample"],
        }


class RateState:
    """One buffer's counters, its waits, and the rule applied to them.

    Every method runs with the buffer's ``lock`` held.
    """

    def __init__(self, limiter: RateLimiter | None, lock: Any = None):
        self.limiter = limiter
        # Waiting calls sleep here; every change that may let them proceed notifies it.
        self._cond = threading.Condition(lock or threading.Lock())
        self.inserts = 0
        self.samples = 0
        self.offset = 0.0  # added to the diff: a reopened buffer restarts mid-band
        self.waits = WaitCounts()

    def restart(self, size: int, removes: bool) -> None:
        """After a reopen (counters are not persisted): where should the diff be?

        When every sample removes a record (queue, stack), ``size`` records
        are ``size`` inserts not yet sampled; otherwise restart mid-band.
        """
        if self.limiter is not None:
            self.offset = (size * self.limiter.samples_per_insert if removes
                           else self.limiter.centre)

    def reset(self) -> None:
        """After the buffer's reset: the diff starts again at 0, as at creation. The
        counters go on counting (``info()`` and the metrics report them as totals)."""
        self.offset -= self.diff()

    def diff(self, inserts: int = 0, samples: int = 0) -> float:
        """``inserts * samples_per_insert - samples``, after the given extra ones."""
        spi = self.limiter.samples_per_insert if self.limiter else 1.0
        return (self.inserts + inserts) * spi - (self.samples + samples) + self.offset

    def can_insert(self, n: int, size: int) -> bool:
        lim = self.limiter
        if lim is None or size + n <= lim.min_size_to_sample:
            return True
        return self.diff(inserts=n) <= lim.max_diff

    def can_sample(self, k: int, size: int) -> bool:
        lim = self.limiter
        if lim is None:
            return True
        if size < lim.min_size_to_sample:
            return False
        return self.diff(samples=k) >= lim.min_diff

    def describe(self, size: int) -> str:
        """The state in words, for timeout messages."""
        lim = self.limiter
        if lim is None:
            return f"{size} records held"
        return (f"{size} records held, min size to sample {lim.min_size_to_sample}; "
                f"{self.inserts} inserts x {lim.samples_per_insert:g} - {self.samples} samples"
                + (f" + {self.offset:g} from before the reopen or reset" if self.offset else "")
                + f" = diff {self.diff():g}, allowed band [{lim.min_diff:g}, {lim.max_diff:g}]")

    # ---- waiting --------------------------------------------------------------------

    def wait_until(self, kind: str, n: int, ready: Callable[[], bool], timeout: float | None,
                   size: Callable[[], int], still_open: Callable[[], None],
                   need: int = 0) -> None:
        """Wait until ``ready()``, at most ``timeout`` seconds (None: no limit); count the wait.

        ``size()`` is the buffer's size (for messages); ``still_open()``
        raises if the buffer was closed meanwhile. The RateLimitTimeoutError
        says what waited (``kind``, ``n`` records): a caller that only tries
        (``timeout=0``) may wait elsewhere and retry. ``need``: records the call needs
        held (a sample's batch size), named in the message while fewer are.
        """
        if ready():
            return
        if timeout == 0:  # a try-only call is not a wait
            raise self._timeout_error(kind, n, timeout, size(), need)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        self.waits.started(kind)
        try:
            while not ready():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._timeout_error(kind, n, timeout, size(), need)
                self._cond.wait(remaining)
                still_open()
        finally:
            self.waits.finished(kind, time.monotonic() - start)

    def _timeout_error(self, kind: str, n: int, timeout: float | None, size: int,
                       need: int) -> RateLimitTimeoutError:
        state = self.describe(size)
        if size < need:  # say so first: it is what the call waits for most plainly
            state = f"fewer than the {need} records a sample of {n} needs; {state}"
        return RateLimitTimeoutError(
            f"{kind} timed out after {timeout:g} s waiting for the rate limiter ({state})",
            kind, n, state)

    def changed(self) -> None:
        """Wake waiting calls: the state has changed (or the buffer closed)."""
        if self.limiter is not None:
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """Counters, the current ratio, and the waits (:meth:`WaitCounts.stats`)."""
        return {
            "inserts": self.inserts,
            "samples": self.samples,
            "samples_per_insert": self.samples / self.inserts if self.inserts else 0.0,
            **self.waits.stats(),
        }
