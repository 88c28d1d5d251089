"""The objectrl adapter against the real objectrl 0.2.1's ReplayBuffer: identical call
sequences on both, compared call by call (keys, batch sizes, dtypes and values; random
batches too: both draw objectrl's slots from torch's global generator, so one seed gives
one batch). objectrl needs Python 3.12 and a multi-GB torch: ``make test-objectrl`` runs
this file in .venv-objectrl; elsewhere it is skipped.
"""

from __future__ import annotations

import itertools
import random
import warnings

import pytest

objectrl_memory = pytest.importorskip("objectrl.replay_buffers.experience_memory")
torch = pytest.importorskip("torch")
from tensordict import NonTensorData, TensorDict  # noqa: E402

from millpond.integrations.objectrl import ReplayBuffer, use_millpond  # noqa: E402

CPU = torch.device("cpu")
N_SEQUENCES = 57
_names = itertools.count()


@pytest.fixture(params=["local", pytest.param("server", marks=pytest.mark.daemon)])
def where(request):
    if request.param == "local":
        return {}
    shared_server = request.getfixturevalue("shared_server")
    return {"address": shared_server.address, "name": f"objectrl-real-{next(_names)}"}


# ---- records: each call builds fresh TensorDicts for each buffer ---------------------------

def record(kind: str, k: int, variant: str, rb: tuple[int, ...]) -> TensorDict:
    """One experience of batch size ``rb`` for schema ``kind``."""
    fields = {"state": torch.full((*rb, 3), float(k)), "reward": torch.full(rb, k / 2),
              "step": torch.full(rb, k, dtype=torch.int64),
              "done": torch.full(rb, k % 3 == 2)}
    if kind in ("bf16", "mixed"):
        fields["q"] = (torch.arange(2.0) + k / 7).expand(*rb, 2).to(torch.bfloat16)
    if kind in ("strings", "mixed"):
        fields["tag"] = NonTensorData(f"tag-{k}", batch_size=list(rb))
        fields["meta"] = {"source": NonTensorData("env", batch_size=list(rb)),
                          "seed": torch.full(rb, k, dtype=torch.int32)}
    if variant == "extra":
        fields["extra"] = torch.full(rb, 5.0)
    if variant == "missing":
        del fields["reward"]
    if variant == "dtype":
        fields["reward"] = torch.full(rb, k, dtype=torch.int64)  # cast to the stored float
    return TensorDict(fields, batch_size=list(rb))


def batch(kind: str, k0: int, n: int, variant: str, rb: tuple[int, ...]) -> TensorDict:
    return torch.stack([record(kind, k0 + i, variant, rb) for i in range(n)])


