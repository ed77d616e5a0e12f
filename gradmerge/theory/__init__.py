"""Exact reference models and derivation checks of the appendix (the theory testbed)."""
