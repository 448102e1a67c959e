"""A loaded model on the frontend: its pool (:mod:`~mmserver.serving.pool`: the bounded queue,
who gets the next batch, the lane), composed of its worker group (:mod:`~mmserver.serving.workers`:
the workers' start and retirement) and its copies in the backend slots
(:mod:`~mmserver.serving.binding`: their loads and memory); each worker
(:mod:`~mmserver.serving.worker`), the jobs and the batch-cut rule (:mod:`~mmserver.serving.jobs`),
and the alarms of the pool's timers (:mod:`~mmserver.serving.alarm`)."""
