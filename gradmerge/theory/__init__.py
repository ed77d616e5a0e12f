"""Exact reference models and derivation checks of the appendix (the theory testbed).

The code half of a pair: the repository's top-level ``theory/`` folder holds the documents (one
per appendix section, and ERRATA.md), this package the checks they cite, installed with
gradmerge so that ``gradmerge verify`` runs from an install (docs/architecture.md, "Layout").
"""
