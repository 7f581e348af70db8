"""roll_backend/protocol/weight_delta.py: per tensor the cheaper of nothing, the changed elements or the whole tensor;
rebuilt bit for bit; refused when relative to another version or damaged."""

from __future__ import annotations

import pytest
import torch

from roll_backend.protocol.weight_delta import (
    HeldWeights,
    SentWeights,
    WeightDeltaBucket,
    WeightDeltaError,
    apply,
    changed_tensors,
    checksum,
    encode,
    tensor_bits,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(tensor_bits(a), tensor_bits(b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 0.9, 1.0])
def test_each_tensor_travels_as_the_cheaper_of_nothing_its_changes_or_whole(dtype, fraction):
    gen = torch.Generator().manual_seed(int(fraction * 100) + len(str(dtype)))
    shape = (37, 53)  # odd sizes: no alignment to lean on
    old = (torch.randn(shape, generator=gen) * 100).to(dtype)
    new = old.clone()
    changed = torch.rand(shape, generator=gen) < fraction
    new[changed] = (torch.randn(int(changed.sum()), generator=gen) * 100).to(dtype) + 1
    delta = encode("w", new, old)
    count = int((tensor_bits(new) != tensor_bits(old)).sum())
    if count == 0:
        assert delta is None
        return
    index_bytes, element = 4, new.element_size()
    if count * (index_bytes + element) < new.numel() * element:
        assert delta.full is None and len(delta.indices) == count and delta.nbytes == count * (index_bytes + element)
    else:
        assert delta.full is not None and delta.nbytes == new.numel() * element
    assert same_bits(apply(delta, old), new)


def test_changes_are_found_bit_by_bit():
    """-0.0 vs 0.0 and NaN payloads compare equal as numbers; the engine must still get the trainer's bits."""
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    new = old.clone()
    new[0] = -0.0
    new[2] = torch.tensor(0x7FC00001, dtype=torch.int32).view(torch.float32)  # another NaN
    delta = encode("w", new, old)
    assert delta is not None and same_bits(apply(delta, old), new)
    assert encode("w", old.clone(), old) is None  # the same NaN bits: unchanged


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_in_process_sync_loads_exactly_the_tensors_whose_bits_changed(dtype):
    """The hybrid engine's sync (changed_tensors): against the engine's held copy, a tensor goes whole when any bit
    differs (one element, -0.0 for 0.0, another shape) and not at all otherwise; the copies are the host's own (an
    update of the trainer's tensor in place afterwards changes nothing held); with no copy every tensor goes."""
    gen = torch.Generator().manual_seed(len(str(dtype)))
    served = {f"w{i}": (torch.randn(5, 7, generator=gen) * 100).to(dtype) for i in range(5)}
    held = HeldWeights()
    held.commit(dict(served), 1)
    trainer = {name: tensor.clone() for name, tensor in served.items()}
    trainer["w1"].view(-1)[-1] += 1  # the last element only
    trainer["w2"] = torch.zeros(5, 7, dtype=dtype)
    served["w2"] = torch.zeros(5, 7, dtype=dtype)
    if dtype.is_floating_point:
        served["w2"][4, 6] = -0.0  # the engine serves -0.0 where the trainer has 0.0: a changed bit
    else:
        served["w2"][4, 6] = 1
    held.commit({"w2": served["w2"]}, 1)
    trainer["w3"] = trainer["w3"].reshape(7, 5)  # the same elements, another shape
    bucket = changed_tensors(list(trainer.items()), held, version=2)
    assert [delta.name for delta in bucket.deltas] == ["w1", "w2", "w3"]
    assert bucket.unchanged == 2 and bucket.full_bytes == sum(t.numel() * t.element_size() for t in trainer.values())
    assert all(same_bits(delta.full, trainer[delta.name]) for delta in bucket.deltas)
    trainer["w1"].add_(1)  # the trainer's next step, in place: the engine's copy keeps what was compared
    assert not same_bits(bucket.deltas[0].full, trainer["w1"])
    assert len(changed_tensors(list(trainer.items()), None, version=2).deltas) == 5  # no copy: every tensor


def test_a_damaged_delta_or_a_wrong_base_is_refused():
    old = torch.randn(64, 64)
    new = old.clone()
    new[3, :5] += 1
    delta = encode("w", new, old)
    other = old.clone()
    other[0, 0] += 1  # the engine holds something else
    with pytest.raises(WeightDeltaError, match="checksum"):
        apply(delta, other)
    with pytest.raises(WeightDeltaError, match="holds nothing"):
        apply(delta, None)
    swapped = new.clone().reshape(-1)
    swapped[[0, 1]] = swapped[[1, 0]]  # a swap keeps the plain sum
    assert checksum(swapped) != checksum(new.reshape(-1))


def test_sent_and_held_copies_stay_in_step_and_a_stopped_sync_makes_the_next_whole():
    gen = torch.Generator().manual_seed(0)
    weights = {f"model.layers.{i}.{p}": torch.randn(16, 16, generator=gen) for i in range(3) for p in "abc"}
    sent, held = SentWeights(), HeldWeights()

    def sync(version, engine_version):
        base = sent.begin(engine_version)
        buckets = [
            sent.encode(list(weights.items())[:4], base, version),
            sent.encode(list(weights.items())[4:], base, version),
        ]
        sent.sent(version)
        return buckets

    staged, counts = held.stage(sync(1, None))
    held.commit(staged, 1)
    assert counts["bytes"] == counts["full_bytes"] and counts["unchanged"] == 0
    weights["model.layers.1.b"] = weights["model.layers.1.b"] + 1
    weights["model.layers.2.c"][0, 0] = 5.0
    buckets = sync(2, held.version)
    staged, counts = held.stage(buckets)
    assert sorted(staged) == ["model.layers.1.b", "model.layers.2.c"] and counts["unchanged"] == 7
    # The engine loads fused layers whole: the changed tensors come with their layer's others.
    whole = held.with_whole_groups(staged, lambda name: name.rsplit(".", 1)[0])
    assert [name for name, _ in whole] == [f"model.layers.{i}.{p}" for i in (1, 2) for p in "abc"]
    held.commit(staged, 2)
    assert all(same_bits(held.tensors[n], w) for n, w in weights.items())
    # A delta relative to version 1 reaches an engine at 2: refused, nothing staged.
    with pytest.raises(WeightDeltaError, match="relative to version 1"):
        held.stage([WeightDeltaBucket(1, 3)])
    # A sync stopped part-way (one bucket encoded) leaves the trainer's copy of no version: the next is whole.
    base = sent.begin(2)
    sent.encode(list(weights.items())[:4], base, 3)
    assert sent.begin(2) is None


def test_a_committed_sync_is_undone_bit_for_bit_once():
    """The probe of a committed sync failed: `revert` gives back the tensors it changed (sparse ones through their
    old values at the changed positions, whole ones whole), the version before, and only once; a first fill of an
    empty copy has nothing to go back to."""
    gen = torch.Generator().manual_seed(1)
    first = {f"model.layers.{i}.w": torch.randn(32, 32, generator=gen) for i in range(3)}
    sent, held = SentWeights(), HeldWeights()
    held.commit(*_staged(held, sent, first, version=1, engine_version=None))
    with pytest.raises(WeightDeltaError, match="no weight sync to undo"):
        held.revert()
    second = dict(first)
    second["model.layers.0.w"] = first["model.layers.0.w"] + 1  # whole
    second["model.layers.2.w"] = first["model.layers.2.w"].clone()
    second["model.layers.2.w"][3, 4] = -0.0  # two elements: sparse
    second["model.layers.2.w"][7, 1] = 2.5
    staged, _ = held.stage([sent.encode(list(second.items()), sent.begin(1), 2)])
    sent.sent(2)
    assert staged["model.layers.0.w"] is not None and sorted(staged) == ["model.layers.0.w", "model.layers.2.w"]
    held.commit(staged, 2)
    assert held.version == 2 and all(same_bits(held.tensors[n], t) for n, t in second.items())
    restored = held.revert()
    assert sorted(restored) == ["model.layers.0.w", "model.layers.2.w"] and held.version == 1
    assert all(same_bits(held.tensors[n], t) for n, t in first.items())
    with pytest.raises(WeightDeltaError, match="no weight sync to undo"):
        held.revert()


def _staged(held: HeldWeights, sent: SentWeights, weights: dict, version: int, engine_version: int | None):
    staged, _ = held.stage([sent.encode(list(weights.items()), sent.begin(engine_version), version)])
    sent.sent(version)
    return staged, version


@pytest.mark.gpu(1)
def test_on_a_gpu_the_comparison_runs_on_the_device_and_the_host_copy_takes_the_delta():
    """The trainer's tensors on a GPU: the host copy goes up, only the delta comes down; the engine's rebuild and the
    trainer's host copy both equal the new weights bit for bit."""
    gen = torch.Generator().manual_seed(1)
    weights = {f"w{i}": torch.randn(257, 129, generator=gen).to(torch.bfloat16) for i in range(3)}
    sent, held = SentWeights(), HeldWeights()
    staged, _ = held.stage([sent.encode([(n, w.cuda()) for n, w in weights.items()], sent.begin(None), 1)])
    sent.sent(1)
    held.commit(staged, 1)
    weights["w0"][0, :7] += 1  # sparse
    weights["w1"] += 1  # whole
    bucket = sent.encode([(n, w.cuda()) for n, w in weights.items()], sent.begin(1), 2)
    assert [d.full is None for d in bucket.deltas] == [True, False] and bucket.unchanged == 1
    assert all(t.device.type == "cpu" for d in bucket.deltas for t in (d.full, d.indices, d.values) if t is not None)
    staged, _ = held.stage([bucket])
    held.commit(staged, 2)
    for name, weight in weights.items():
        assert same_bits(held.tensors[name], weight) and same_bits(sent.tensors[name], weight), name


def test_the_checksum_of_a_view_at_any_offset_is_its_copy_s():
    """A tensor the trainer yields may be a view into another (one half of a fused weight): its bytes need not start
    on an 8-byte boundary."""
    base = torch.randn(1001, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for offset in range(1, 5):
        assert checksum(base[offset:]) == checksum(base[offset:].clone())
