"""The package's version, in one place: ``gradmerge.__version__``, the ``source.gradmerge`` and
``gradmerge_version`` records of written files, and ``pyproject.toml`` (read dynamically) all use
it.
"""

__version__ = "0.1.0"
