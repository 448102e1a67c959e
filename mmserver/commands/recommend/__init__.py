"""``mmserver recommend``: capacity advice for one model.

Data flow, top to bottom: :mod:`~.cli` (arguments, the time budget, output) →
:mod:`~.search` (per setting, the highest rate under the p99 target, run with
:mod:`mmserver.commands.loadtest`) → :mod:`~.target` (the server: started here or at a URL, settings
applied with the management API) → :mod:`~.settings` (the grid, the ``serving.properties``
lines); :mod:`~.advice` turns the results into the recommendation, :mod:`~.plot` draws them,
:mod:`~.progress` shows the runs going. Imported only for this command: the server never imports
it.
"""
