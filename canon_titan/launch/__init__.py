"""The job around the training processes, before and around torchrun: who owns a job's processes
and its dump folder (``ownership``: parent-death links, the dump folder's lock or lease), the
torchrun wrapper that turns a deliberate stop into its exit code (``torchrun``), and the checks
that a resume continues the run it claims to (``resume_checks``, which ``canon-titan train`` runs
before launch and each rank again before it loads). The exit codes themselves are the processes'
(``components.exit_codes``)."""
