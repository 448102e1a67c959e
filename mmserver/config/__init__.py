"""Options: the server's (:mod:`~mmserver.config.server`, from the command line, the
environment and ``--config``) and each model's (:mod:`~mmserver.config.model`, from its
``serving.properties``, each option declared once as a field)."""
