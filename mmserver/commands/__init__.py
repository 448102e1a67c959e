"""The commands beside the server, each imported only when it runs: ``mmserver cluster``
(:mod:`~mmserver.commands.cluster`), ``mmserver transform`` (:mod:`~mmserver.commands.transform`),
``mmserver recommend`` (:mod:`~mmserver.commands.recommend`), ``mmserver example-store``
(:mod:`~mmserver.commands.examples`) and the load generator they and ``scripts/`` share
(:mod:`~mmserver.commands.loadtest`). The server never imports this package."""
