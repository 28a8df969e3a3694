"""The one error type of a scan: bad input the user can fix (a file, a flag), named in the message."""

from __future__ import annotations


class ScanInputError(ValueError):
    """Bad input: an unreadable checkpoint, missing Q/K tensors, shapes changing between
    checkpoints, too few checkpoints, or a bad flag value. The message names the file or the flag
    and what was expected; the command line turns it into exit code 2 and writes nothing."""
