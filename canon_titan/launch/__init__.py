"""The job around the training processes, before and around torchrun: who owns a job's processes
and its dump folder (``ownership``: parent-death links, the dump folder's lock or lease), the
torchrun wrapper that turns a deliberate stop into its exit code (``torchrun``), and the checks
run once before launch (``prelaunch``: among them ``components.resume_checks``, which the
trainer's rank 0 runs again for every rank). The exit codes themselves are the processes'
(``components.exit_codes``)."""
