"""Imported by the fork server: the optional model libraries, each if it imports at all.

A library whose native part cannot load (LightGBM without the system's OpenMP runtime,
``libgomp.so.1``) would otherwise end the fork server, and with it every backend process. It is
left out here; a model that needs it fails its own load with the reason
(:func:`mmserver.execution.families.load_model`), and the other models are served.
"""

from __future__ import annotations

import contextlib
import importlib

from mmserver.execution.families import FAMILIES

OPTIONAL = tuple(family.package for family in FAMILIES if family.package)

for _name in OPTIONAL:
    with contextlib.suppress(Exception):
        importlib.import_module(_name)
