"""The ``gradmerge`` subcommands, one module each (``add_parser(sub)`` and ``run(args)``)."""
