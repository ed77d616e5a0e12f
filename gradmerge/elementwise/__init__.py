"""The merge rules for elementwise curvatures (diagonal and δ·I), fused and chunked.

When every curvature of a merge or removal is diagonal or a scaled identity, Eq. 6 and Eq. 13 are
elementwise, and :mod:`gradmerge.merge` evaluates them here in one pass over memory instead of
through the operator algebra (same result, bit for bit):

- :mod:`gradmerge.elementwise.matching`: Eq. 6 (:func:`gradmerge.gradient_matching` and its
  special cases), with the :class:`~gradmerge.elementwise.matching.Kernel` interface that the
  compiled loops of :mod:`gradmerge.kernels` plug into;
- :mod:`gradmerge.elementwise.removal`: Eq. 13 (:func:`gradmerge.remove`) and the rounding error
  it amplifies (:class:`~gradmerge.elementwise.removal.RemovalStats`).

Part of the core: it imports curvature and params only, compiles nothing and maps no memory.
"""
