"""Java-properties files (``--config FILE`` and each model's ``serving.properties``), and the
spellings of true and false every source of options shares."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mmserver.errors import ConfigError

#: The spellings of true and false (lower case) in the environment, on the command line, in
#: serving.properties and in the management API's parameters.
BOOLEANS: Mapping[str, bool] = {
    "true": True,
    "false": False,
    "1": True,
    "0": False,
    "yes": True,
    "no": False,
    "on": True,
    "off": False,
}


def boolean(text: str) -> bool | None:
    """``text`` as true or false (:data:`BOOLEANS`, in any case, white space around it
    ignored), or ``None`` when it spells neither."""
    return BOOLEANS.get(text.strip().lower())


def parse_properties(text: str) -> dict[str, str]:
    """Parse Java-properties text as ``java.util.Properties.load`` does: ``key=value``,
    ``key: value`` or ``key value``; ``#``/``!`` comment lines; a line ending in an odd number of
    backslashes continues on the next; the escapes ``\\t``, ``\\n``, ``\\f``, ``\\r``,
    ``\\uXXXX`` and backslash before any other character (``\\#``, ``\\=``, ``\\\\``...).
    A value keeps its trailing white space, as in Java (the server strips it when it reads a
    number or a name). Later keys win. A malformed ``\\uXXXX`` raises :class:`ConfigError`."""
    import javaproperties  # here: a model environment imports this module and lacks it

    try:
        return javaproperties.loads(text)
    except javaproperties.InvalidUEscapeError as exc:
        raise ConfigError(f"malformed \\uXXXX escape {exc.escape!r}") from None


def read_properties(path: Path) -> dict[str, str]:
    """The properties of the file ``path``, read as UTF-8, or as ISO-8859-1 (what
    ``Properties.load(InputStream)`` reads) when it is not valid UTF-8."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("iso-8859-1")
    try:
        return parse_properties(text)
    except ConfigError as exc:
        raise ConfigError(f"config file {path}: {exc.message}") from None
