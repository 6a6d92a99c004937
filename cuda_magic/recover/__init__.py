"""Running a guarded call and recovering from its out-of-memory error: the engine, the retry policy,
releasing what the failure held, the notebook's own references, offloading, and the reports."""
