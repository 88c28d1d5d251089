"""The objectrl adapter against objectrl's semantics (its docs and source).

objectrl itself is not on PyPI (and needs TorchRL), so the reference here is
what its ``ReplayBuffer`` does over TorchRL's ``LazyMemmapStorage``: a ring of
``buffer_size`` slots, the ``k``-th record added in slot ``k % buffer_size``,
reads by slot, epochs over slots in order. Every test runs in-process and on
a real server.
"""

from __future__ import annotations

import itertools

import pytest

import millpond

_names = itertools.count()

# Imported by the fixture below when the first test here runs, not when the suite is collected.
torch = TensorDict = ReplayBuffer = CPU = None


@pytest.fixture(scope="module", autouse=True)
def frameworks():
    global torch, TensorDict, ReplayBuffer, CPU
    torch = pytest.importorskip("torch")
    pytest.importorskip("tensordict")
    from tensordict import TensorDict

    from millpond.integrations.objectrl import ReplayBuffer

    CPU = torch.device("cpu")


@pytest.fixture(params=["local", pytest.param("server", marks=pytest.mark.daemon)])
def where(request):
    if request.param == "local":
        return {}
    shared_server = request.getfixturevalue("shared_server")
    return {"address": shared_server.address, "name": f"objectrl-{next(_names)}"}


def transition(k: int) -> TensorDict:
    """What objectrl's ``Agent.generate_transition`` builds: floats, an int, tensors."""
    return TensorDict({
        "state": torch.full((4,), float(k)), "action": torch.tensor([k / 10.0]),
        "reward": float(k), "next_state": torch.full((4,), k + 1.0),
        "terminated": float(k % 7 == 6), "truncated": 0.0, "step": k,
    })


def ring(n_added: int, size: int) -> list[int]:
    """The reference's slots after ``n_added`` adds: slot s holds record k, k % size == s."""
    held = min(n_added, size)
    slots = [0] * held
    for k in range(max(0, n_added - size), n_added):
        slots[k % size] = k
    return slots


def test_adds_and_samples_tensordicts_as_objectrl_does(where):
    buf = ReplayBuffer(CPU, CPU, 100, **where)
    assert len(buf) == 0 and buf.size == 0
    for k in range(30):
        buf.add(transition(k))
    assert len(buf) == buf.size == buf.data_size == 30 and buf.pointer == 30
    batch = buf.sample_batch(16)
    assert isinstance(batch, TensorDict) and batch.batch_size == torch.Size([16])
    assert batch.device == CPU
    want = transition(0)
    for key in want.keys():
        assert batch[key].dtype == want[key].dtype, key
        assert batch[key].shape == (16, *want[key].shape), key
    steps = batch["step"]
    assert torch.equal(batch["state"][:, 0], steps.float())  # rows are whole records
    assert torch.equal(batch["next_state"][:, 0], steps.float() + 1)
    assert buf.sample_random(64).batch_size == torch.Size([64])  # more than held: allowed
    torch.manual_seed(4)
    first = buf.sample_batch(8)["step"]
    torch.manual_seed(4)
    if not where:  # in-process draws follow torch's seed
        assert torch.equal(first, buf.sample_batch(8)["step"])
    buf.close()


def test_indices_are_objectrls_ring_slots(where):
    buf = ReplayBuffer(CPU, CPU, 10, **where)
    for k in range(7):
        buf.add(transition(k))
    assert buf.sample_by_index([6, 0, 3])["step"].tolist() == [6, 0, 3]
    batch = TensorDict({"state": torch.arange(18.0).repeat_interleave(4).reshape(18, 4),
                        "action": torch.zeros(18, 1), "reward": torch.arange(18.0) + 7,
                        "next_state": torch.zeros(18, 4), "terminated": torch.zeros(18),
                        "truncated": torch.zeros(18), "step": torch.arange(18) + 7},
                       batch_size=[18])
    buf.add_batch(batch)  # 25 added: the ring has wrapped
    assert buf.size == 10 and buf.pointer == 25 % 10
    slots = ring(25, 10)
    assert buf.sample_by_index(range(10))["step"].tolist() == slots
    assert buf.sample_by_index(torch.tensor([4, 5]))["step"].tolist() == slots[4:6]
    assert buf.sample_all()["step"].tolist() == slots
    picked = buf.sample_by_index_fields([1, 2], ["step", "reward"])
    assert set(picked.keys()) == {"step", "reward"} and picked["step"].tolist() == slots[1:3]
    with pytest.raises(IndexError):
        buf.sample_by_index([10])
    buf.close()


def test_epochs_cover_every_record_once_in_objectrls_order(where):
    buf = ReplayBuffer(CPU, CPU, 50, **where)
    for k in range(63):  # wrapped: 50 held
        buf.add(transition(k))
    assert buf.calculate_num_batches(16) == 4  # ceil(50 / 16)
    batches = list(buf.create_epoch_iterator(16, n_epochs=2))
    assert [len(b) for b in batches] == [16, 16, 16, 2] * 2
    steps = torch.cat([b["step"] for b in batches]).tolist()
    assert steps == ring(63, 50) * 2
    shuffled = list(buf.create_epoch_iterator(16, shuffle=True, seed=1))
    got = torch.cat([b["step"] for b in shuffled]).tolist()
    assert sorted(got) == sorted(ring(63, 50)) and got != ring(63, 50)
    n = buf.get_steps_and_iterator(n_epochs=3, max_iter=0, batch_size=20)
    assert n == 3 * 3
    seen = torch.cat([buf.get_next_batch(20)["step"] for _ in range(n)]).tolist()
    assert sorted(seen) == sorted(ring(63, 50) * 3)
    with pytest.raises(StopIteration):
        buf.get_next_batch(20)
    assert buf.get_steps_and_iterator(n_epochs=0, max_iter=5, batch_size=8) == 5
    assert buf.epoch_iterator is None and len(buf.get_next_batch(8)) == 8  # random batches
    buf.close()


