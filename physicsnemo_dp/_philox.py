"""Counter-based random numbers in torch integer ops: Philox4x32-10 and the box of a shard.

Why a counter-based generator: torch's CPU generator (Mersenne Twister) is a
*sequential* stream, so a rank cannot compute "the values another rank would
have drawn" without drawing them, and seeding every rank alike makes every rank
draw the same block. Philox (Salmon, Moraes, Dror, Shaw: "Parallel random
numbers: as easy as 1, 2, 3", SC 2011) maps a 128-bit counter and a 64-bit key
to 128 random bits with no state. Here the counter is derived from the *global*
flat index of an element, so a rank evaluates exactly its own box (O(local)
work and memory, no communication) and every decomposition of a tensor gives
the same values, bit for bit on one device type.

The recipe (this is the documented guarantee; changing it changes every draw):

* **Key**: four 32-bit words ``(k0, k1, s0, s1)`` drawn per operation from
  torch's generator (:func:`draw_key`); ``(k0, k1)`` is Philox's key.
* **Counter**: an element of global flat index ``i`` (row-major over the
  global shape) with ``k`` elements per block lies in block ``b = i // k`` at
  lane ``i % k``; the block's counter is ``(b mod 2**32, b // 2**32, s0, s1)``.
  ``k`` is 4 when a value needs one 32-bit word and 2 when it needs two.
* **Words -> values** (``w``: a 32-bit word, ``w_a, w_b`` two of them):

  ======================  ====  ==========================================================
  kind / dtype            k     value of one lane
  ======================  ====  ==========================================================
  uniform float32          4     ``(w >> 8) * 2**-24``
  uniform float16          4     ``(w >> 21) * 2**-11`` (exact in half: never rounds to 1)
  uniform bfloat16         4     ``(w >> 24) * 2**-8``
  uniform float64          2     ``((w_a << 21) | (w_b >> 11)) * 2**-53``
  normal (not float64)     4     Box-Muller in float32 on word pairs (w0, w1), (w2, w3):
                                 ``r = sqrt(-2 log((w_a + 1) 2**-32))``,
                                 ``t = 2 pi (w_b >> 8) 2**-24``; lanes ``r cos t, r sin t``
  normal float64           2     Box-Muller on ``u1 = 1 - U53(w0, w1)``, ``t = 2 pi U53(w2, w3)``
  word32                   4     ``w`` (int64 in ``[0, 2**32)``)
  word64                   2     ``(w_a << 32) | w_b`` as int64 (two's complement)
  ======================  ====  ==========================================================

  Distributions built on these (in :mod:`physicsnemo_dp.rules.random`) only
  apply elementwise formulas to them, so they inherit the invariance.

uint32 arithmetic runs in int64: products of two 32-bit words are formed
modulo 2**64 (torch's integer multiplication wraps on CPU and CUDA) and their
high and low words are masked out; the known-answer vectors of the Random123
reference implementation are checked by ``tests/random/test_philox.py``, so a
platform where this failed would fail there, not silently.
"""

from __future__ import annotations

import math

import torch

from ._torch_compat import traced

__all__ = ["philox4x32", "draw_key", "lanes", "sample_box", "sample_full"]

_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments (golden ratio, sqrt(3) - 1)
ROUNDS = 10


