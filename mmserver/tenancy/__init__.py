"""Tenants: who may call which models, with which credentials, how often and how many at once
(the server option ``tenants``). :mod:`.tenants` reads the file, :mod:`.sigv4` verifies AWS
signatures, :mod:`.gate` is what the doors of the API ask."""
