"""The pipe's buffer pool: a buffer returns only when the last array or tensor viewing it is gone."""

import gc

import numpy as np
import pytest
import torch

from datapipes._buffers import BufferPool, layout_arrays


@pytest.mark.parametrize("shared", [False, True])
def test_a_buffer_returns_when_the_last_view_of_any_array_dies(shared):
    pool = BufferPool(shared=shared, max_idle=4)
    try:
        specs, nbytes = layout_arrays({"a": ((3, 4), np.float32), "b": ((5,), np.float64), "empty": ((0, 2), np.int32)})
        buf = pool.acquire(nbytes)
        arrays = pool.hand_out(buf, specs)
        arrays["a"][:] = 1.0
        arrays["b"][:] = 2.0
        kept = torch.from_numpy(arrays["b"])[1:3]  # a view of a tensor of one array: all the user keeps
        del arrays
        gc.collect()
        other = pool.acquire(nbytes)
        assert other is not buf  # still viewed: a new buffer, never this one
        pool.release(other)
        assert kept.tolist() == [2.0, 2.0]
        del kept
        gc.collect()
        again = pool.acquire(nbytes)
        assert again is buf  # the last view is gone: reused (the most recently released first)
        pool.release(again)
    finally:
        pool.close()
