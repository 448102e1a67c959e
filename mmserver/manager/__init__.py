"""The WorkLoadManager (:mod:`~mmserver.manager.wlm`), the façade every door calls, and the
submission of a request to its model's queue (:mod:`~mmserver.manager.submission`)."""
