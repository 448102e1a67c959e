"""A loaded model on the frontend: its pool (:mod:`~mmserver.serving.pool`: the bounded queue,
the workers, who gets the next batch), its workers (:mod:`~mmserver.serving.worker`) and the jobs
and the batch-cut rule (:mod:`~mmserver.serving.jobs`)."""
