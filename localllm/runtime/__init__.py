"""Running a model: loading onto a device and the single-sequence session (:mod:`.session`),
the memory check (:mod:`.resources`), the static CUDA-graph decode step (:mod:`.graphs`), and
the one decode loop every front end consumes (:mod:`.generate`, with :mod:`.stop`)."""
