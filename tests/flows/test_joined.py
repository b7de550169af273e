"""The protocol by which several training processes share a run's work (`tasks.joined`),
with the collective replaced by a recorded exchange: what process 0 sends is what the others
act on, in order, and the run's end releases them."""

from __future__ import annotations

import numpy as np
import pytest

from selfsup_model.pretraining import devices
from tasks import baseline, finetune, joined, pretrain


@pytest.fixture
def two_processes(monkeypatch):
    monkeypatch.setattr(joined, "process_count", lambda: 2)


def test_followers_do_what_process_0_invites_them_to_then_stop(two_processes, monkeypatch):
    sent: list[int] = []
    monkeypatch.setattr(joined, "broadcast_int", lambda value: sent.append(value) or value)
    joined.invite("pretrain")
    joined.invite("baseline")
    joined.release()
    assert sent == [1, 3, 0]

    codes = iter([2, 3, 0])  # process 0 ran finetune and baseline; pretraining was up to date
    monkeypatch.setattr(joined, "broadcast_int", lambda value: next(codes))
    done: list[str] = []
    for module in (pretrain, finetune, baseline):
        monkeypatch.setattr(module, "follow", lambda ctx, name=module.__name__: done.append(name))
    assert joined.serve(ctx=None) == ["finetune", "baseline"]
    assert done == ["tasks.finetune", "tasks.baseline"]


def test_one_process_sends_nothing(monkeypatch):
    monkeypatch.setattr(joined, "broadcast_int", lambda value: pytest.fail("a collective"))
    joined.invite("finetune")
    joined.release()


@pytest.mark.parametrize("count", [2, 4])
@pytest.mark.parametrize("axis", [0, 1])
def test_the_processes_shares_side_by_side_are_the_batch(monkeypatch, count, axis):
    batch = np.arange(8 * 12).reshape(8, 12)
    monkeypatch.setattr(devices, "process_count", lambda: count)
    shares = []
    for index in range(count):
        monkeypatch.setattr(devices, "process_index", lambda index=index: index)
        shares.append(devices.local_share(batch, axis=axis))
    assert all(s.shape[axis] == batch.shape[axis] // count for s in shares)
    np.testing.assert_array_equal(np.concatenate(shares, axis=axis), batch)


def test_a_batch_that_does_not_divide_over_the_processes_is_refused(monkeypatch):
    from selfsup_model.errors import UserError

    monkeypatch.setattr(devices, "process_count", lambda: 3)
    monkeypatch.setattr(devices, "process_index", lambda: 0)
    with pytest.raises(UserError, match="does not divide over 3 training processes"):
        devices.local_share(np.zeros((2, 8)), axis=1)
