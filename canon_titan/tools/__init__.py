"""Small utilities every layer may use, which know nothing of models or runs: files written
atomically (``fileio``), the process's runtime set-up on this machine (``runtime``: the CPU and
gloo compatibility shims, applied where a feature check says they are needed), and its start and
end without the garbage collector's walks over the imported world (``startup``)."""
