"""Fast kernels behind the diagonal merge: compiled single loops, and output memory.

The pure rules (:mod:`gradmerge.merge`) evaluate Eq. 6 for elementwise curvatures in a chunked
torch pass (:mod:`gradmerge.elementwise.matching`); they never compile code or map memory
themselves. A faster loop is handed in, ``kernel=`` (a :class:`Fused`): the streaming engine does so
for every job and the in-memory rules by default, both with :func:`select` (the package's facade
plugs it into the rules' default, ``gradmerge.elementwise.matching.SELECTED``):

- :mod:`~gradmerge.kernels.fused` — :class:`Fused`, one compiled loop per tensor (the C loop of
  :mod:`~gradmerge.kernels.native` on CPUs, ``torch.compile`` elsewhere), certified in the same
  pass, bit-identical to the chunked pass; :func:`fused_kernels` and ``$GRADMERGE_FUSED`` set the
  mode :func:`select` reads;
- :mod:`~gradmerge.kernels.native` — the C loop, built by the system C compiler and cached;
- :mod:`~gradmerge.kernels.memory` — output tensors on transparent huge pages, recycled within a
  streamed job.

Example:
    >>> import torch, gradmerge as gm
    >>> from gradmerge.kernels import Fused
    >>> base, ft = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
    >>> gm.task_arithmetic(base, [ft], kernel=Fused("on"))
    {'w': tensor([1., 1., 1.])}
"""

from gradmerge.kernels.fused import Fused, fused_kernels, mode, select

__all__ = ["Fused", "fused_kernels", "mode", "select"]
