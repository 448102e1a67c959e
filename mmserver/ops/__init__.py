"""What an operator sees and the machine's limits: metrics (:mod:`~mmserver.ops.metrics`, the
backends' own in :mod:`~mmserver.ops.procmetrics`), the container's CPU and memory limits
(:mod:`~mmserver.ops.capacity`), logs (:mod:`~mmserver.ops.logs`), the lock on a state folder
(:mod:`~mmserver.ops.folderlock`), the heap and the garbage collector
(:mod:`~mmserver.ops.heap`), data capture (:mod:`~mmserver.ops.capture`) and the files of
the state folder written whole (:mod:`~mmserver.ops.statefile`)."""
