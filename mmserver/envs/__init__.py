"""Per-model environments: a model whose folder holds a ``requirements.txt`` (an MLflow
folder's ``requirements.txt`` or ``python_env.yaml`` too) runs in a virtual environment built
for that requirement set, unless the server's own environment satisfies it.

- :mod:`~mmserver.envs.requirements`: the set a model folder asks for, normalized, its key, and
  whether the server's own distributions satisfy it;
- :mod:`~mmserver.envs.building`: one environment built (``uv``, else ``venv`` and pip) off the
  event loop, with a deadline, what it installed recorded beside it;
- :mod:`~mmserver.envs.registry`: the environments of a server: one build per set however many
  loads wait for it, failures remembered, the oldest unused removed past ``max_envs`` or the
  disk budget.

The backend processes of an environment are started from its interpreter by
:mod:`mmserver.backend.envprocs`.
"""
