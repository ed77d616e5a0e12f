"""``torchrun --nproc-per-node N -m gradmerge.distributed curvature MODEL DATA OUT [options]``.

The package's one link to the command line (:mod:`gradmerge.commands.distributed`): run as a
script only; the library modules of :mod:`gradmerge.distributed` import no command module.
"""

import sys

from gradmerge.commands.distributed import main

if __name__ == "__main__":
    sys.exit(main())
