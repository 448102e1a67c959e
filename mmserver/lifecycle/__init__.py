"""A model's life from the store to unloading: the models the server knows
(:mod:`~mmserver.lifecycle.catalog`, one :mod:`~mmserver.lifecycle.record` each), loading
(:mod:`~mmserver.lifecycle.loading`, its file work in :mod:`~mmserver.lifecycle.files`), room for
it (:mod:`~mmserver.lifecycle.room`: the memory budget and eviction), versions
(:mod:`~mmserver.lifecycle.versions`) and shadow runs (:mod:`~mmserver.lifecycle.shadow`)."""
