"""Small utilities every layer may use, which know nothing of models or runs: files written
atomically (``fileio``) and the process's runtime set-up on this machine (``runtime``: the CPU and
gloo compatibility shims, applied where a feature check says they are needed)."""
