"""Curvature estimators over (model, data, loss)."""
