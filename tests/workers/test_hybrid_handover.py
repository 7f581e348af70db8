"""The hybrid engine's device hand-over (workers/hybrid.py DeviceHandover) as a sequence of moves: which model state
goes to the host and back, when the engine sleeps and wakes, and that a weight sync stopped part-way never lets the
engine generate from mixed weights. Recording stand-ins for the strategies: on CPU vLLM cannot sleep, so the order of
calls a GPU would see is checked here; the pipeline runs the same class on real ranks (test_hybrid.py)."""

from __future__ import annotations

import pytest

from roll_backend.workers.hybrid import ALL_PARTS, DeviceHandover, WeightSyncInterrupted, WeightSyncUndone

PARAMS = frozenset({"params"})


class Recorder:
    def __init__(self, log: list, name: str, offloaded: frozenset[str] = ALL_PARTS, keeps_weights: bool = True):
        self.log, self.name, self.offloaded_parts, self.keeps_weights = log, name, offloaded, keeps_weights

    def move_model_state(self, parts, to_host):
        self.log.append((self.name, "host" if to_host else "device", tuple(sorted(parts))))
        return 10 * len(parts)

    def sleep(self):
        self.log.append((self.name, "sleep"))
        return self.keeps_weights

    def wake_up(self, tags=None):
        self.log.append((self.name, "wake", tags))


def handover(log, keeps_weights=True, failing_loads=0, reference_offloads=PARAMS, failure=OSError):
    loads = []

    def load(version, whole):
        loads.append(version)
        log.append(("trainer", "load", version, whole))
        if len(loads) <= failing_loads:
            raise failure("bucket 2 of 3 lost")
        return {"tensors": 3.0}

    models = {"actor_train": Recorder(log, "actor"), "reference": Recorder(log, "reference", reference_offloads)}
    return DeviceHandover(Recorder(log, "engine", keeps_weights=keeps_weights), models, "actor_train", load)


def test_a_step_moves_each_part_once_and_in_turn():
    log = []
    device = handover(log)
    device.for_engine()  # start: the models' offloaded state to the host, the engine keeps the device
    assert log == [("actor", "host", ("grads", "optimizer", "params")), ("reference", "host", ("params",))]
    log.clear()
    device.for_engine()  # already the engine's: nothing moves
    device.for_model("reference", PARAMS)
    device.for_model("actor_train", PARAMS)  # old log-probs: params only
    device.for_model("actor_train", ALL_PARTS)  # train: gradients and optimizer state too
    device.sync(7)
    assert log == [
        ("engine", "sleep"),
        ("reference", "device", ("params",)),
        ("reference", "host", ("params",)),
        ("actor", "device", ("params",)),
        ("actor", "device", ("grads", "optimizer")),
        ("actor", "host", ("grads", "optimizer")),  # the sync needs the parameters alone
        ("engine", "wake", ("weights",)),
        ("trainer", "load", 7, False),  # the engine's weights are what it served: what changed loads
        ("engine", "wake", ("kv_cache",)),
        ("actor", "host", ("params",)),
    ]
    assert device.moved_bytes == 10 * (3 + 1) + 10 * (1 + 1 + 1 + 2 + 2 + 1)


def test_a_model_without_offload_stays_on_the_device():
    log = []
    device = handover(log, reference_offloads=frozenset())
    device.for_engine()
    device.for_model("reference", PARAMS)
    assert ("reference", "host", ("params",)) not in log and ("reference", "device", ("params",)) not in log


def test_after_a_level_two_sleep_the_engine_is_refilled_before_it_generates():
    log = []
    device = handover(log, keeps_weights=False)
    device.for_engine()
    device.for_model("actor_train", PARAMS)
    log.clear()
    device.for_engine()  # no sync came (e.g. nothing to train on): the discarded weights come from the trainer
    assert [entry for entry in log if entry[0] in ("engine", "trainer")] == [
        ("engine", "wake", ("weights",)),
        ("trainer", "load", None, True),  # every tensor
        ("engine", "wake", ("kv_cache",)),
    ]


def test_a_sync_stopped_part_way_is_an_error_and_the_engine_never_generates_from_mixed_weights():
    log = []
    device = handover(log, failing_loads=1)
    device.for_engine()
    device.for_model("actor_train", ALL_PARTS)
    with pytest.raises(WeightSyncInterrupted, match="stopped part-way .*OSError: bucket 2 of 3 lost.*mixed"):
        device.sync(3)
    assert not device.engine_weights_valid
    log.clear()
    device.for_engine()  # the next generation first loads the trainer's weights whole
    assert ("trainer", "load", None, True) in log
    assert log.index(("trainer", "load", None, True)) < log.index(("engine", "wake", ("kv_cache",)))
    assert device.engine_weights_valid


def test_a_sync_the_engine_undid_leaves_it_generating_from_its_version():
    """With the engine's host copy (engine_copy) a load that fails part-way is reloaded from the copy: the error
    passes through, and the next generation needs no refill."""
    log = []
    device = handover(log, failing_loads=1, failure=WeightSyncUndone)
    device.for_engine()
    device.for_model("actor_train", ALL_PARTS)
    with pytest.raises(WeightSyncUndone, match="bucket 2 of 3 lost"):
        device.sync(3)
    assert device.engine_weights_valid
    log.clear()
    device.for_engine()
    assert not [entry for entry in log if entry[0] == "trainer"]


class Facet:
    """A facet's stand-in for the rank pool's question: released in turn, poolable unless its start failed."""

    def __init__(self, log: list, role: str, poolable: bool = True):
        self.log, self.role, self.poolable = log, role, poolable

    def release_role(self):
        self.log.append(self.role)
        return True


@pytest.mark.parametrize("failed", [None, "actor_infer", "reference"])
def test_a_hybrid_rank_goes_back_to_the_pool_only_when_every_facet_started(failed, monkeypatch):
    from roll_backend.workers import strategy_host
    from roll_backend.workers.hybrid import HybridWorker

    log = []
    facets = {role: Facet(log, role) for role in ("actor_train", "reference", "actor_infer")}
    if failed is not None:  # a facet's start that raised marks it (start_strategy), as a half-started engine's does

        class FailingStrategy:
            def initialize(self):
                raise RuntimeError("no room for the KV cache")

        monkeypatch.setattr(strategy_host, "create_strategy", lambda *args, **kwargs: FailingStrategy())
        facet = facets[failed]
        facet.layout = facet.device = None
        with pytest.raises(RuntimeError, match="KV cache"):
            strategy_host.start_strategy(facet, "vllm", None)
        assert facet.poolable is False
    rank = HybridWorker.__new__(HybridWorker)  # (no rank process: the release's decision only)
    rank.facets, rank.handover = facets, object()
    assert rank.release_role() is (failed is None)
    assert log[0] == "actor_infer" and sorted(log) == sorted(facets)  # every facet torn down, the engine first
    assert rank.handover is None
