"""roll_backend/protocol/tensordict_format.py through DataProto: to_tensordict / from_tensordict, checked against
the values of verl's own protocol tests (tests/test_protocol_on_cpu.py) and as an exact round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dataproto_batches import PROPERTY, assert_same, make_batch, oob_round_trip
from hypothesis import given
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from roll_backend.keys import INPUT_IDS, UID
from roll_backend.protocol import DataProto
from roll_backend.protocol.tensordict_format import LAYOUT_KEY


def verl_tensordict(tensors: dict, lists: dict, meta_info: dict) -> TensorDict:
    """A TensorDict built as verl's `tensordict_utils.get_tensordict` builds one: batch size [B], each list a
    NonTensorStack of NonTensorData rows, each meta entry a NonTensorData."""
    rows = len(next(iter({**tensors, **lists}.values())))
    stacks = {key: NonTensorStack.from_list([NonTensorData(v) for v in values]) for key, values in lists.items()}
    entries = {**tensors, **stacks}
    result = TensorDict(entries, batch_size=[rows])
    for key, value in meta_info.items():
        result[key] = NonTensorData(value)
    return result


def test_to_tensordict_holds_columns_and_meta_as_verl():
    obs = torch.tensor([1, 2, 3, 4, 5, 6])
    labels = ["a", "b", "c", "d", "e", "f"]
    data = DataProto.from_dict(tensors={"obs": obs}, non_tensors={"labels": labels}, meta_info={"name": "abdce"})
    output = data.to_tensordict()
    assert torch.equal(output["obs"], obs) and output["labels"] == labels and output["name"] == "abdce"
    assert output.batch_size == torch.Size([6]) and set(output.keys()) == {"obs", "labels", "name"}  # no layout key
    assert isinstance(output.get("labels"), NonTensorStack) and isinstance(output.get("name"), NonTensorData)
    assert output["obs"].data_ptr() == data["obs"].data_ptr()  # shared, not copied


def test_from_tensordict_reads_a_tensordict_verl_built():
    tensor_dict = verl_tensordict(
        {"obs": torch.tensor([1, 2, 3, 4, 5, 6])}, {"labels": ["a", "b", "c", "d", "e", "f"]}, {"name": "abdce"}
    )
    passed_meta = {"name": "old", "step": 3}
    data = DataProto.from_tensordict(tensor_dict, meta_info=passed_meta)
    assert data["labels"].tolist() == ["a", "b", "c", "d", "e", "f"] and data["labels"].dtype == object
    assert data["obs"].tolist() == [1, 2, 3, 4, 5, 6] and len(data) == 6
    assert data.meta_info == {"name": "abdce", "step": 3}  # NonTensorData wins over the argument, as in verl
    assert passed_meta == {"name": "old", "step": 3}  # ... but the argument is not written to (verl writes it)


def test_nested_rows_survive_both_ways_as_in_verls_agent_loop_test():
    prompts, responses = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[7, 8], [9, 10]])
    non_tensors = {
        "data_source": ["lighteval/MATH", "lighteval/MATH"],
        "uid": ["uuid-1", "uuid-2"],
        "num_turns": np.array([2, 4], dtype=np.int32),
        "acc": np.array([1.0, 0.0]),
        "turn_scores": [[], [0.5, 0.8]],
        "reward_extra_info": [{"acc": 1.0}, {"acc": 0.0}],
        "raw_prompt": [[{"content": "Compute 4 @ 2", "role": "user"}], [{"content": "Compute 8 @ 7", "role": "user"}]],
        "tool_rewards": [[0.0], []],
    }
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses}, non_tensors=non_tensors, meta_info={"global_steps": 42}
    )
    output = data.to_tensordict()
    assert torch.equal(output["prompts"], prompts) and torch.equal(output["responses"], responses)
    assert list(output["turn_scores"][0]) == [] and list(output["turn_scores"][1]) == [0.5, 0.8]
    assert dict(output["reward_extra_info"][0]) == {"acc": 1.0}
    assert dict(output["raw_prompt"][0][0]) == {"content": "Compute 4 @ 2", "role": "user"}
    assert list(output["tool_rewards"][0]) == [0.0] and list(output["tool_rewards"][1]) == []
    back = DataProto.from_tensordict(output)
    assert len(back) == 2 and back.meta_info == {"global_steps": 42} and torch.equal(back["prompts"], prompts)
    for key, rows in non_tensors.items():
        assert back[key].tolist() == list(rows), key
    assert back["num_turns"].dtype == np.int32 and back["acc"].dtype == np.float64  # verl would give object
    assert back["turn_scores"].shape == (2,) and back["turn_scores"][1] == [0.5, 0.8]


@PROPERTY
@given(rows=st.integers(0, 12), seed=st.integers(0, 2**16), shared=st.booleans())
def test_round_trip_is_exact_for_every_dtype(rows, seed, shared):
    data = make_batch(rows, seed=seed, meta_info={"temperature": 0.7, "metrics": {"loss": [1.0, 2.0]}})
    data["grid"] = np.arange(rows * 6, dtype=np.int16).reshape(rows, 2, 3)  # a numeric column of 3 dims
    data["code"] = np.array([f"c{i}" for i in range(rows)])  # fixed-width strings
    data = oob_round_trip(data) if shared else data
    assert_same(DataProto.from_tensordict(data.to_tensordict()), data)


def test_sliced_and_concatenated_tensordicts_come_back_as_those_rows():
    data = make_batch(5)
    data["grid"] = np.arange(10, dtype=np.float32).reshape(5, 2)
    output = data.to_tensordict()
    assert_same(DataProto.from_tensordict(output[1:4]), data[1:4])
    assert_same(DataProto.from_tensordict(torch.cat([output, output[:2]])), DataProto.concat([data, data[:2]]))


def test_batchless_and_dimless_tensordicts():
    batchless = DataProto.from_dict(non_tensors={UID: ["x", "y"]}, meta_info={"k": 1})
    back = DataProto.from_tensordict(batchless.to_tensordict())
    assert back.batch is None and back[UID].tolist() == ["x", "y"] and back.meta_info == {"k": 1}
    no_batch_dim = TensorDict({INPUT_IDS: torch.zeros(3, 4)}, batch_size=[])
    assert len(DataProto.from_tensordict(no_batch_dim)) == 3  # rows from dim 0, as verl
    empty = DataProto.from_tensordict(DataProto.from_dict(tensors={"x": torch.zeros(4, 2)}).select([]).to_tensordict())
    assert empty.batch is not None and len(empty) == 4 and list(empty.batch.keys()) == []


def test_layout_key_appears_only_for_columns_numpy_cannot_rebuild_from_rows():
    objects_only = DataProto.from_dict(tensors={"x": torch.arange(2)}, non_tensors={"t": [[1, 2], [3]]})
    assert LAYOUT_KEY not in objects_only.to_tensordict().keys()
    numeric = DataProto.from_dict(tensors={"x": torch.arange(2)}, non_tensors={"w": np.array([0.5, 1.5])})
    output = numeric.to_tensordict()
    assert output[LAYOUT_KEY] == {"w": ("<f8", [])}
    assert DataProto.from_tensordict(output)["w"].dtype == np.float64


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: DataProto.from_dict(tensors={"x": torch.arange(2)}, meta_info={"x": 1}).to_tensordict(),
            r"meta_info key\(s\) \['x'\] are also column names",
        ),
        (lambda: DataProto.from_tensordict({"x": torch.arange(2)}), "needs a TensorDict, got dict"),
        (
            lambda: DataProto.from_tensordict(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3])),
            r"batch size \[2, 3\]; DataProto has exactly one batch dim",
        ),
        (
            lambda: DataProto.from_tensordict(TensorDict({"x": torch.zeros(2)}, batch_size=[2]), num_batch_dims=2),
            "num_batch_dims=2",
        ),
        (
            lambda: DataProto.from_tensordict(TensorDict({"a": {"b": torch.zeros(2)}}, batch_size=[2])),
            r"entry 'a' is a TensorDict.*flatten_keys",
        ),
    ],
)
def test_tensordicts_a_dataproto_cannot_hold_are_refused_with_the_fix(make, message):
    with pytest.raises(ValueError, match=message):
        make()
