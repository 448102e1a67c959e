"""``mmserver transform``: a dataset through a model, offline (SageMaker's batch transform).

The modules, in the order a job runs them: :mod:`~mmserver.transform.options` (the job's
description, from the command line), :mod:`~mmserver.transform.places` (where input files are
listed and read and outputs written: folders, ``s3://`` prefixes, manifests),
:mod:`~mmserver.transform.records` (files split into records, records packed into payloads,
answers split back into output lines and joined to their input),
:mod:`~mmserver.transform.cuts` (a file's payloads: slices of its bytes when its lines are its
records, runs of its records otherwise),
:mod:`~mmserver.transform.journal` (the progress beside the output, so a rerun continues),
:mod:`~mmserver.transform.sender` (requests to a server or a cluster, with their retries,
over :mod:`~mmserver.transform.connections`),
:mod:`~mmserver.transform.progress` (what a person watching sees) and
:mod:`~mmserver.transform.job` (the run). :mod:`~mmserver.transform.cli` is the command; it
starts a server of its own (:mod:`~mmserver.transform.local`) when no ``--url`` is given.

Nothing in the server imports this package.
"""
