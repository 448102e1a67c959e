"""The routing experiment of the cluster (``scripts/cluster experiment``, see ``--help``).

The cluster itself is the package's ``mmserver cluster`` (:mod:`mmserver.commands.cluster`); the
experiment starts its instances and balancers from there. Modules:

- :mod:`clusterlib.experiment` — the experiment: RANDOM against LEAST_OUTSTANDING_REQUESTS and
  MODEL_AFFINITY, its runs, its table and plot;
- :mod:`clusterlib.load` — its closed-loop users (the package's load generator's,
  :mod:`mmserver.commands.loadtest.users`);
- :mod:`clusterlib.models` — its variable-latency model;
- :mod:`clusterlib.queueing` — what queueing theory expects of it.
"""
