"""``canon-titan plan``: one rank of a run built with the real trainer and stepped on fake tensors
and a fake process group (``fake_world``), the step recorded op by op (``recorder``, with the FLOP
formulas of our custom ops in ``flops``), the time and compile models (``estimate``), the GPU table
(``gpus``), the orchestration and advice (``planner``), and the table and JSON (``report``)."""
