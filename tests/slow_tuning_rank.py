"""A torchrun entry for tests/test_linear_tuning.py: ``canon_titan.train`` with rank 1's kernel
tuning made
``$SLOW_TUNING_S`` seconds slower than the other ranks' (a rank on a busier host, or one without the
tuning results on its disk that the others read)."""

import os
import sys
import time

from canon_titan.models.common import linear_tuning

run_mixer = linear_tuning.run_mixer


def slow_run_mixer(*args, **kwargs):
    if os.environ["RANK"] == "1":
        time.sleep(float(os.environ["SLOW_TUNING_S"]))
    return run_mixer(*args, **kwargs)


linear_tuning.run_mixer = slow_run_mixer

if __name__ == "__main__":
    from canon_titan.train import main

    sys.exit(main())
