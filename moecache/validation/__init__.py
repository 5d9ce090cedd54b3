"""`moecache validate`'s parts (docs/validation.md): the baseline strategies (baselines.py), one
measured run (runs.py) with its trace recorded through the runtime's visits (recording.py), peak memory
(memory.py), output agreement (agreement.py), the workload's requests (workloads.py), the execution
path of a request (generation.py: transformers or the fast loop), trace-forced workloads (forcing.py),
every run on one model offloaded once (pipeline.py), the simulator's prediction (predict.py, through fidelity.py) and
the artifact's tables (tables.py). The stage itself: moecache/stages/validate.py."""