def philox4x32(c0, c1, c2, c3, key: torch.Tensor, rounds: int = ROUNDS):
    """Philox4x32-``rounds`` of counters ``(c0, c1, c2, c3)`` under ``key`` (int64 ``[2]``).

    Counter words are int64 tensors with values in ``[0, 2**32)``; ``c2`` and
    ``c3`` may also be ints or 0-d tensors (broadcast). Returns the four output
    words as int64 tensors. Vectorised over the counters' shape;
    every op is an elementwise torch op, so it runs on any device and never
    synchronises with the host.

    One round is ``(c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))``.
    The products are formed in place modulo 2**64; the low words are left
    unmasked (their upper half holds the high word) because they only enter
    the next round through an XOR whose result is masked anyway, and the
    shifted high words carry the product's sign the same way. So a round is
    ten in-place ops and one scratch buffer, with no allocation: the draw is
    bound by memory traffic.
    """
    if _host_key(key):  # Python ints: no tensor indexing per round (the cost of small draws)
        a, b = key.tolist()
        k0 = [(a + r * _W0) & _MASK for r in range(rounds)]
        k1 = [(b + r * _W1) & _MASK for r in range(rounds)]
    else:  # stay on the device: no host synchronisation
        steps = torch.arange(rounds, dtype=torch.int64, device=key.device)
        k0 = ((key[0] + steps * _W0) & _MASK).unbind()
        k1 = ((key[1] + steps * _W1) & _MASK).unbind()
    c0 = c0.clone()  # the rounds work in place on copies of the caller's counters
    c1 = c1.clone()
    scratch = torch.empty_like(c0)
    if isinstance(c2, int) and isinstance(c3, int) and c2 == 0 and c3 == 0:
        # first round of a (b0, b1, 0, 0) counter: M1 * 0 = 0, so c0' = c1 ^ k0, c1' = 0
        c0.mul_(_M0)
        c3 = c0  # lo(M0 c0), unmasked
        c2 = torch.bitwise_right_shift(c0, 32).bitwise_xor_(k1[0]).bitwise_and_(_MASK)
        c0 = c1.bitwise_xor_(k0[0])
        c1 = torch.zeros_like(c0)
        first = 1
    else:  # ints or tensors that broadcast (e.g. a 0-d word of the key)
        c2 = torch.empty_like(c0).copy_(torch.as_tensor(c2, dtype=torch.int64, device=c0.device))
        c3 = torch.empty_like(c0).copy_(torch.as_tensor(c3, dtype=torch.int64, device=c0.device))
        first = 0
    for r in range(first, rounds):
        c0.mul_(_M0)  # M0 * c0 mod 2**64: lo word below, hi word above
        c2.mul_(_M1)
        torch.bitwise_right_shift(c2, 32, out=scratch)
        c1.bitwise_xor_(scratch).bitwise_xor_(k0[r]).bitwise_and_(_MASK)  # new c0
        torch.bitwise_right_shift(c0, 32, out=scratch)
        c3.bitwise_xor_(scratch).bitwise_xor_(k1[r]).bitwise_and_(_MASK)  # new c2
        c0, c1, c2, c3 = c1, c2, c3, c0  # new c1 = lo(M1 c2), new c3 = lo(M0 c0), both unmasked
    return c0, c1.bitwise_and_(_MASK), c2, c3.bitwise_and_(_MASK)


def _host_key(key: torch.Tensor) -> bool:
    """Whether the key's words can be read as Python ints: on the CPU and not under torch.compile's tracing."""
    return key.device.type == "cpu" and not traced(key)


