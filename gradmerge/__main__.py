"""``python -m gradmerge``: the ``gradmerge`` command (:func:`gradmerge.cli.main`)."""

import sys

from gradmerge.cli import main

if __name__ == "__main__":
    sys.exit(main())