def make_sequence(seed: int) -> list[tuple]:
    rng = random.Random(seed)
    kind = ["plain", "bf16", "strings", "mixed"][seed % 4]
    rb = [(), (), (2,), (3,)][(seed // 4) % 4]  # 2-D batch sizes: records of batch [T]
    size = rng.choice([3, 5, 8])
    ops: list[tuple] = [("new", size, kind, rb)]
    k = 0
    for _ in range(rng.randint(8, 18)):
        op = rng.choice(["add", "add", "add_batch", "sample", "index", "fields", "all",
                         "len", "reset"])
        if op == "add":
            variant = rng.choice(["", "", "", "extra", "missing", "dtype"]) if k else ""
            ops.append(("add", k, variant))
            k += 1
        elif op == "add_batch":
            n = rng.randint(1, size + 2)
            variant = rng.choice(["", "", "extra", "missing"]) if k else ""
            ops.append(("add_batch", k, n, variant))
            k += n
        elif op == "sample":
            ops.append(("sample", rng.choice([0, 1, 4, size + 3]), rng.randrange(1000)))
        elif op == "index":
            ops.append(("index", [rng.randint(-size - 1, size) for _ in range(rng.randint(1, 4))]
                        + [-1]))
        elif op == "fields":
            ops.append(("fields", [rng.randint(0, size - 1)], rng.choice(
                ["step", "state", "index", ("meta", "seed") if kind in ("strings", "mixed")
                 else "reward"])))
        elif op == "reset":
            ops.append(("reset", rng.choice([None, None, size + 1])))
        else:
            ops.append((op,))
    return ops


def snapshot(value):
    """What a call returned, comparable across the two buffers."""
    if isinstance(value, TensorDict):
        out = {"batch_size": list(value.batch_size)}
        for key in sorted(value.keys(True, True, is_leaf=_is_leaf), key=str):
            leaf = value.get(key)
            if isinstance(leaf, torch.Tensor):
                out[str(key)] = (str(leaf.dtype), list(leaf.shape),
                                 leaf.float().tolist() if leaf.dtype == torch.bfloat16
                                 else leaf.tolist())
            else:
                out[str(key)] = ("non-tensor", leaf.tolist())
        return out
    return value


def _is_leaf(cls):
    from tensordict.base import _is_leaf_nontensor
    return _is_leaf_nontensor(cls)


def run(buf_factory, ops) -> list:
    trace: list = []
    buf = None
    kind, rb = "plain", ()
    for op in ops:
        name, *args = op
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if name == "new":
                    size, kind, rb = args
                    buf = buf_factory(size)
                    got = None
                elif name == "add":
                    got = buf.add(record(kind, args[0], args[1], rb))
                elif name == "add_batch":
                    got = buf.add_batch(batch(kind, args[0], args[1], args[2], rb))
                elif name == "sample":
                    torch.manual_seed(args[1])
                    got = buf.sample_batch(args[0])
                elif name == "index":
                    got = buf.sample_by_index(list(args[0]))
                elif name == "fields":
                    got = buf.sample_by_index_fields(list(args[0]), args[1])
                elif name == "all":
                    got = buf.sample_all()
                elif name == "len":
                    got = (len(buf), buf.size, buf.pointer)
                elif name == "reset":
                    got = buf.reset(args[0])
            trace.append((op, "ok", snapshot(got)))
        except Exception as exc:  # noqa: BLE001 - which calls raise is part of the trace
            trace.append((op, "raises", type(exc).__name__))
    if hasattr(buf, "close"):
        buf.close()
    return trace


@pytest.mark.parametrize("seed", range(N_SEQUENCES))
def test_same_calls_same_results(seed, where):
    ops = make_sequence(seed)
    real = run(lambda size: objectrl_memory.ReplayBuffer(CPU, CPU, size), ops)
    names = itertools.count()
    ours = run(lambda size: ReplayBuffer(
        CPU, CPU, size, **({**where, "name": f"{where['name']}-{next(names)}"} if where else {})),
        ops)
    for (op, status, got), (_, our_status, our_got) in zip(real, ours):
        if status == "raises":  # objectrl refuses it: so must the adapter
            assert our_status == "raises", (op, got, our_got)
            if op[0] in ("add", "add_batch"):
                break  # objectrl's refused write may be half done (its storage written key by
                # key, its counters not): the rest is no sequence objectrl accepts
        else:
            assert (our_status, our_got) == (status, got), op


def test_the_differences_the_issue_lists():
    """Each one named: string keys, index, 2-D batches, [-1], bfloat16, sample_batch(0),
    an extra key without a reset."""
    for buf in (objectrl_memory.ReplayBuffer(CPU, CPU, 4), ReplayBuffer(CPU, CPU, 4)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            buf.add_batch(batch("mixed", 0, 3, "", (2,)))
            buf.add(record("mixed", 3, "extra", (2,)))  # no reset: the extra key is dropped
            got = buf.sample_all()
        assert got.batch_size == torch.Size([4, 2])
        assert got["tag"] == [["tag-0"] * 2] * 4  # objectrl keeps the first value of a string
        assert got["meta", "source"] == [["env"] * 2] * 4
        assert got["index"].tolist() == [[k, k] for k in range(4)]
        assert got["q"].dtype == torch.bfloat16 and "extra" not in got.keys()
        assert buf.sample_by_index([-1])["step"].tolist() == [[3, 3]]
        with pytest.raises(Exception):  # noqa: B017 - objectrl's: with string keys
            buf.sample_batch(0)
    for buf in (objectrl_memory.ReplayBuffer(CPU, CPU, 4), ReplayBuffer(CPU, CPU, 4)):
        buf.add_batch(batch("bf16", 0, 3, "", (2,)))
        assert buf.sample_batch(0).batch_size == torch.Size([0, 2])


def test_an_agent_takes_the_buffer_through_use_millpond(tmp_path, where):
    gym = pytest.importorskip("gymnasium")
    from objectrl.config.config import MainConfig
    from objectrl.models.get_model import get_model

    config = MainConfig.from_config({
        "model": {"name": "sac"}, "system": {"device": "cpu", "storing_device": "cpu"},
        "training": {"buffer_size": 1000}, "logging": {"result_path": str(tmp_path)}})
    config.env.env = gym.make("Pendulum-v1")
    agent = get_model(config)
    memory = use_millpond(agent, **where)
    assert agent.experience_memory is memory and memory.buffer_size == 1000
    state = torch.zeros(3)
    for step in range(20):
        agent.store_transition(agent.generate_transition(
            state=state, action=torch.zeros(1), reward=1.0, next_state=state + 1,
            terminated=False, truncated=False, step=step))
    assert len(agent.experience_memory) == 20
    assert agent.experience_memory.sample_batch(8)["state"].shape == (8, 3)
    memory.close()
