"""Errors the command line turns into one-line messages."""


class CliError(Exception):
    """A user-facing error; str() is the whole message."""


def describe(e: BaseException) -> str:
    """One line for an exception: the message of known error kinds, type and message otherwise."""
    known = {"CliError", "ModelFileError", "ValueError", "FileNotFoundError", "PermissionError", "IsADirectoryError",
             "UnicodeDecodeError", "OSError", "MemoryError"}
    msg = str(e).strip().replace("\n", " ") or type(e).__name__
    if type(e).__name__ in known:
        return msg
    return f"{type(e).__name__}: {msg}"
