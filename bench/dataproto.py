"""DataProto on a 512 x 4096 batch: median times of its operations and of a pickle round trip, then the Ray fan-out
(put once, 4 actors each read it) against the same batch held as a plain TensorDict, measured in the same run.
Copies and pickles only (float32, int64 and object columns): no compute dtype.
Run: .venv/bin/python bench/dataproto.py [--repeats 9]"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import ray
import torch
from _machine import announce
from tensordict import TensorDict

from roll_backend.distributed.ray_env import init_local_ray
from roll_backend.keys import (
    ADVANTAGES,
    ATTENTION_MASK,
    INPUT_IDS,
    OLD_LOG_PROBS,
    POSITION_IDS,
    PROMPT_TEXT,
    REF_LOG_PROBS,
    UID,
)
from roll_backend.protocol import DataProto

ROWS, SEQ, RESP, SAMPLES_PER_PROMPT = 512, 4096, 2048, 8
READERS = 4


def make_batch() -> DataProto:
    gen = torch.Generator().manual_seed(0)
    return DataProto.from_dict(
        tensors={
            INPUT_IDS: torch.randint(0, 150_000, (ROWS, SEQ), generator=gen),
            ATTENTION_MASK: torch.ones(ROWS, SEQ, dtype=torch.int64),
            POSITION_IDS: torch.arange(SEQ).expand(ROWS, SEQ).contiguous(),
            OLD_LOG_PROBS: torch.randn(ROWS, RESP, generator=gen),
            REF_LOG_PROBS: torch.randn(ROWS, RESP, generator=gen),
            ADVANTAGES: torch.randn(ROWS, RESP, generator=gen),
        },
        non_tensors={
            UID: [f"prompt-{i // SAMPLES_PER_PROMPT}" for i in range(ROWS)],
            PROMPT_TEXT: [f"Question {i}: what is {i} + {i}? Think step by step. " * 4 for i in range(ROWS)],
        },
        meta_info={"temperature": 1.0},
    )


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pickle_out_of_band(batch: DataProto) -> DataProto:
    """What Ray does: protocol 5 with buffers passed beside the stream instead of copied into it."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(payload, buffers=buffers)


def time_operations(batch: DataProto, repeats: int) -> dict[str, float]:
    chunks = batch.chunk(8)
    left_keys, right_keys = [INPUT_IDS, ATTENTION_MASK, POSITION_IDS], [OLD_LOG_PROBS, REF_LOG_PROBS, ADVANTAGES]
    # A worker's answer that repeats a column the driver has: union checks the two are equal.
    answer = batch.select(batch_keys=right_keys, non_tensor_batch_keys=[])
    answer[INPUT_IDS] = batch[INPUT_IDS].clone()
    shuffled = batch[torch.randperm(ROWS, generator=torch.Generator().manual_seed(1))]
    groups = f"{ROWS // SAMPLES_PER_PROMPT} groups"
    return {
        "chunk(8)": median_seconds(lambda: batch.chunk(8), repeats),
        "concat(8 chunks)": median_seconds(lambda: DataProto.concat(chunks), repeats),
        "union(3 + 3 new columns)": median_seconds(
            lambda: batch.select(batch_keys=left_keys).union(
                batch.select(batch_keys=right_keys, non_tensor_batch_keys=[])
            ),
            repeats,
        ),
        "union(3 new + 1 shared column, equality-checked)": median_seconds(
            lambda: batch.select(batch_keys=left_keys).union(answer), repeats
        ),
        "repeat(4, interleave)": median_seconds(lambda: batch.repeat(4, interleave=True), repeats),
        f"group_by(uid), rows already grouped -> {groups}": median_seconds(lambda: batch.group_by(UID), repeats),
        f"group_by(uid), rows shuffled -> {groups}": median_seconds(lambda: shuffled.group_by(UID), repeats),
        "pickle round trip (in-band)": median_seconds(lambda: pickle.loads(pickle.dumps(batch, protocol=5)), repeats),
        "pickle round trip (protocol 5 out-of-band)": median_seconds(lambda: pickle_out_of_band(batch), repeats),
    }


@ray.remote(num_cpus=0)
class Reader:
    def touch(self, batch) -> float:
        """Read one column end to end, as a worker's first use of its input would."""
        return float(batch[INPUT_IDS].sum())


def put_and_read(obj, readers) -> tuple[float, float]:
    """(seconds to put once and have every reader read it, of which the reads alone)."""
    start = time.perf_counter()
    ref = ray.put(obj)
    put_done = time.perf_counter()
    ray.get([reader.touch.remote(ref) for reader in readers])
    end = time.perf_counter()
    return end - start, end - put_done


def time_fan_out(candidates: dict, readers, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (total, reads) per candidate; candidates take turns so load from other processes hits them alike."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in candidates}
    for round_ in range(repeats + 1):
        for name, obj in candidates.items():
            seconds = put_and_read(obj, readers)
            if round_ > 0:  # round 0 warms up
                times[name].append(seconds)
    return {
        name: (statistics.median(t for t, _ in values), statistics.median(r for _, r in values))
        for name, values in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    announce()

    batch = make_batch()
    print(batch.size_summary())
    for name, seconds in time_operations(batch, args.repeats).items():
        print(f"{name:52s} {seconds * 1e3:9.2f} ms")

    init_local_ray(num_cpus=READERS)
    readers = [Reader.remote() for _ in range(READERS)]
    ray.get([reader.touch.remote({INPUT_IDS: torch.zeros(1)}) for reader in readers])  # actors up and warm
    as_tensordict = TensorDict(dict(batch.batch.items()), batch_size=[ROWS])
    # The floor: the same tensors as bare numpy arrays, which Ray itself ships zero-copy.
    as_numpy = {key: value.numpy() for key, value in batch.batch.items()}
    candidates = {"DataProto": batch, "TensorDict": as_tensordict, "numpy dict": as_numpy}
    fan_out = time_fan_out(candidates, readers, args.repeats)
    (dataproto_s, dataproto_reads_s), (tensordict_s, tensordict_reads_s) = fan_out["DataProto"], fan_out["TensorDict"]
    for name, (total, reads) in fan_out.items():
        print(
            f"put once + {READERS} actors read, {name:10s} {total * 1e3:9.2f} ms (of which reads {reads * 1e3:8.2f} ms)"
        )
    ray.shutdown()
    print(f"reads alone speed-up vs TensorDict: {tensordict_reads_s / dataproto_reads_s:.1f}x")
    print(f"fan-out speed-up vs TensorDict: {tensordict_s / dataproto_s:.1f}x")


if __name__ == "__main__":
    main()
