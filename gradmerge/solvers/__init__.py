"""Solvers for the curvature operators, apart from the operators themselves.

- :mod:`gradmerge.solvers.solution`: :class:`Solution`, the one result type of every solve
  (value, method, iterations, relative residual, success; per-block parts);
- :mod:`gradmerge.solvers.spec`: :class:`SolverSpec`, the settings passed to each iterative
  solve (tol, maxiter, approximate, arithmetic, warm start);
- :mod:`gradmerge.solvers.kronecker`: exact solves of one or two Kronecker products per layer;
- :mod:`gradmerge.solvers.kfac_cg`: δ·I plus any number of Kronecker products per layer, by CG
  in the eigenbasis of the tasks' collapsed factors, certified in float64;
- :mod:`gradmerge.solvers.cg`: preconditioned CG over parameter dicts (sums of structures,
  matrix-free operators).
"""

from gradmerge.solvers.solution import Solution
from gradmerge.solvers.spec import SolverSpec

__all__ = ["Solution", "SolverSpec"]
