"""The background readers prepare each read on their own thread: results, and errors, come back in order."""

import numpy as np
import pytest

from datapipes._buffers import BufferPool, layout_arrays, view_arrays
from datapipes.prefetch import ReadTask, make_reader


class _Filled:
    """A source whose every box is filled with its sample index."""

    def read(self, index, name, box, out):
        out[...] = index
        return out.nbytes

    def check_files(self, samples):
        pass


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_an_error_preparing_a_read_is_raised_by_its_own_result_in_order(kind):
    """Reads 0, 2 and 3 fail before they reach the reader (the first with nothing else pending, the others
    behind a read in flight); each error comes from its own result(), the other reads are unaffected."""
    pool = BufferPool(shared=kind == "process", max_idle=8)
    specs, nbytes = layout_arrays({"u": ((1, 4), np.float32)})
    reader = make_reader(kind, _Filled(), (), False)
    memories = {}

    def prepare(i):
        def call():
            if i in (0, 2, 3):
                raise ValueError(f"cannot prepare read {i}")
            buf = pool.acquire(nbytes)
            memories[i] = buf
            return ReadTask(i, buf.name, specs, (i,), ({"u": (slice(0, 4),)},)), buf.memory, lambda: f"built {i}"

        return call

    try:
        for i in range(6):
            reader.submit(prepare(i))
        for i in range(6):
            if i in (0, 2, 3):
                with pytest.raises(ValueError, match=f"cannot prepare read {i}"):
                    reader.result()
            else:
                nbytes_read, seconds, built = reader.result()
                assert (nbytes_read, built) == (16, f"built {i}") and seconds >= 0
                assert view_arrays(memories[i].memory, specs)["u"].tolist() == [[float(i)] * 4]
    finally:
        reader.close()
        pool.close()