def test_save_and_load_round_trip(where, tmp_path):
    buf = ReplayBuffer(CPU, CPU, 20, **where)
    for k in range(27):
        buf.add(transition(k))
    before = buf.sample_all()
    path = str(tmp_path / "memory")
    buf.save(path)
    metadata = torch.load(path + ".metadata")
    assert metadata == {"buffer_size": 20, "data_size": 20, "pointer": 7}  # objectrl's file
    buf.close()
    where2 = {**where, "name": where["name"] + "-b"} if where else {}
    other = ReplayBuffer(CPU, CPU, 5, **where2)
    other.load(path)
    assert other.buffer_size == 20 and other.pointer == 7 and other.size == 20
    after = other.sample_all()
    for key in before.keys():
        assert torch.equal(before[key], after[key]), key
    other.close()


def test_reset_drops_everything_and_takes_a_new_schema(where):
    buf = ReplayBuffer(CPU, CPU, 30, **where)
    for k in range(12):
        buf.add(transition(k))
    buf.reset()
    assert buf.size == 0 and buf.pointer == 0
    rollout = TensorDict({"state": torch.zeros(8, 4), "advantages": torch.arange(8.0),
                          "returns": torch.ones(8)}, batch_size=[8])  # PPO after reset
    buf.add_batch(rollout)
    assert buf.size == 8
    assert torch.equal(buf.sample_all()["advantages"], torch.arange(8.0))
    buf.reset(buffer_size=4)
    buf.add_batch(rollout)
    assert buf.size == 4 and buf.sample_all()["advantages"].tolist() == [4.0, 5.0, 6.0, 7.0]
    # Without a reset the schema stays, as objectrl's storage keeps it: extra keys are
    # dropped, and a key the record lacks keeps what its slot held.
    buf.add(transition(3))
    after = buf.sample_all()
    assert set(after.keys()) == {"state", "advantages", "returns", "index"}
    assert after["advantages"].tolist() == [4.0, 5.0, 6.0, 7.0]  # slot 0 kept record 4's
    assert after["state"][0].tolist() == [3.0] * 4 and after["index"].tolist() == [0, 1, 2, 3]
    buf.close()


def test_nested_keys_and_a_learner_attaching_by_name(shared_server):
    where = {"address": shared_server.address, "name": f"objectrl-{next(_names)}"}
    actor = ReplayBuffer(CPU, CPU, 100, **where)
    for k in range(10):
        actor.add(TensorDict({"obs": torch.full((2,), float(k)),
                              "next": {"obs": torch.full((2,), k + 1.0), "done": k == 9}}))
    learner = ReplayBuffer(CPU, CPU, 100, **where)  # attaches: no add needed
    assert learner.size == 10
    batch = learner.sample_all()
    assert batch["next", "obs"][:, 0].tolist() == [k + 1.0 for k in range(10)]
    assert batch["next", "done"].dtype == torch.bool
    assert set(learner.sample_by_index_fields([0], [("next", "obs")]).keys(True, True)) == {
        ("next", "obs")}
    learner.close()
    actor.close()


def test_bfloat16_strings_and_2d_batches_round_trip(where):
    buf = ReplayBuffer(CPU, CPU, 6, **where)
    x = torch.randn(5, 3, 2).to(torch.bfloat16)
    buf.add_batch(TensorDict({"x": x, "tag": "run-1"}, batch_size=[5, 3]))
    got = buf.sample_all()
    assert got.batch_size == torch.Size([5, 3]) and got["x"].dtype == torch.bfloat16
    assert torch.equal(got["x"], x) and got["tag"] == [["run-1"] * 3] * 5
    assert got["index"].tolist() == [[k] * 3 for k in range(5)]
    assert torch.equal(buf.sample_by_index([-1])["x"], x[-1:])
    with pytest.raises(millpond.InvalidArgumentError):  # objectrl's: with a string key
        buf.sample_batch(0)
    buf.reset()
    buf.add_batch(TensorDict({"x": x}, batch_size=[5, 3]))
    assert buf.sample_batch(0).batch_size == torch.Size([0, 3])
    buf.close()


def test_bad_input_is_refused():
    buf = ReplayBuffer(CPU, CPU, 10)
    with pytest.raises(millpond.NotEnoughDataError):
        buf.sample_batch(4)
    with pytest.raises(millpond.InvalidArgumentError):
        buf.add(TensorDict({"bad__key": torch.zeros(1)}))
    with pytest.raises(millpond.InvalidArgumentError):
        buf.add(TensorDict({"x": torch.zeros(1, dtype=torch.complex64)}))
    with pytest.raises(millpond.InvalidArgumentError):
        ReplayBuffer(CPU, CPU, 10, name="no-address")
