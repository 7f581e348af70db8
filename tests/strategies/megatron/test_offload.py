"""The hybrid engine's model-state offload (strategies/megatron/offload.py) on real Megatron ranks: the parameters,
DDP's gradient buffer and the optimizer's state leave the device and come back bit for bit, at layouts whose state is
laid out differently (TP shards, vpp chunks, and the distributed optimizer's param buffer sharded over DP); the next
optimizer step equals a step without the round trip. On a CPU rank the "device" is host memory too, so the moves copy
within it: the same code a GPU runs, with the storages really emptied and refilled."""

from __future__ import annotations

import pytest
import torch
from megatron_batches import make_rl_batch_tensors
from reconfigurable_workers import ReconfigurableActor

from roll_backend import keys
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.protocol import DataProto
from roll_backend.strategies.megatron.config import MegatronTrainConfig, OptimizerSettings
from roll_backend.workers.actor import ActorConfig, ActorLossConfig, ActorWorker

PARTS = ("params", "grads", "optimizer")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), spec))


@pytest.fixture(scope="module")
def batch() -> DataProto:
    tensors = make_rl_batch_tensors(vocab_size=320, num_rows=6, seed=4)
    gen = torch.Generator().manual_seed(5)
    tensors[keys.ADVANTAGES] = torch.randn(tensors[keys.RESPONSES].shape, generator=gen)
    return DataProto.from_dict(tensors=tensors)


def _config(model_dir: str, distributed_optimizer: bool) -> ActorConfig:
    optimizer = OptimizerSettings(lr=1e-2, use_distributed_optimizer=distributed_optimizer)
    strategy = MegatronTrainConfig(model_path=model_dir, micro_batch_size=2, optimizer=optimizer)
    return ActorConfig(strategy=strategy, loss=ActorLossConfig(clip_low=0.2))


@pytest.mark.parametrize(
    "layout_name, distributed_optimizer", [("tp2", False), ("pp2vpp2", False), ("ep2", True)], ids=str
)
def test_model_state_round_trip_is_exact_and_the_next_step_unchanged(
    layout_actors, model_dir, batch, layout_name, distributed_optimizer
):
    group = layout_actors[layout_name]
    config = _config(model_dir, distributed_optimizer)

    def two_steps(round_trip: tuple[str, ...]) -> tuple[dict, list[dict]]:
        group.call(ReconfigurableActor.init_model_with, config)
        group.call(ActorWorker.train_step, batch)  # (the optimizer has moments from here on)
        trips = group.call(ReconfigurableActor.offload_round_trip, list(round_trip)) if round_trip else []
        metrics = group.call(ActorWorker.train_step, batch)[0]
        metrics.pop("broadcast_seconds")  # (a time)
        return metrics, trips

    expected, _ = two_steps(())
    got, trips = two_steps(PARTS)
    assert got == expected  # bit for bit: loss, grad norm, every metric of the step after the round trip
    for trip in trips:
        assert trip["identical"]
        assert all(trip["before"][part] > 0 for part in PARTS), trip  # each part has state to move
        assert trip["away"] == {part: 0 for part in PARTS}
        assert trip["after"] == trip["before"]
        assert trip["out"] == trip["back"] == sum(trip["before"].values())
