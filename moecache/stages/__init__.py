"""One module per pipeline stage; each exposes `run(cfg) -> StageResult`."""
