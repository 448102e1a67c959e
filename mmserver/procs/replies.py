"""What the frontend reads from a backend process that runs a model's own code (a fully trusted
model in a process of its own): its replies are unpickled by an unpickler that rebuilds data
only (:func:`data_loads`), so that code in that process cannot make the frontend run code by
the replies it sends. The shared processes, which run no model's code, are read as they are."""

from __future__ import annotations

import io
import pickle
from typing import Any

#: The globals a reply may name: the replies' own records, NumPy's scalars and arrays (a
#: signature's numbers, a describe's), and the standard containers.
_ALLOWED = frozenset(
    {
        ("mmserver.backend.wire", "LoadInfo"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
        ("collections", "OrderedDict"),
        ("copyreg", "_reconstructor"),
    }
)


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(
                f"a reply of a process running a model's own code names {module}.{name}, "
                "which replies never hold"
            )
        return super().find_class(module, name)


def data_loads(data: bytes | bytearray | memoryview) -> Any:
    """``pickle.loads`` of a reply that may come from code the frontend does not trust: only
    the replies' records, NumPy's scalars and arrays and plain containers are rebuilt; anything
    else raises :class:`pickle.UnpicklingError`."""
    return _DataUnpickler(io.BytesIO(data)).load()
