"""Load generation and measurement, shared by ``mmserver recommend`` and ``scripts/bench``.

- :mod:`~mmserver.commands.loadtest.wrk` — one load run (closed or open loop, a traffic pattern)
  with wrk and ``load.lua``, or with :mod:`~mmserver.commands.loadtest.pyload` where wrk is not
  installed; its result, and the CPU the server's processes used meanwhile;
- :mod:`~mmserver.commands.loadtest.pyload` — the same runs from one Python process (asyncio on
  uvloop);
- :mod:`~mmserver.commands.loadtest.cpu` — CPU seconds of a process tree and of the whole machine;
- :mod:`~mmserver.commands.loadtest.client` — a blocking one-request-at-a-time client (probes,
  management calls), never a load generator.

Imported only by the tools: the server never imports this package.
"""
