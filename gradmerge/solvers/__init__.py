"""Solvers for the curvature operators, apart from the operators themselves.

- :mod:`gradmerge.solvers.solution`: :class:`Solution`, the one result type of every solve
  (value, method, iterations, relative residual, :class:`Result`; per-block parts);
- :mod:`gradmerge.solvers.spec`: the solver objects, one per algorithm, each holding only its
  settings and passed to the call that solves: :class:`CG` (tol, maxiter) for sums and
  matrix-free operators, :class:`KroneckerCG` (also approximate, arithmetic, warm start) for
  K-FAC; ``SolverSpec`` is :class:`KroneckerCG`'s former name;
- :mod:`gradmerge.solvers.kronecker`: exact solves of one or two Kronecker products per layer;
- :mod:`gradmerge.solvers.kfac_cg`: δ·I plus any number of Kronecker products per layer, by CG
  in the eigenbasis of the tasks' collapsed factors, certified in float64;
- :mod:`gradmerge.solvers.cg`: preconditioned CG over parameter dicts (sums of structures,
  matrix-free operators).
"""

from gradmerge.solvers.solution import Result, Solution
from gradmerge.solvers.spec import CG, KroneckerCG, Solver, SolverSpec

__all__ = ["CG", "KroneckerCG", "Result", "Solution", "Solver", "SolverSpec"]
