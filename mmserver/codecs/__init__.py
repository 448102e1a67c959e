"""What travels in a request and its answer, run where the model runs: request bodies to what
the model takes (:mod:`~mmserver.codecs.requests`), predictions to answer bodies
(:mod:`~mmserver.codecs.answers`), rows and named columns to a model's typed columns
(:mod:`~mmserver.codecs.tabular`), what a model takes (:mod:`~mmserver.codecs.schema`), and the
Open Inference Protocol: its tensors to rows (:mod:`~mmserver.codecs.v2_requests`), outputs to
its answers (:mod:`~mmserver.codecs.v2_answers`) and what both share, its datatypes and a decoded
request (:mod:`~mmserver.codecs.v2`)."""
