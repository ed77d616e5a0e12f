"""The foundation: internal helpers, the floor every other part of gradmerge builds on.

Nothing here is public API (import the public names from ``gradmerge``, ``gradmerge.errors``,
``gradmerge.io``, ...); each module has one job and serves several parts, none of which is its
main user:

==============  ====================================================================================
module          its job
==============  ====================================================================================
``settings``    each setting declared once (:func:`~gradmerge.foundation.settings.setting`): the
                checks, messages, ``--help`` lines and docs/config.md tables come from it
``guard``       the output guard: where a run may write, staged writes renamed into place, the
                inputs' snapshot (docs/reliability.md)
``files``       temporary files and folders for atomic writes, with ordinary permissions
``readahead``   read-ahead hints (``posix_fadvise``) given by a background thread
``devices``     device names → devices, checked once
``extras``      optional dependencies, grouped as the package's extras
``lazy``        names of a package imported on first access (PEP 562), and the refusal of a
                module path that moved
``text``        lists of names shortened for error messages
==============  ====================================================================================

The foundation imports nothing else from gradmerge except the typed errors,
:mod:`gradmerge.errors` (public, at the package's root, and importing nothing itself), so that
any part may use it without a cycle (``proofs_tests/unit/test_import_layers.py`` checks it).
This package's ``__init__`` imports none of its modules: each is imported where it is used.
"""
