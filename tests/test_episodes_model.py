"""A hypothesis state machine: episodic buffers against a plain model of interleaved writers.

The model keeps every record ever pushed (its writer's episode, its step in
the episode, a unique value) and which episodes ended and with what meta.
The live records are the last ``total_capacity``. Every check goes through
the public engine calls: windows (``sample_sequences``) must be the
episode's next stored steps from their start and never cross an end or an
evicted record, n-step sums must be the discounted rewards of those steps,
meta filters must draw only matching episodes, the catalog must list the
complete live episodes in order, and ``info()`` must count them. Persistent
machines also release and reopen the file: the episodes come back.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from millpond.core import BufferConfig, TieredBuffer
from millpond.errors import NotEnoughDataError

META = {"task": ("int64", ())}
WRITERS = 3


def value(seqs: np.ndarray) -> np.ndarray:
    """What record ``seq`` holds in ``obs`` (exact in float32)."""
    return (seqs * 10 + 3).astype(np.float32)


def seq_of(obs: float) -> int:
    return (int(obs) - 3) // 10


def reward(seqs: np.ndarray) -> np.ndarray:
    return (seqs % 5 + 1).astype(np.float32)


@dataclass
class Episode:
    id: int
    seqs: list[int] = field(default_factory=list)
    ended: bool = False
    meta: dict[str, int] = field(default_factory=dict)


class EpisodeMachine(RuleBasedStateMachine):
    @initialize(hot=st.integers(1, 6), cold=st.integers(0, 10), persistent=st.booleans(),
                prioritized=st.booleans())
    def setup(self, hot, cold, persistent, prioritized):
        self.dir = tempfile.mkdtemp(prefix="millpond-episodes-")
        self.path = os.path.join(self.dir, "b.buffer")
        self.total = hot + cold
        self.persistent = persistent
        config = BufferConfig.build(hot_capacity=hot, total_capacity=self.total, obs_dim=1,
                                    act_dim=1, episodes=True, meta_fields=META, prioritized=prioritized)
        self.buf = TieredBuffer(config, self.path, persistent=persistent)
        self.records: list[tuple[Episode, int]] = []  # (episode, step) per seq
        self.episodes: dict[int, Episode] = {}
        self.current = [self._new_episode() for _ in range(WRITERS)]

    def teardown(self):
        if getattr(self, "buf", None) is not None:
            self.buf.close()
        shutil.rmtree(getattr(self, "dir", ""), ignore_errors=True)

    def _new_episode(self) -> Episode:
        episode = Episode(len(self.episodes) * 7919 + 11)  # distinct, not dense
        self.episodes[episode.id] = episode
        return episode

    # ---- the model's views ---------------------------------------------------------------

    @property
    def first(self) -> int:
        return max(0, len(self.records) - self.total)

    def live(self, seq: int) -> bool:
        return self.first <= seq < len(self.records)

    def complete(self) -> list[Episode]:
        """Ended episodes whose first record is live, in the order of their first records."""
        done = [e for e in self.episodes.values() if e.ended and e.seqs and self.live(e.seqs[0])]
        return sorted(done, key=lambda e: e.seqs[0])

    def rest_of_episode(self, seq: int) -> list[int]:
        episode, step = self.records[seq]
        return [s for s in episode.seqs[step:] if self.live(s)]

    # ---- rules -----------------------------------------------------------------------------

    @rule(writer=st.integers(0, WRITERS - 1), n=st.integers(1, 6), end_at=st.integers(-1, 5))
    def push(self, writer, n, end_at):
        """``n`` records of one writer; the one at ``end_at`` (if any) ends its episode."""
        ids, ends = [], []
        for i in range(n):
            episode = self.current[writer]
            ids.append(episode.id)
            ends.append(i == end_at)
            self.records.append((episode, len(episode.seqs)))
            episode.seqs.append(len(self.records) - 1)
            if i == end_at:
                episode.ended = True
                self.current[writer] = self._new_episode()
        seqs = np.arange(len(self.records) - n, len(self.records))
        self.buf.push_batch({"obs": value(seqs)[:, None], "next_obs": value(seqs)[:, None] + 1,
                             "actions": np.zeros((n, 1)), "rewards": reward(seqs),
                             "terminated": np.array(ends), "truncated": np.zeros(n, bool)},
                            episodes=np.array(ids))

    @rule(writer=st.integers(0, WRITERS - 1), task=st.none() | st.integers(0, 2),
          end=st.booleans())
    def update(self, writer, task, end):
        """Meta for the writer's current episode, and/or its end."""
        episode = self.current[writer]
        if not episode.seqs and end:
            return  # the handles never end an episode they wrote nothing of
        meta = {} if task is None else {"task": task}
        self.buf.update_episodes([(episode.id, meta, end)])
        episode.meta.update(meta)
        if end:
            episode.ended = True
            self.current[writer] = self._new_episode()

    @precondition(lambda self: self.persistent)
    @rule()
    def reopen(self):
        """The file holds what is live. Documented limits: an episode in progress none
        of whose records is live is forgotten (its next records start it again), and
        so is meta given to an episode before its first record."""
        self.buf.release()
        self.buf = TieredBuffer.open(self.path)
        for writer, episode in enumerate(self.current):
            if not any(self.live(s) for s in episode.seqs):
                self.current[writer] = self.episodes[episode.id] = Episode(episode.id)

    # ---- checks ----------------------------------------------------------------------------

    @invariant()
    def counts(self):
        info = self.buf.info()
        assert info["episodes"] == len(self.complete())
        running = [e for e in self.episodes.values()
                   if not e.ended and any(self.live(s) for s in e.seqs)]
        assert info["episodes_in_progress"] == len(running)

    @invariant()
    def windows(self):
        if not len(self.records) - self.first:
            with pytest.raises(NotEnoughDataError):
                self.buf.sample_sequences(2, 3, seed=0)
            return
        seq_len = 4
        out = self.buf.sample_sequences(8, seq_len, seed=len(self.records))
        for row in range(8):
            start = seq_of(out["obs"][row, 0, 0])
            episode, step = self.records[start]
            want = self.rest_of_episode(start)[:seq_len]
            assert out["lens"][row] == len(want)
            assert out["mask"][row].tolist() == [i < len(want) for i in range(seq_len)]
            assert out["obs"][row, :len(want), 0].tolist() == value(np.array(want)).tolist()
            assert not out["obs"][row, len(want):].any()  # zero-padded
            assert out["episode_ids"][row] == episode.id
            assert out["start_steps"][row] == step
            assert out["task"][row] == episode.meta.get("task", 0)

    @invariant()
    def n_step(self):
        if not len(self.records) - self.first:
            return
        out = self.buf.sample(6, seed=len(self.records) + 1, n_step=3, gamma=0.5) \
            if len(self.records) - self.first >= 6 else None
        for row in range(0 if out is None else 6):
            steps = self.rest_of_episode(seq_of(out["obs"][row, 0]))[:3]
            assert out["n_step_lens"][row] == len(steps)
            want = sum(0.5 ** k * reward(np.array([s]))[0] for k, s in enumerate(steps))
            assert out["rewards"][row] == pytest.approx(want, rel=1e-6)
            assert out["next_obs"][row, 0] == value(np.array([steps[-1]]))[0] + 1

    @invariant()
    def filters(self):
        if not len(self.records) - self.first:
            return
        matching = [s for s in range(self.first, len(self.records))
                    if self.records[s][0].meta.get("task", 0) == 1]
        if not matching:
            with pytest.raises(NotEnoughDataError):
                self.buf.sample(1, seed=0, filter_meta={"task": 1})
            return
        k = min(5, len(self.records) - self.first)  # sample's rule: no more than it holds
        out = self.buf.sample(k, seed=1, filter_meta={"task": 1})
        assert {seq_of(v) for v in out["obs"][:, 0]} <= set(matching)

    @invariant()
    def catalog(self):
        catalog = self.buf.episode_catalog()
        complete = self.complete()
        assert catalog["episode_ids"].tolist() == [e.id for e in complete]
        assert catalog["lens"].tolist() == [len(e.seqs) for e in complete]
        assert catalog["seqs"].tolist() == [s for e in complete for s in e.seqs]
        assert catalog["task"].tolist() == [e.meta.get("task", 0) for e in complete]
        if complete:
            out = self.buf.sample_episodes(4, seed=2)
            for row in range(4):
                episode = self.episodes[int(out["episode_ids"][row])]
                n = len(episode.seqs)
                assert out["lens"][row] == n
                assert out["obs"][row, :n, 0].tolist() == value(np.array(episode.seqs)).tolist()
        else:
            with pytest.raises(NotEnoughDataError):
                self.buf.sample_episodes(1)


EpisodeMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("MILLPOND_MODEL_EXAMPLES", 120)),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEpisodeModel = EpisodeMachine.TestCase
