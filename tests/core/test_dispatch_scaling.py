"""Per-op overhead does not grow with the world size: no O(P) work on the hot path.

The same ops (``add``, ``tanh``, a 3-op chain, ``F.linear`` and ``x @ w`` with a
plain promoted weight) on one rank of simulated meshes of 4 and 4096 ranks
(torch's fake process group; nothing moves), uneven shards. The benchmark
(``benchmarks/dispatch_overhead.py``) reports the 1.2x target; this test fails
beyond 2x, a margin for a loaded machine. A fake process group needs a
process without a default group: this one (the test process) or, if it has
one, a fresh one.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from benchmarks.dispatch_overhead import scaling

ROOT = Path(__file__).resolve().parents[2]
SIZES = (64, 32, 60, 5)  # rows, cols, calls per batch, batches


def _best_of(measure, tries: int = 3) -> dict:
    """Best time per op and world over up to ``tries`` measurements, stopping once every ratio is within 2x.

    On this 2-core machine a burst of load from another process has doubled one
    figure of one measurement (CI: conv2d 484 us at P=4096 vs 231 us at P=4, where
    quiet runs give 1.00-1.03). A cost that grows with P is in every
    measurement, so the best of a few still shows it.
    """
    best: dict = {}
    for _ in range(tries):
        best = {key: min(value, best.get(key, value)) for key, value in measure().items()}
        if all(ratio <= 2.0 for ratio, _, _ in _ratios(best).values()):
            break
    return best


def _times() -> dict:
    return _best_of(_times_once)


def _times_once() -> dict:
    if not dist.is_initialized():
        return scaling(*SIZES)
    args = [sys.executable, "-m", "benchmarks.dispatch_overhead", "--json", *map(str, SIZES)]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_per_op_time_at_p4096_within_2x_of_p4():
    times = _times()
    ops = {key.rsplit("@", 1)[0] for key in times}
    assert {"add", "tanh", "chain(3 ops)", "F.linear(x, w)", "x @ w"} <= ops
    for op, (ratio, small, large) in _ratios(times).items():
        assert ratio <= 2.0, f"{op}: {large * 1e6:.1f} us at P=4096 vs {small * 1e6:.1f} us at P=4"


# --------------------------------------------------------------------------- #
# Window ops (conv, pooling, interpolation) and group norm
# --------------------------------------------------------------------------- #
WINDOW_WORLDS = (4, 4096)


def _window_ops():
    import torch.nn.functional as F

    return {
        "conv2d": lambda x, w: F.conv2d(x, w, padding=1),
        "conv2d(stride 2)": lambda x, w: F.conv2d(x, w, padding=1, stride=2),
        "max_pool2d": lambda x, w: F.max_pool2d(x, 2),
        "interpolate(bilinear)": lambda x, w: F.interpolate(x, scale_factor=2, mode="bilinear"),
        "group_norm": lambda x, w: F.group_norm(x, 4),
    }


def _window_times(stub_collective: bool, calls: int = 20, repeats: int = 3) -> dict:
    """Thread seconds per forward call on rank 0 of simulated meshes (meta locals, uneven rows along H).

    With ``stub_collective`` torch's ``all_to_all_single`` is replaced by a
    stand-in that only makes the output: what remains is the library's own
    work (layout, plan lookups, halo arithmetic, local kernels on meta). The
    halo exchange itself no longer calls it (neighbour exchange: on meta
    tensors only the result's shape), so both variants should agree.
    """
    import time

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.placement_types import Shard

    from physicsnemo_dp import ShardTensor, _torch_compat
    from physicsnemo_dp.spec import ShardTensorSpec

    original = _torch_compat.all_to_all_single

    def stand_in(t, output_split_sizes, input_split_sizes, mesh, mesh_dim):
        return t.new_empty((sum(output_split_sizes), *t.shape[1:]))

    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)
    if stub_collective:
        _torch_compat.all_to_all_single = stand_in
    try:  # the worlds in turn, four times: a burst of load on the machine hits both alike
        for world in WINDOW_WORLDS * 4:
            with _torch_compat.fake_process_group(world, 0):
                mesh = init_device_mesh("cpu", (world,))
                rows = [9] + [8] * (world - 2) + [7]
                spec = ShardTensorSpec.from_sizes(mesh, [Shard(2)], (2, 8, sum(rows), 16), torch.float32, (None, None, rows, None))
                x = ShardTensor.from_spec(torch.empty(spec.local_shape, device="meta"), spec)
                w = torch.empty(8, 8, 3, 3, device="meta")
                for name, fn in _window_ops().items():
                    fn(x, w)  # plans are built (and cached) on the first call
                    best = float("inf")
                    for _ in range(repeats):
                        start = time.thread_time()
                        for _ in range(calls):
                            fn(x, w)
                        best = min(best, (time.thread_time() - start) / calls)
                    out[f"{name}@{world}"] = min(out.get(f"{name}@{world}", best), best)
    finally:
        _torch_compat.all_to_all_single = original
        torch.set_num_threads(threads)
    return out


def _window_times_once(stub_collective: bool) -> dict:
    if not dist.is_initialized():
        return _window_times(stub_collective)
    code = (
        "import json, tests.core.test_dispatch_scaling as t; "
        f"print(json.dumps(t._window_times({stub_collective})))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def _window_times_anywhere(stub_collective: bool) -> dict:
    return _best_of(lambda: _window_times_once(stub_collective))


def _ratios(times: dict) -> dict:
    small, large = WINDOW_WORLDS
    ops = sorted({key.rsplit("@", 1)[0] for key in times})
    return {op: (times[f"{op}@{large}"] / times[f"{op}@{small}"], times[f"{op}@{small}"], times[f"{op}@{large}"]) for op in ops}


def test_window_op_planning_at_p4096_within_2x_of_p4():
    """The library's own per-call work for window ops and group norm does not grow with P.

    Plans are cached per layout, a sharded dim's group sizes are its spec's
    table (no walk over the mesh), so a repeated call does no O(P) work.
    torch's all-to-all is stubbed here, so only the library's work is timed; the
    next test times torch's collectives too.
    """
    for op, (ratio, small, large) in _ratios(_window_times_anywhere(True)).items():
        assert ratio <= 2.0, f"{op}: {large * 1e6:.1f} us at P=4096 vs {small * 1e6:.1f} us at P=4"


def test_window_op_with_collective_at_p4096_within_2x_of_p4():
    """The same with torch's collectives as they are: a halo exchange talks to its neighbours only.

    An ``all_to_all_single`` over the whole mesh dim cost ~5 ms a call at
    P=4096 in torch's checks of its P-long split lists (10-23x the P=4 time);
    the neighbour exchange's work is in the number of peers.
    """
    for op, (ratio, small, large) in _ratios(_window_times_anywhere(False)).items():
        if op == "group_norm":  # no halo exchange
            continue
        assert ratio <= 2.0, f"{op}: {large * 1e6:.1f} us at P=4096 vs {small * 1e6:.1f} us at P=4"
