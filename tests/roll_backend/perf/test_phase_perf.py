"""The start-up GEMM probe behind MFU (pipelines/services/phase_perf.py): CPU roles whose ranks would measure the
same (dtype, shapes, ranks at once, CPU share) are probed once; GPU roles each measure their own."""

from __future__ import annotations

import dataclasses

import pytest

from roll_backend.config.loader import load_config
from roll_backend.distributed.worker import Worker
from roll_backend.models.tiny import TinyModelSpec, build_tiny_model
from roll_backend.pipelines.services.phase_perf import PhasePerf


class ProbedGroup:
    """A role's group that answers the probe with one number per rank and counts the probes."""

    def __init__(self, world_size: int, tflops: float, probes: list):
        self.world_size, self.tflops, self.probes = world_size, tflops, probes

    def call(self, method, *args):
        assert method is Worker.measure_gemm_tflops
        self.probes.append(self)
        return [self.tflops] * self.world_size


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), TinyModelSpec(hidden_size=128, intermediate_size=256))


@pytest.mark.parametrize("gpus", [0, 1])
def test_cpu_roles_alike_share_one_probe_and_gpu_roles_each_measure(model, tmp_path, gpus):
    config = load_config("configs/grpo_tiny_cpu.yaml", [f"model_path={model}", f"output_dir={tmp_path}"])
    names = ("actor_train", "actor_infer", "reference")
    config = dataclasses.replace(
        config, **{name: dataclasses.replace(getattr(config, name), num_gpus_per_rank=gpus) for name in names}
    )
    probes: list = []
    fields = ["actor_train", "actor_infer", "reference", "critic", "reward_model"]
    groups = dataclasses.make_dataclass("Groups", fields)(
        ProbedGroup(2, 0.5, probes), ProbedGroup(1, 0.25, probes), ProbedGroup(1, 0.125, probes), None, None
    )
    perf = PhasePerf(config, groups)
    # the two-rank trainer measures; the one-rank reference measures as the one-rank rollout did (CPU) or itself (GPU)
    expected = {"actor_train": 1.0, "actor_infer": 0.25, "reference": 0.25 if gpus == 0 else 0.125}
    assert {name: perf.peak_tflops[name] for name in names} == expected
    assert len(probes) == (2 if gpus == 0 else 3)
