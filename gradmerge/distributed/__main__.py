"""``python -m gradmerge.distributed``: moved to ``python -m gradmerge.commands.distributed``.

:mod:`gradmerge.distributed` is a library and imports no command module (the command line uses
it, never the other way round); its command line is :mod:`gradmerge.commands.distributed`::

    torchrun --nproc-per-node N -m gradmerge.commands.distributed curvature MODEL DATA OUT
    torchrun --nproc-per-node N -m gradmerge.commands.distributed merge CONFIG.yaml OUT_DIR
"""

import sys

if __name__ == "__main__":
    sys.exit(
        "gradmerge.distributed is the library; its command line moved: run "
        f"`torchrun ... -m gradmerge.commands.distributed {' '.join(sys.argv[1:]) or '...'}`"
    )
