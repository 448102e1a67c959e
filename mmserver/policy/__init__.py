"""The pure decisions, no I/O and no state of their own: DJL's scaling rule
(:mod:`~mmserver.policy.scaling`), the eviction victim (:mod:`~mmserver.policy.eviction`), measured
cost, lanes and fair order (:mod:`~mmserver.policy.scheduling`) and a model's rollout of versions
(:mod:`~mmserver.policy.rollout`)."""
