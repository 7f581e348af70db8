"""roll_backend/protocol/shared.py: pickling as Ray does, zero-copy and read-only, and making columns writable."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from dataproto_batches import PROPERTY, assert_same, make_batch, oob_round_trip
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from roll_backend.keys import ATTENTION_MASK, INPUT_IDS, META_METRICS, OLD_LOG_PROBS
from roll_backend.protocol import (
    DataProto,
    SharedReadOnlyTensor,
    SharedTensorWriteError,
)


def test_out_of_band_pickle_is_zero_copy_and_read_only():
    data = make_batch(4)
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    assert len(payload) < 2000 and len(buffers) == 5  # 4 tensors + the float64 column travel out of band
    shared = [memoryview(bytes(b.raw())) for b in buffers]
    received = pickle.loads(payload, buffers=shared)
    buffer_start = np.frombuffer(shared[0], dtype=np.uint8).ctypes.data
    assert received[INPUT_IDS].data_ptr() == buffer_start  # the tensor views the buffer, no copy
    assert sorted(received.shared_keys()) == sorted([INPUT_IDS, ATTENTION_MASK, OLD_LOG_PROBS, "ref_bf16", "weights"])
    assert isinstance(received["ref_bf16"], SharedReadOnlyTensor) and received["ref_bf16"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "write",
    [
        lambda t: t.add_(1),
        lambda t: t.__setitem__(0, 1),
        lambda t: t[1:3].zero_(),
        lambda t: t.view(-1).fill_(0),
        lambda t: t.T.mul_(2),
        lambda t: torch.add(t, 1, out=t),
        lambda t: torch.nn.functional.relu(t, inplace=True),
        lambda t: t.unbind()[0].copy_(torch.zeros(3)),
    ],
)
def test_every_in_place_write_to_a_shared_tensor_raises(write):
    received = oob_round_trip(make_batch(4))
    with pytest.raises(SharedTensorWriteError, match="make_writable"):
        write(received[OLD_LOG_PROBS])
    with pytest.raises(ValueError, match="read-only"):
        received[OLD_LOG_PROBS].numpy()[0, 0] = 1.0


def test_shared_tensors_read_and_train_like_plain_ones():
    received = oob_round_trip(make_batch(4))
    logp = received[OLD_LOG_PROBS]
    assert (
        type(logp * 2) is torch.Tensor and type(logp.clone()) is torch.Tensor and type(logp[1:]) is SharedReadOnlyTensor
    )
    embedding = torch.nn.Embedding(1000, 4)
    (embedding(received[INPUT_IDS]).sum() + (logp * embedding.weight[0, 0]).sum()).backward()
    assert embedding.weight.grad is not None
    joined = DataProto.concat(received.chunk(2))
    assert joined.shared_keys() == [] and type(joined[INPUT_IDS]) is torch.Tensor  # concat copies every column


def test_make_writable_copies_only_the_requested_columns():
    received = oob_round_trip(make_batch(4))
    received.make_writable([INPUT_IDS, "weights"])
    received[INPUT_IDS].add_(1)
    received["weights"][0] = 5.0
    assert sorted(received.shared_keys()) == sorted([ATTENTION_MASK, OLD_LOG_PROBS, "ref_bf16"])
    assert copy.deepcopy(received).shared_keys() == [] and received.select(deepcopy=True).shared_keys() == []


def test_in_band_pickle_gives_private_writable_tensors():
    received = pickle.loads(pickle.dumps(make_batch(3)))
    assert received.shared_keys() == [] and type(received[INPUT_IDS]) is torch.Tensor


@PROPERTY
@given(rows=st.integers(0, 20), seed=st.integers(0, 2**16), out_of_band=st.booleans())
def test_pickle_round_trip_is_exact_for_every_dtype(rows, seed, out_of_band):
    data = make_batch(rows, seed=seed, meta_info={"temperature": 0.5, META_METRICS: {"x": [1.0]}})
    received = oob_round_trip(data) if out_of_band else pickle.loads(pickle.dumps(data))
    assert_same(received, data)
    assert isinstance(received.batch, TensorDict)
