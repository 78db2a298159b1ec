"""Philox4x32-10 in torch ops: known-answer vectors, the bit recipe, and boxes equal to slices of the whole."""

import math

import pytest
import torch

from physicsnemo_dp import _philox

# Random123's known-answer vectors for philox4x32_10: (counter, key) -> output
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_known_answer_vectors(counter, key, expected):
    words = [torch.tensor([c], dtype=torch.int64) for c in counter]
    out = _philox.philox4x32(*words, torch.tensor(key, dtype=torch.int64))
    assert tuple(int(o) for o in out) == expected


def test_the_key_fills_the_upper_counter_words():
    """Words 2 and 3 of the op's key are the upper half of every counter (128 bits of key per op)."""
    key = torch.tensor([0xA4093822, 0x299F31D0, 0x13198A2E, 0x03707344], dtype=torch.int64)
    blocks = torch.tensor([0, 1, 2**32 + 5], dtype=torch.int64)
    expected = _philox.philox4x32(blocks & 0xFFFFFFFF, blocks >> 32, torch.full((3,), 0x13198A2E),
                                  torch.full((3,), 0x03707344), key[:2])
    got = _philox.sample_box("word32", key, (4 * (2**32 + 6),), (0,), (8,), torch.int64, "cpu")
    assert got.tolist() == torch.stack(expected, -1)[:2].flatten().tolist()
    far = _philox.sample_box("word32", key, (4 * (2**32 + 6),), (4 * (2**32 + 5),), (4,), torch.int64, "cpu")
    assert far.tolist() == [int(w[2]) for w in expected]


def test_bit_recipe_of_block_zero():
    """The documented words -> values recipe, computed by hand from the first known-answer vector."""
    w = KAT[0][2]
    key = torch.zeros(4, dtype=torch.int64)  # (k0, k1, s0, s1) = 0: counter (b, 0, 0, 0)
    u32 = _philox.sample_full("uniform", key, (4,), torch.float32, "cpu")
    assert u32.tolist() == [(x >> 8) * 2.0**-24 for x in w]
    u64 = _philox.sample_full("uniform", key, (2,), torch.float64, "cpu")
    assert u64.tolist() == [((w[0] << 21) | (w[1] >> 11)) * 2.0**-53, ((w[2] << 21) | (w[3] >> 11)) * 2.0**-53]
    z = _philox.sample_full("normal", key, (2,), torch.float64, "cpu")
    r = math.sqrt(-2 * math.log(1 - u64[0].item()))
    t = 2 * math.pi * u64[1].item()
    assert torch.allclose(z, torch.tensor([r * math.cos(t), r * math.sin(t)], dtype=torch.float64), rtol=1e-15, atol=0)
    bits = _philox.sample_full("word64", key, (2,), torch.int64, "cpu")
    as_signed = [((w[0] << 32) | w[1]) - (1 << 64) * (w[0] >> 31), ((w[2] << 32) | w[3]) - (1 << 64) * (w[2] >> 31)]
    assert bits.tolist() == as_signed


KINDS = [("uniform", torch.float32), ("uniform", torch.float64), ("uniform", torch.float16), ("uniform", torch.bfloat16),
         ("normal", torch.float32), ("normal", torch.float64), ("word32", torch.int64), ("word64", torch.int64)]


@pytest.mark.parametrize("kind,dtype", KINDS)
def test_every_box_is_the_slice_of_the_whole(kind, dtype):
    key = torch.tensor([12345, 678, 2**32 - 1, 99], dtype=torch.int64)
    for shape in ((13,), (5, 7), (3, 4, 5), (2, 1, 3, 6)):  # odd extents: runs start at every lane
        whole = _philox.sample_full(kind, key, shape, dtype, "cpu")
        g = torch.Generator().manual_seed(len(shape))
        for _ in range(12):
            lo = [int(torch.randint(0, n, (), generator=g)) for n in shape]
            hi = [int(torch.randint(a, n + 1, (), generator=g)) for a, n in zip(lo, shape)]
            box = _philox.sample_box(kind, key, shape, lo, [b - a for a, b in zip(lo, hi)], dtype, "cpu")
            assert torch.equal(box, whole[tuple(slice(a, b) for a, b in zip(lo, hi))]), (shape, lo, hi)


def test_values_depend_on_the_flat_index_only_even_past_2_to_32():
    """A 2-D box equals the matching 1-D segments: counters use the global flat index (64-bit)."""
    key = torch.tensor([7, 9, 11, 13], dtype=torch.int64)
    shape = (2**21, 2**13)  # 2**34 elements: block counters above 2**32
    offsets, local = (2**21 - 3, 100), (3, 37)
    box = _philox.sample_box("normal", key, shape, offsets, local, torch.float32, "cpu")
    for r in range(3):
        start = (offsets[0] + r) * shape[1] + offsets[1]
        seg = _philox.sample_box("normal", key, (2**34,), (start,), (37,), torch.float32, "cpu")
        assert torch.equal(box[r], seg)


def test_empty_and_zero_dim_boxes():
    key = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    assert _philox.sample_box("normal", key, (4, 0), (0, 0), (4, 0), torch.float32, "cpu").shape == (4, 0)
    scalar = _philox.sample_full("uniform", key, (), torch.float32, "cpu")
    assert scalar.shape == () and torch.equal(scalar, _philox.sample_full("uniform", key, (1,), torch.float32, "cpu")[0])


def test_key_draw_advances_the_generator_by_a_fixed_amount():
    for n in (1, 3):
        g = torch.Generator().manual_seed(0)
        for _ in range(n):
            _philox.draw_key("cpu", g)
        h = torch.Generator().manual_seed(0)
        for _ in range(n):
            torch.randint(0, 2**32, (4,), dtype=torch.int64, generator=h)
        assert torch.equal(g.get_state(), h.get_state())
    keys = {tuple(_philox.draw_key("cpu", g).tolist()) for _ in range(50)}
    assert len(keys) == 50
    assert all(0 <= k < 2**32 for pair in keys for k in pair)
