"""What a training process plugs into TorchTitan's trainer, one concern a module (as TorchTitan's
``components/``): the checkpointer with its save guarantees, the loss, the float8 conversion, the
divergence guard and the per-step records it is read from, the stop signals (preemption), the
checks that a checkpoint can continue a run, the metrics reader, and the exit codes a process ends
with, which the launcher and the SLURM script read."""
