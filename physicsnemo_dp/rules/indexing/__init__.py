"""Indexing on sharded tensors: reads, writes and data-dependent selections.

Index tensors hold *global* coordinates. A plain index tensor is promoted to
Replicate (free); Replicate and sharded ShardTensor indices are accepted too.

What a read (``x[idx]``, ``index_select``, ``gather``, ``embedding``) costs,
per mesh dim, by the layouts of the data ``x`` and of the index:

=======================  ===============================  ===========================================
``x`` on the mesh dim    index Replicate (or plain)       index sharded
=======================  ===============================  ===========================================
Replicate                nothing; output Replicate        nothing; output sharded like the index.
                                                          ``x``'s gradient is a pending sum (one
                                                          all-reduce when a promoted weight takes it)
Shard(indexed dim)       nothing; output Partial("sum"):  all-gather of the index (integers), then
                         each rank reads the entries it   as on the left
                         owns into a zero-filled output
                         of the full output size
Shard(other dim)         nothing; output sharded like     all-gather of the index (``gather``: a
                         ``x`` (same shard sizes)         rebalance to ``x``'s shards)
Partial                  nothing; output Partial          all-gather of the index
=======================  ===============================  ===========================================

``x[idx]``, ``index_select(x, 0, idx)``, ``F.embedding(idx, x)``,
``gather(x, 0, idx)`` and ``take_along_dim(x, idx, 0)`` with a sharded index and ``x`` row-sharded over one mesh dim do not reach the table's
"index sharded / Shard(indexed dim)" cell: the graph family fetches the rows by
request (:mod:`physicsnemo_dp.graph._requests`), output laid out like the index.

A Partial output is reduced by whoever needs its value (one all-reduce or
reduce-scatter of the output). No read moves data in its backward: each rank
scatters the output gradient into the entries it owns.

Other families:

* ``x[mask]``, ``masked_select``, ``nonzero``: one all-gather of one int per
  rank (the counts, which become the shard sizes of the selected dim) when a
  masked dim is sharded; a shard on a non-leading masked dim first moves to
  the leading one (all-to-all), a replicated ``x`` is sliced to a sharded
  mask's boxes. Nothing moves when no masked dim is sharded.
* ``x[idx] = v`` (``index_put_``), ``index_add``, ``scatter``, ``scatter_add``,
  ``scatter_reduce`` (those the graph family does not serve by request along
  dim 0, :mod:`physicsnemo_dp.graph._scatter`): sharded index tensors are all-gathered (integers);
  values/sources move only if not already laid out like the part of ``x``
  they land in; a pending ``x`` is reduced first. ``x[mask] = v`` with a full
  ``v`` gathers the mask (bools) and ``v``; a broadcast ``v`` moves nothing.

Out-of-range indices raise ``IndexError`` like torch; where the index is
sharded the check is local, so only the ranks holding a bad index raise.
Under ``torch.compile`` the same check is an op of the graph (the indices are
not known while tracing) and raises ``RuntimeError`` with the valid range.

Not supported (``NotImplementedError`` naming the way out): several boolean
masks in one index, or a mask mixed with integer index tensors (convert the
mask with ``mask.nonzero(as_tuple=True)``); the deprecated ``scatter(...,
reduce=)`` overloads (use ``scatter_reduce``); no rule exists for
``masked_scatter``, ``index_copy``, ``index_fill``, ``put_``, ``take`` and
``embedding_renorm_`` (``max_norm=``): the dispatcher's error says to gather first.
"""

from __future__ import annotations

from . import functions, masks, read, write

RULES: dict = {**read.RULES, **masks.RULES, **write.RULES}
FUNCTIONS: dict = dict(functions.FUNCTIONS)
