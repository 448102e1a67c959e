"""Scale-out: several mmserver instances behind HAProxy on one port (``mmserver cluster``, see
``--help``).

The cluster runs each instance as an ``mmserver serve`` child process and imports nothing of
the server; of the server, only :mod:`mmserver.cli` imports it, to hand ``mmserver cluster``
its arguments. Modules, from the command down:

- :mod:`mmserver.commands.cluster.cli` — the ``mmserver cluster`` command (start, run, stop,
  restart, upgrade, status, config);
- :mod:`mmserver.commands.cluster.cluster` — a cluster: its instances, its balancer, its state
  directory and the stop order;
- :mod:`mmserver.commands.cluster.rolling` — a rolling restart: each instance out of HAProxy,
  restarted, warm and back, one at a time;
- :mod:`mmserver.commands.cluster.runtime` — HAProxy's runtime API on the cluster's admin socket;
- :mod:`mmserver.commands.cluster.balancer` — the routing strategies and the HAProxy configuration
  made from ``haproxy.cfg.in`` (package data); the HAProxy process;
- :mod:`mmserver.commands.cluster.instances` — one ``mmserver serve`` process.

Below them, shared with ``mmserver transform``, ``mmserver recommend`` and the tools under
``scripts/``: :mod:`mmserver.commands.launch` (a child process started, ready and stopped),
:mod:`mmserver.commands.procs` (processes by pid and start time) and
:mod:`mmserver.commands.procfs` (process trees, free loopback ports).
"""
