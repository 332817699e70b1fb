"""The one error type for bad input: every entry point prints its message as one line and exits 2."""


class InputError(Exception):
    """Bad user input (trace, config, profile). The message names the field and the fix."""


EXIT_INPUT_ERROR = 2
