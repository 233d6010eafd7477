"""fastdist.ops: the collectives, one block per primitive, with its shape, forward and backward
rules.

Read the op modules (``reductions``, ``gathers``, ``permutes``, ``uneven``, ``ragged``,
``halo``: ``halo_swap`` trades both edges of a dim in one exchange; ``packed`` composes
``all_to_all``) like a table (as JAX's ``lax/parallel.py``). Each block has

* ``_<op>_shape``: the per-rank output shape (the fake rule);
* ``_<op>_stacked``: the forward over all ranks at once, on ``[world, *s]``
  (the simulated implementation, reached through the generic vmap rule);
* ``_<op>_dist``: the forward on one real rank, with torch's functional
  collectives on the rank's group ``comm`` (a ``fastdist.core.comm.AxisComm``);
* ``_<op>_bwd``: the per-rank gradient rule, written with other primitives;
* the public function: argument checks with errors that name the op, the axis
  and the fix, then ``<op>_p.bind``.

``spec.to_groups`` views ``[world, *s]`` as ``[G, n, *s]`` (G groups of n members,
member index in axis order), so a per-rank tensor dim ``d`` is dim ``d + 2`` there.
The rules on the hot path of models (psum, all_gather, psum_scatter, ppermute) use
``spec.axis_view`` instead: the mesh layout ``[*before, n, *after, *s]``, a view with no
permute copy when the group's axes are consecutive mesh axes (``to_groups`` otherwise).

Gradient conventions (the pairs that decide whether gradients are right):

==================  ===============================  ==================================
op                  forward                          backward (per rank)
==================  ===============================  ==================================
``psum``            sum over the group               identity
``pvary``           identity                         ``psum``
``pmean``           mean over the group              ``g / n``
``pmax``/``pmin``   max/min over the group           ``g`` to the lowest rank attaining it
``all_gather``      concatenate (or stack)           ``psum_scatter``
``all_gather_inv.`` concatenate, replicated result   local slice (``local_chunk``)
``local_chunk``     own chunk of a replicated value  ``all_gather_invariant``
``psum_scatter``    sum, keep own chunk              ``all_gather``
``all_to_all``      split ``a``, concatenate ``comm``   ``all_to_all`` with ``a``, ``comm`` swapped
``ppermute``        send along (src, dst) pairs      ``ppermute`` along the inverse pairs
``halo_exchange``   pad with neighbours' edge rows   halo gradients added to the senders' edges
``broadcast``       copy of ``src``'s value          ``g`` on ``src``, zero elsewhere
==================  ===============================  ==================================

``psum``'s identity backward assumes what its output is: the same on every rank
of the group, so each rank's loss uses it the same way and its cotangent is the
same everywhere. Where a replicated value enters rank-specific computation (a
replicated input to a column-parallel matmul), call ``pvary`` first: forward
nothing, backward the all-reduce that sums the ranks' partial gradients. This
is Megatron's ``copy_to_tensor_model_parallel_region`` / ``reduce_from_...``
pair, and JAX's typed ``pvary`` / ``psum``.

"""

from fastdist.ops.gathers import (
    all_gather,
    all_gather_invariant,
    all_to_all,
    all_to_all_4d,
    local_chunk,
    psum_scatter,
)
from fastdist.ops.halo import halo_exchange
from fastdist.ops.packed import all_to_all_qkv
from fastdist.ops.permutes import axis_index, axis_size, broadcast, ppermute, ring_shift
from fastdist.ops.ragged import exchange_sizes, indexed_all_to_all_v, ragged_all_to_all
from fastdist.ops.reductions import pmax, pmean, pmin, psum, pvary
from fastdist.ops.uneven import all_gather_v, gather_v, reduce_scatter_v, scatter_v

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "pvary",
    "all_gather",
    "psum_scatter",
    "all_gather_invariant",
    "local_chunk",
    "all_to_all",
    "all_to_all_4d",
    "all_to_all_qkv",
    "ppermute",
    "ring_shift",
    "halo_exchange",
    "broadcast",
    "axis_index",
    "axis_size",
    "all_gather_v",
    "reduce_scatter_v",
    "gather_v",
    "scatter_v",
    "ragged_all_to_all",
    "indexed_all_to_all_v",
    "exchange_sizes",
]
