"""The suite's one wall-clock number: how long a test waits for a child process (or a notebook
cell) before it calls it hung.

A guard, never a verdict: no test passes or fails by how fast its work runs. On the shared 2-core
machine that runs the suite, a fresh interpreter importing torch took 84-98 s of wall time under
load (2.8 s of CPU), so any limit near a normal run's duration fails sound code; this one only
stops a child that would otherwise hang the suite.

Example::

    subprocess.run(cmd, timeout=HANG_S, check=True)
"""

HANG_S = 1800
