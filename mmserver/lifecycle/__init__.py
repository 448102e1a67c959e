"""A model's life from the store to unloading: the models the server knows
(:mod:`~mmserver.lifecycle.catalog`, one :mod:`~mmserver.lifecycle.record` each), loading
(:mod:`~mmserver.lifecycle.loading`, its file work in :mod:`~mmserver.lifecycle.files`), room for
it (:mod:`~mmserver.lifecycle.room`: the memory budget and eviction), versions
(:mod:`~mmserver.lifecycle.versions`), shadow runs (:mod:`~mmserver.lifecycle.shadow`) and the
warm set, loaded again after a restart (:mod:`~mmserver.lifecycle.warmset`, its file in
:mod:`~mmserver.lifecycle.warmfile`)."""
