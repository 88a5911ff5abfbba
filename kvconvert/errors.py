"""User-facing errors: the CLI prints these as one line, without a traceback."""


class KVConvertError(Exception):
    """An error caused by the user's input (bad model, bad flag, existing output...).

    The message must say what is wrong and what to do about it, in one line.
    """
