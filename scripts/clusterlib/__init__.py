"""Scale-out: several mmserver instances behind HAProxy (`scripts/cluster`, see ``--help``).

Modules, from the command down:

- :mod:`clusterlib.cli` — the ``scripts/cluster`` command (start, run, stop, status, config,
  experiment);
- :mod:`clusterlib.cluster` — a cluster: its instances, its balancer, its state directory and
  the stop order;
- :mod:`clusterlib.balancer` — the routing strategies and the HAProxy configuration made from
  ``haproxy.cfg.in``; the HAProxy process;
- :mod:`clusterlib.instances` — one ``mmserver serve`` process;
- :mod:`clusterlib.procs` — processes by pid: identity, descendants, stopping, memory;
- :mod:`clusterlib.experiment`, :mod:`clusterlib.load`, :mod:`clusterlib.models`,
  :mod:`clusterlib.queueing` — the routing experiment, its closed-loop users, its
  variable-latency model, and what queueing theory expects of it.
"""
