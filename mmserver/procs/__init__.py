"""Processes of the frontend asked and answered on the event loop: frames on a process's pipe
(:mod:`~mmserver.procs.framing`, also the backends') and the side processes that speak them
(:mod:`~mmserver.procs.sidework`: the unpacking processes, asynchronous inference's S3 calls)."""
