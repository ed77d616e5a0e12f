"""``torchrun --nproc-per-node N -m gradmerge.distributed curvature MODEL DATA OUT [options]``."""

import sys

from gradmerge.distributed.launch import main

if __name__ == "__main__":
    sys.exit(main())
