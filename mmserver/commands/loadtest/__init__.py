"""Load generation and measurement, shared by ``mmserver recommend`` and the tools under
``scripts/`` (the benchmark, the stress tools, the routing experiment).

- :mod:`~mmserver.commands.loadtest.wrk` — one load run (closed or open loop, a traffic pattern)
  with wrk and ``load.lua``, or with :mod:`~mmserver.commands.loadtest.pyload` where wrk is not
  installed; its result, and the CPU the server's processes used meanwhile;
- :mod:`~mmserver.commands.loadtest.pyload` — the same runs from one Python process (asyncio on
  uvloop), on :mod:`~mmserver.commands.loadtest.users`;
- :mod:`~mmserver.commands.loadtest.users` — closed-loop users on kept-alive connections, the
  requests and what is kept of each answer the caller's, bounded in time and count: the tools'
  own loads (every answer checked, by instance, a list of requests sent once);
- :mod:`~mmserver.commands.loadtest.cpu` — CPU seconds of a process tree and of the whole machine;
- :mod:`~mmserver.commands.loadtest.client` — a blocking one-request-at-a-time client (probes,
  management calls), never a load generator.

Imported only by the tools: the server never imports this package.
"""
