"""The one split rule matches torch.chunk, including empty trailing shards."""

import pytest
import torch

from physicsnemo_dp.split import chunk_offset, chunk_sizes, offsets_from_sizes


@pytest.mark.parametrize("total", range(0, 41))
@pytest.mark.parametrize("parts", range(1, 9))
def test_matches_torch_chunk(total, parts):
    pieces = [c.numel() for c in torch.arange(total).chunk(parts)] if total else []
    expected = pieces + [0] * (parts - len(pieces))
    assert list(chunk_sizes(total, parts)) == expected


@pytest.mark.parametrize(
    "total,parts,expected",
    [(6, 4, (2, 2, 2, 0)), (9, 4, (3, 3, 3, 0)), (2, 3, (1, 1, 0)), (1, 4, (1, 0, 0, 0)), (0, 2, (0, 0)), (10, 4, (3, 3, 3, 1))],
)
def test_named_cases(total, parts, expected):
    assert chunk_sizes(total, parts) == expected
    assert sum(expected) == total


def test_offsets():
    assert offsets_from_sizes((2, 2, 2, 0)) == (0, 2, 4, 6)
    assert chunk_offset(9, 4, 2) == (6, 3)
    assert chunk_offset(9, 4, 3) == (9, 0)


@pytest.mark.parametrize("total,parts", [(-1, 2), (3, 0)])
def test_rejects_bad_arguments(total, parts):
    with pytest.raises(ValueError):
        chunk_sizes(total, parts)
