"""Running a model, inside the backend processes: the handlers
(:mod:`~mmserver.execution.predictor`), the model families and their files
(:mod:`~mmserver.execution.families`), the predict paths verified at load
(:mod:`~mmserver.execution.fastpath`, built by :mod:`~mmserver.execution.candidates`) and a
DataFrame pipeline's compiled path (:mod:`~mmserver.execution.tablepath`)."""
