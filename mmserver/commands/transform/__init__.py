"""``mmserver transform``: a dataset through a model, offline (SageMaker's batch transform).

The modules, in the order a job runs them: :mod:`~mmserver.commands.transform.options` (the job's
description, from the command line), :mod:`~mmserver.commands.transform.places` (where input files
are listed and read and outputs written: folders, ``s3://`` prefixes, manifests),
:mod:`~mmserver.commands.transform.records` (files split into records, records packed into payloads,
answers split back into output lines and joined to their input),
:mod:`~mmserver.commands.transform.cuts` (a file's payloads: slices of its bytes when its lines are
its records, runs of its records otherwise),
:mod:`~mmserver.commands.transform.journal` (the progress beside the output, so a rerun continues),
:mod:`~mmserver.commands.transform.sender` (requests to a server or a cluster, with their retries,
over :mod:`~mmserver.commands.transform.connections`),
:mod:`~mmserver.commands.transform.progress` (what a person watching sees) and
:mod:`~mmserver.commands.transform.job` (the run). :mod:`~mmserver.commands.transform.cli` is the
command; it starts a server of its own (:mod:`~mmserver.commands.transform.local`) when no ``--url``
is given.

Nothing in the server imports this package.
"""