def draw_key(device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh 128-bit key (int64 ``[4]`` on ``device``) taken from torch's generator.

    Words 0 and 1 are Philox's key, words 2 and 3 the upper half of every
    counter, so two operations collide only if all 128 bits agree (a 64-bit
    key alone would collide with probability ~1e-3 after 2e8 draws, which a
    long training run with dropout in many layers reaches).

    One ``torch.randint`` of four 32-bit words per random operation, from
    ``generator`` or the default generator of ``device``: it advances that
    generator by the same amount on every rank whatever the tensor's size or
    decomposition, so ranks seeded alike stay alike (a plain-tensor draw
    afterwards, e.g. weight init, agrees across ranks), and everything that
    saves or restores torch's generator state (``torch.manual_seed``,
    ``fork_rng``, checkpoints, activation-checkpoint recomputation) governs
    these draws too. The key stays on the device: no host synchronisation.
    """
    device = torch.device(device)
    source = generator.device if generator is not None else device
    key = torch.randint(0, 2**32, (4,), dtype=torch.int64, device=source, generator=generator)
    return key.to(device)


# --------------------------------------------------------------------------- #
# Words -> values, one block (4 words) at a time
# --------------------------------------------------------------------------- #
def lanes(kind: str, dtype: torch.dtype) -> int:
    """Values per Philox block: 2 when a value needs 64 random bits, else 4."""
    if kind == "word64" or (kind in ("uniform", "normal") and dtype == torch.float64):
        return 2
    if kind in ("uniform", "normal", "word32"):
        return 4
    raise ValueError(f"unknown kind of random values {kind!r}")


_UNIFORM_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def _u53(wa, wb):
    return ((wa << 21) | (wb >> 11)).to(torch.float64).mul_(2.0**-53)


def _uniform(words, dtype):
    if dtype == torch.float64:
        return torch.stack([_u53(words[0], words[1]), _u53(words[2], words[3])], -1)
    bits = _UNIFORM_BITS.get(dtype)
    if bits is None:
        raise TypeError(f"uniform random values need a floating dtype (float16/bfloat16/float32/float64), got {dtype}")
    return torch.stack([(w >> (32 - bits)).to(dtype).mul_(2.0**-bits) for w in words], -1)


def _box_muller(u1, theta):
    r = u1.log_().mul_(-2.0).sqrt_()
    return torch.stack([r * torch.cos(theta), r * torch.sin(theta)], -1)


def _normal(words, dtype):
    if dtype == torch.float64:
        return _box_muller(1.0 - _u53(words[0], words[1]), _u53(words[2], words[3]).mul_(2 * math.pi))
    if not dtype.is_floating_point:
        raise TypeError(f"normal random values need a floating dtype, got {dtype}")
    u1 = torch.stack([words[0], words[2]], -1).add_(1).to(torch.float32).mul_(2.0**-32)
    theta = (torch.stack([words[1], words[3]], -1) >> 8).to(torch.float32).mul_(2 * math.pi * 2.0**-24)
    z = _box_muller(u1, theta)  # [..., pair, (cos, sin)] = lanes 0, 1, 2, 3
    return z.flatten(-2).to(dtype)


def _values(kind, words, dtype):
    if kind == "uniform":
        return _uniform(words, dtype)
    if kind == "normal":
        return _normal(words, dtype)
    if kind == "word32":
        return torch.stack(list(words), -1)
    return torch.stack([(words[0] << 32) | words[1], (words[2] << 32) | words[3]], -1)  # word64


#: Blocks evaluated at a time: the ~five int64 buffers of a chunk stay in cache
#: (measured on CPU: ~1.5x faster than one pass over 2**18 blocks; smaller chunks
#: pay Python overhead per op).
_CHUNK = 32768


def _blocks(kind, key, blocks, dtype):
    """Values ``[*blocks.shape, lanes]`` of the Philox blocks ``blocks`` (int64 block indices)."""
    flat = blocks.reshape(-1)
    c2, c3 = key.tolist()[2:] if _host_key(key) else key[2:].unbind()
    parts = [_values(kind, philox4x32(b & _MASK, b >> 32, c2, c3, key[:2]), dtype) for b in flat.split(_CHUNK)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(*blocks.shape, -1)


# --------------------------------------------------------------------------- #
# A box of the global tensor
# --------------------------------------------------------------------------- #
def _row_starts(global_shape, offsets, local_shape, device):
    """The box as runs of consecutive global flat indices.

    Trailing dims the box covers fully merge with the innermost partial dim
    into one run of length ``n``; the dims before it enumerate the runs.
    Returns ``(starts, n, strides_before)``: the run starts (int64 ``[rows]``)
    and the global strides of the enumerating dims whose local extent is > 1.
    """
    ndim = len(global_shape)
    d = ndim - 1
    while d >= 0 and local_shape[d] == global_shape[d] and offsets[d] == 0:
        d -= 1
    if d < 0:
        return torch.zeros(1, dtype=torch.int64, device=device), math.prod(global_shape), ()
    inner = math.prod(global_shape[d + 1:])
    starts = torch.full((), offsets[d] * inner, dtype=torch.int64, device=device)
    strides = []
    for j in range(d):
        stride = math.prod(global_shape[j + 1:])
        idx = torch.arange(offsets[j], offsets[j] + local_shape[j], dtype=torch.int64, device=device) * stride
        starts = starts.unsqueeze(-1) + idx
        if local_shape[j] > 1:
            strides.append(stride)
    return starts.reshape(-1), local_shape[d] * inner, tuple(strides)


def sample_box(kind, key, global_shape, offsets, local_shape, dtype, device) -> torch.Tensor:
    """The values of ``kind`` at the box ``offsets``/``local_shape`` of a tensor of ``global_shape``.

    Depends only on ``(key, global flat index)`` of each element, so any
    decomposition of the global tensor into boxes reproduces the single-box
    result exactly. Work and memory: O(box) plus at most one partial block
    per run; no communication.
    """
    global_shape, offsets, local_shape = tuple(global_shape), tuple(offsets), tuple(local_shape)
    out_dtype = torch.int64 if kind in ("word32", "word64") else dtype
    if math.prod(local_shape) == 0:
        return torch.empty(local_shape, dtype=out_dtype, device=device)
    k = lanes(kind, dtype)
    starts, n, strides = _row_starts(global_shape, offsets, local_shape, device)
    aligned = all(s % k == 0 for s in strides)
    first_block = starts // k
    lane = starts - first_block * k
    nb = (n + 2 * k - 2) // k  # enough blocks for any lane offset in [0, k)
    blocks = first_block.unsqueeze(-1) + torch.arange(nb, dtype=torch.int64, device=device)
    values = _blocks(kind, key, blocks, dtype).flatten(-2)  # [rows, nb * k]
    if aligned:  # every run starts at the same lane: a view
        offset0 = int(global_offset_of(global_shape, offsets)) % k
        local = values.narrow(-1, offset0, n)
    else:
        index = lane.unsqueeze(-1) + torch.arange(n, dtype=torch.int64, device=device)
        local = values.gather(-1, index)
    return local.reshape(local_shape)


def global_offset_of(global_shape, offsets) -> int:
    """Global flat index of the box's first element (row-major)."""
    flat = 0
    for n, o in zip(global_shape, offsets):
        flat = flat * n + o
    return flat


def sample_full(kind, key, shape, dtype, device) -> torch.Tensor:
    """The whole tensor: the single-process reference of :func:`sample_box`."""
    shape = tuple(shape)
    return sample_box(kind, key, shape, (0,) * len(shape), shape, dtype, device)
