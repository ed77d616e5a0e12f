"""gradmerge's benchmark suite: one module per study, each run from the repository's root as
``python -m benchmarks.<name>`` (``--help`` for its options), each writing one record of
``benchmarks.record.SCHEMA`` to ``benchmarks/results/``. ``benchmarks/README.md`` maps every
figure to its command and results file. Not part of the installed package."""
